#!/usr/bin/env bash
# Issue 40's run list on one lent GPU, in order of what matters most, each step with its own time limit so that
# one step that hangs leaves the others their time. Run from the repository root on the GPU machine, with the
# wheels of DeepSpeed 0.19.8 and what the image lacks in .whl/ (see docs/benchmarks.md, "GPU training"):
#
#     bash benchmarks/gpu_session.sh RESULTS_DIR [STEP...]
#
# STEPS (default: all, in this order): train alst128 offload hybrid pytest triton. Their limits add up to more than
# one device call may take (10 minutes): name the steps of each call. Measured on an H100 (2026-11-26): the native
# op builds in 43 s; train (steps 2) took 274 s; hybrid and triton did not finish inside 60 and 45 s (the first
# compile of flash-linear-attention's and ds-usp's Triton kernels), hence their limits now.
#
# Writes into RESULTS_DIR: env.txt (device, driver, versions), gpu_train.json + train.log (1B shape: ds-usp, ALST
# full, ds-usp without its memory features), gpu_offload.json (offload_activations off at the longest S),
# gpu_hybrid.json (hybrid families on CUDA against the unsharded model), triton_softcap.json, pytest.log (the GPU
# tests and the quick subset on the GPU host).
set -u
R=${1:?results folder}
shift
STEPS=${*:-train alst128 offload hybrid pytest triton}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$R/env.txt" 2>&1 || { cat "$R/env.txt"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
step() {  # step SECONDS NAME COMMAND...: one step under its limit, its output in session.log
    local limit=$1 name=$2; shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
    echo "=== $name ($(date +%T), limit ${limit}s)" | tee -a "$R/session.log"
    timeout "$limit" "$@" >> "$R/session.log" 2>&1
    echo "=== $name: exit $? ($(date +%T))" | tee -a "$R/session.log"
}
{ nvidia-smi; nvcc --version | tail -2; python3 - <<'EOF'
import torch, triton, transformers, deepspeed, importlib.util
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers",
      transformers.__version__, "deepspeed", deepspeed.__version__, torch.cuda.get_device_name())
print({m: importlib.util.find_spec(m) is not None for m in ("flash_attn", "fla", "mamba_ssm", "causal_conv1d")})
EOF
} >> "$R/env.txt" 2>&1
# the native CUDA op JIT-built in the background while ALST (which does not use it) trains first, so that no
# ds-usp step waits for nvcc inside its timed steps (a worker finding the build's lock waits for it)
MAX_JOBS=8 python3 -c "import torch; from ds_usp.native import resolve_native_op as r; print('native op:', \
    r(True, torch.device('cuda')).source, r(True, torch.device('cpu')).source)" > "$R/build.log" 2>&1 &
cd benchmarks
# the whole training step, 1B Llama-3 shape, bf16, ZeRO-3, S doubling from 16K (the GPU otherwise idle)
step 330 train python3 gpu_train.py --shape 1b --systems "ALST full,ds-usp,ds-usp off" --steps 3 --budget 120 --profile \
    --json "$R/gpu_train.json"
# DeepSpeed's ALST recipe at 128K, which the budget above may stop before
step 100 alst128 python3 gpu_train.py --shape 1b --systems "ALST full" --start 131072 --max-seq 131072 --steps 2 \
    --budget 90 --json "$R/gpu_alst128.json"
# offload_activations: "ds-usp" above offloads at 128K ("auto"); the same step with it off
step 90 offload python3 gpu_train.py --shape 1b --systems "ds-usp no offload" --start 131072 --max-seq 131072 \
    --steps 2 --budget 60 --json "$R/gpu_offload.json"
# hybrid families with the kernels transformers picks on CUDA, against the unsharded model
step 150 hybrid python3 gpu_hybrid.py --families qwen3_5_text,jamba,nemotron_h --json "$R/gpu_hybrid.json"
cd ..
# the GPU tests (native CUDA op, Triton compiled, CUDA kernels) on the GPU host; the build above is done by then
wait
step 150 pytest python3 -m pytest -q -m gpu -p no:cacheprovider
# the Triton kernels with soft-capping against PyTorch's attention
step 90 triton python3 benchmarks/triton_attn.py --seqs 16384 --softcap 50 --iters 3 --warmup 1 \
    --json "$R/triton_softcap.json"
tail -5 "$R/session.log"

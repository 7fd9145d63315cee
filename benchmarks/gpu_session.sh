#!/usr/bin/env bash
# The GPU run list, one step per measurement, each under its own time limit so that one step that hangs leaves the
# others their time. Run from the repository root on the GPU machine, with the wheels of DeepSpeed 0.19.8 and what the
# image lacks in .whl/ (see docs/benchmarks.md, "GPU training"; without .whl/ the installed packages are used):
#
#     bash benchmarks/gpu_session.sh RESULTS_DIR [STEP...]
#
# Issue 65's run (name its steps: issue65 runs them in this order, the essential rows first; limits 1270 s in all,
# more than one 10-minute device call: a session with 15 minutes takes peers3b usp3b128 budget3b and says which were
# left, the next one longest3b peers1b):
#   peers3b      the 3B Llama-3.2 shape (hd 128) at 16K and 32K: ds-usp "auto" and each peer configuration (Liger's
#                fused linear cross-entropy + HF checkpointing, ALST's tiled loss alone, plain HF, ALST full), 3 steps
#                each, ds-usp's 16K step profiled (300 s)
#   usp3b128     ds-usp on the 3B shape at 128K, 2 timed steps and one profiled: MFU (target 45%) (150 s)
#   budget3b     ds-usp "auto" with usp.memory_gib 60 at 32K and 64K: its peak under 60 GiB (120 s)
#   longest3b    the longest S on one GPU, 3B shape: ds-usp from 192K and ALST full offload (the longest peer) from
#                128K, S x 1.5 each step, one step per S, until out of memory; the planner's prediction printed
#                first (400 s)
#   peers1b      the 1.5B shape at 16K-64K, ds-usp and the peers as peers3b (300 s)
# Issue 63's shared-GPU run (name it: shared4; after issue 65's steps in the list below, whatever order it is named in):
#   shared4      4 ranks sharing the GPU over gloo (benchmarks/gpu_shared.py): a small bf16 Llama (hidden 512, 2 layers)
#                trained 3 steps at 2x2 and 1x4 on a packed row and on rows of 8K to 64K, against one process in bf16
#                and fp32; a profiled step per run: host syncs and reads inside the layers, staged ring exchanges
#                (200 s; the jobs' budgets 40 s + 100 s of steps; writes gpu_shared.json; SHAPE=tiny: its --dry-run)
# Default STEPS: issue 49's first run (limits 470 s, about 8 minutes with the setup): attention alst usp alstoffload.
#   attention    ds-usp's flash SDPA against cuDNN's SDPA with log-sum-exp, forward and backward, 16K-128K (50 s)
#   alst         ALST full at 16K, 32K, 64K and 128K, four timed steps each, one profiled step at 16K (180 s; from
#                the H100 rows of issue 40 about 170 s: 20 s to build, 1.98, 3.41, 8.20 and 22.2 s a step)
#   usp          ds-usp "auto" at the same lengths, four timed steps each, one profiled step at 16K and 128K (170 s)
#   alstoffload  ALST full with DeepSpeed's checkpoint offload (CheckpointHiddenStatesOffload) at 128K, 2 steps (70 s)
# Every step's row is written as soon as that step is done: a step stopped by its limit keeps the steps it finished.
# Issue 40's steps, by name: train alst128 offload hybrid pytest triton (their limits add up to more than one device
# call may take, 10 minutes: name the steps of each call). Measured on an H100 (2026-11-26): the native op builds in
# 43 s; train (steps 2) took 274 s; hybrid and triton did not finish inside 60 and 45 s (the first compile of
# flash-linear-attention's and ds-usp's Triton kernels), hence their limits now.
#
# A dry run on CPU (every path of the first run on the tiny shape; no timings worth reading):
#     SHAPE=tiny FIRST=64 LAST=256 ATTENTION_SEQS=256 bash benchmarks/gpu_session.sh /tmp/dry
#
# Writes into RESULTS_DIR: env.txt (device, driver, versions), session.log (every step's output), and per step:
# gpu_attention.json, gpu_alst.json, gpu_usp.json, gpu_alst_offload.json (rows for docs/benchmarks.md; profiled
# steps' chrome traces in traces/); issue 40's gpu_train.json + train.log, gpu_offload.json, gpu_hybrid.json,
# triton_softcap.json, pytest.log.
set -u
R=${1:?results folder}
shift
STEPS=${*:-attention alst usp alstoffload}
STEPS=${STEPS/issue65/peers3b usp3b128 budget3b longest3b peers1b}
mkdir -p "$R"
R=$(cd "$R" && pwd)
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl > "$R/env.txt" 2>&1 || { cat "$R/env.txt"; exit 1; }
fi
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
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "triton",
      triton.__version__, "transformers", transformers.__version__, "deepspeed", deepspeed.__version__,
      torch.cuda.get_device_name())
print({m: importlib.util.find_spec(m) is not None for m in ("flash_attn", "fla", "mamba_ssm", "causal_conv1d")})
EOF
} >> "$R/env.txt" 2>&1
python3 -c "import deepspeed" 2>/dev/null || { echo "no DeepSpeed: put its wheel in .whl/"; exit 1; }
# the native CUDA op JIT-built in the background while the attention kernels and ALST (neither uses it) run first, so
# that no ds-usp step waits for nvcc inside its timed steps (a worker finding the build's lock waits for it)
MAX_JOBS=8 python3 -c "import torch; from ds_usp.native import resolve_native_op as r; print('native op:', \
    r(True, torch.device('cuda')).source, r(True, torch.device('cpu')).source)" > "$R/build.log" 2>&1 &
cd benchmarks
# ---- issue 49's first run: the 1.5B Llama-3 shape, bf16, ZeRO-3, world size 1, 16K to 128K (the GPU otherwise idle)
SHAPE=${SHAPE:-1b} FIRST=${FIRST:-16384} LAST=${LAST:-131072}
step 50 attention python3 gpu_train.py --attention --shape "$SHAPE" \
    --seqs "${ATTENTION_SEQS:-16384,32768,65536,131072}" --iters 3 --json "$R/gpu_attention.json"
LENGTHS=(--shape "$SHAPE" --start "$FIRST" --max-seq "$LAST" --steps 4 --budget 600 --trace-dir "$R/traces")
step 180 alst python3 gpu_train.py "${LENGTHS[@]}" --systems "ALST full" --profile-seqs "$FIRST" \
    --json "$R/gpu_alst.json"
step 170 usp python3 gpu_train.py "${LENGTHS[@]}" --systems "ds-usp" --profile-seqs "$FIRST,$LAST" \
    --json "$R/gpu_usp.json"
step 70 alstoffload python3 gpu_train.py --shape "$SHAPE" --systems "ALST full offload" --start "$LAST" \
    --max-seq "$LAST" --steps 2 --budget 600 --json "$R/gpu_alst_offload.json"
# ---- issue 65: the peers at their best, the longest sequence, MFU, the budget (3B: SHAPE3, 1.5B: SHAPE)
SHAPE3=${SHAPE3:-3b} PEERS="ds-usp,Liger,ALST tiled loss,HF plain,ALST full"
step 300 peers3b python3 gpu_train.py --shape "$SHAPE3" --systems "$PEERS" --start "$FIRST" --max-seq $((FIRST * 2)) \
    --steps 3 --budget 120 --profile-seqs "$FIRST" --json "$R/gpu_peers3b.json"
step 150 usp3b128 python3 gpu_train.py --shape "$SHAPE3" --systems ds-usp --start "$LAST" --max-seq "$LAST" \
    --steps 2 --budget 120 --profile-seqs "$LAST" --trace-dir "$R/traces" --json "$R/gpu_usp3b128.json"
step 120 budget3b python3 gpu_train.py --shape "$SHAPE3" --systems "ds-usp budget" --memory-gib "${BUDGET_GIB:-60}" \
    --start $((FIRST * 2)) --max-seq $((FIRST * 4)) --steps 2 --budget 100 --json "$R/gpu_budget3b.json"
step 250 longest3b python3 gpu_train.py --shape "$SHAPE3" --systems "ds-usp" --start $((LAST * 3 / 2)) \
    --max-seq $((LAST * 16)) --growth 1.5 --steps 1 --one-step-from 0 --budget 200 --json "$R/gpu_longest3b.json"
step 150 longest3b python3 gpu_train.py --shape "$SHAPE3" --systems "ALST full offload" --start "$LAST" \
    --max-seq $((LAST * 8)) --growth 1.5 --steps 1 --one-step-from 0 --budget 150 --json "$R/gpu_longest3b_alst.json"
step 300 peers1b python3 gpu_train.py --shape "$SHAPE" --systems "$PEERS" --start "$FIRST" --max-seq $((FIRST * 4)) \
    --steps 3 --budget 80 --json "$R/gpu_peers1b.json"
# ---- issue 63: the multi-rank GPU path, 4 ranks sharing the one GPU over gloo
step 200 shared4 python3 gpu_shared.py $([[ "$SHAPE" == tiny ]] && echo --dry-run) --json "$R/gpu_shared.json"
# ---- issue 40's steps
# the whole training step, 1B Llama-3 shape, bf16, ZeRO-3, S doubling from 16K (the GPU otherwise idle)
step 330 train python3 gpu_train.py --shape 1b --systems "ALST full,ds-usp,ds-usp off" --steps 3 --budget 120 \
    --profile --json "$R/gpu_train.json"
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

#!/usr/bin/env bash
# The GPU run list, one step per measurement, each under its own time limit so that one step that hangs leaves the
# others their time. Run from the repository root on the GPU machine, with the wheels the image lacks in .whl/ (made
# by benchmarks/gpu_wheels.sh; without .whl/ the installed packages are used):
#
#     bash benchmarks/gpu_session.sh RESULTS_DIR [STEP or GROUP...]
#
# Where the device tool's $OUT is set, RESULTS_DIR comes back as $OUT/results.tgz (and the profiled steps' chrome
# traces as $OUT/traces.tgz): a call returns at most 8 files. PRIOR=FOLDER: earlier calls' JSON files (their
# results.tgz unpacked into the working tree, which travels), merged into this call's report steps.
#
# Setup, before any step, each under its own limit (SETUP_S in all, counted in every call's plan): the wheels of
# .whl/ installed into /tmp/site (60 s; skipped where a warm machine has them already), the versions into env.txt
# (30 s), and ds-usp's native CUDA op JIT-built (90 s; 43 s on an H100 with 8 jobs) where a named step runs ds-usp,
# finished before the first timed system, so that no timed step waits for nvcc or shares the CPUs with it.
#
# Issue 65's run: one group per device call, the essential rows first. A call may take 600 s: each group's limits
# with SETUP_S leave at least 60 s of it (the script prints the sum and warns below 60 s). A session of 15 minutes of
# device time takes one group (a machine's start, 1-2 minutes, and the transfers count too), so issue65 is six
# sessions' work; `issue65` names all six groups, for a machine without that limit. The steps run in this file's
# order, whatever the order they are named in.
#   issue65a  peers3b report3b                              (360 s + setup 180 s: 60 s of slack)
#   issue65b  fa4 usp3b128 report3b                         (350 s)
#   issue65c  peers3b_ckpt peers1b_ckpt report3b            (350 s)
#   issue65d  longest3b_usp report3b                        (340 s)
#   issue65e  budget3b longest3b_alst report3b              (350 s)
#   issue65f  usp1b peers1b report1b                        (360 s)
# Not in these six calls (see docs/benchmarks.md, "which rows the calls leave"): prof1b, and every S x system the
# steps below do not name (3B: 64K for ds-usp "auto" and every peer, 128K and 192K for all peers but ALST full
# offload, past 288K; 1.5B: past 64K).
# The steps (3B: the Llama-3.2 3B shape, head dim 128; 1.5B: the Llama-3 1.5B shape, head dim 64; bf16, ZeRO-3,
# one sequence per step, every peer with HF's sdpa attention):
#   peers3b        3B at 16K and 32K, 3 steps each (each system's 16K step profiled after them): ds-usp "auto",
#                  plain HF, ALST's tiled loss alone, Liger all (Liger's default kernels), Liger (fused linear
#                  cross-entropy + HF checkpointing), in that order (340 s)
#   peers3b_ckpt   the same for ALST full and ALST full offload (160 s)
#   fa4            benchmarks/fa4_check.py: FlashAttention-4 against cuDNN, head dims 64 and 128, 16K-128K; where
#                  flash-attn-4 is not installed (see fa4stage) the cuDNN rows and why FA4 could not run (180 s:
#                  docs/benchmarks.md estimates two to three minutes with FA4's compiles)
#   usp3b128       ds-usp on the 3B shape at 128K, 2 timed steps and one profiled: MFU (target 45%); the only ds-usp
#                  step on a machine that may have FA4 (the warm one of fa4stage): "auto" may take it, and each row
#                  records the backend and the kernels its attention calls ran (attn_backend, attn_calls) (150 s)
#   budget3b       "ds-usp budget" (usp.memory_gib BUDGET_GIB, 60) at 32K and 64K: its reserved peak under it (90 s)
#   longest3b_usp  ds-usp on the 3B shape at 192K and 288K, one step each (planner's longest S printed first) (320 s)
#   longest3b_alst ALST full offload, the longest peer, at 128K and 192K, one step each (240 s). A 3B step grows as
#                  S^2 (about 1 minute at 192K, 3 at 288K, 6 at 432K estimated): the S where either runs out of memory
#                  (the planner says 718K for ds-usp) takes longer than a call, so these rows give lower bounds and
#                  the tokens/s at 192K, and the report says "not established" for the longest-S targets
#   usp1b          ds-usp on the 1.5B shape (issue 49's) at 16K-64K, 5 timed steps each: each step's time and the
#                  spread of steps 2-4 (issue 49's 55% at 16K: explained or gone), then one profiled step at 16K
#                  (the 6th), with each step's device allocations, choices and attention calls (90 s)
#   prof1b         (in no group) ds-usp on the 1.5B shape at 16K in a fresh process, 3 steps, the 2nd under
#                  torch.profiler (--profile-step 2): the step that was slow in issue 49; its JSON is not a report
#                  row (profile1b_step2.json) (60 s)
#   peers1b        the 1.5B shape at 16K-64K: the peers of peers3b (ds-usp: usp1b) (250 s)
#   peers1b_ckpt   the 1.5B shape at 16K-64K: ALST full and ALST full offload (170 s)
#   report3b/1b    benchmarks/gpu_train.py --report over this call's and PRIOR's JSON files of the shape: the
#                  targets over every row so far (gpu_issue65_3b.json / _1b.json) (20 s each)
#   fa4stage       no measurement: unpack .fa4a/ (the first part of FA4's libraries) into .fa4site/, for the next
#                  call (see benchmarks/gpu_wheels.sh fa4); a call of its own, carrying .fa4a alone
# Issue 63's shared-GPU run (name it):
#   shared4      4 ranks sharing the GPU over gloo (benchmarks/gpu_shared.py): a small bf16 Llama (hidden 512, 2 layers)
#                trained 3 steps at 2x2 and 1x4 on a packed row and on rows of 8K to 64K, against one process in bf16
#                and fp32; a profiled step per run: host syncs and reads inside the layers, staged ring exchanges
#                (200 s; the jobs' budgets 40 s + 100 s of steps; writes gpu_shared.json; SHAPE=tiny: its --dry-run)
# Default STEPS: issue 49's first run (limits 470 s: with the setup, over 600 s less 60; name fewer):
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
# A dry run on CPU (every path on the tiny shape; no timings worth reading; Liger all and FA4 do not run on CPU):
#     WHEELS=0 TRITON_INTERPRET=1 SHAPE=tiny SHAPE3=tiny FIRST=64 LAST=256 BUDGET_GIB=4 \
#         bash benchmarks/gpu_session.sh /tmp/dry65 issue65b
#
# Writes into RESULTS_DIR: env.txt (device, driver, versions), build.log, session.log (every step's output), and per
# step its JSON (gpu_peers3b.json, gpu_peers3b_ckpt.json, fa4_check.json, gpu_usp3b128.json, gpu_budget3b.json,
# gpu_longest3b.json, gpu_longest3b_alst.json, gpu_usp1b.json, profile1b_step2.json, gpu_peers1b.json,
# gpu_peers1b_ckpt.json, the reports
# gpu_issue65_3b.json and gpu_issue65_1b.json; issue 49's gpu_attention.json, gpu_alst.json, gpu_usp.json,
# gpu_alst_offload.json; issue 40's gpu_train.json, gpu_offload.json, gpu_hybrid.json, triton_softcap.json,
# pytest.log); the profiled steps' chrome traces in traces/.
set -u
R=${1:?results folder}
shift
declare -A STEP_GROUPS=(
    [issue65]="issue65a issue65b issue65c issue65d issue65e issue65f"
    [issue65a]="peers3b report3b"
    [issue65b]="fa4 usp3b128 report3b"
    [issue65c]="peers3b_ckpt peers1b_ckpt report3b"
    [issue65d]="longest3b_usp report3b"
    [issue65e]="budget3b longest3b_alst report3b"
    [issue65f]="usp1b peers1b report1b"
    [longest3b]="longest3b_usp longest3b_alst"
)
declare -A LIMIT=(  # seconds per step (the timeout it runs under)
    [attention]=50 [alst]=180 [usp]=170 [alstoffload]=70
    [peers3b]=340 [peers3b_ckpt]=160 [fa4]=180 [usp3b128]=150 [budget3b]=90 [longest3b_usp]=320
    [longest3b_alst]=240 [usp1b]=90 [prof1b]=60 [peers1b]=250 [peers1b_ckpt]=170 [report3b]=20 [report1b]=20
    [fa4stage]=60
    [shared4]=200 [train]=330 [alst128]=100 [offload]=90 [hybrid]=150 [pytest]=150 [triton]=90
)
PIP_S=60 ENV_S=30 BUILD_S=90
SETUP_S=$((PIP_S + ENV_S + BUILD_S)) CALL_S=600
STEPS=" ${*:-attention alst usp alstoffload} "
for _ in 1 2 3; do  # groups of groups
    for g in "${!STEP_GROUPS[@]}"; do
        STEPS=${STEPS// $g / ${STEP_GROUPS[$g]} }
    done
done
total=0
declare -A SEEN=()
for s in $STEPS; do  # a step named twice (a report in two groups) runs once
    [[ -n "${LIMIT[$s]:-}" ]] || { echo "unknown step $s; steps: ${!LIMIT[*]}; groups: ${!STEP_GROUPS[*]}"; exit 2; }
    [[ -n "${SEEN[$s]:-}" ]] || total=$((total + LIMIT[$s]))
    SEEN[$s]=1
done
mkdir -p "$R"
R=$(cd "$R" && pwd)
PRIOR=${PRIOR:+$(cd "$PRIOR" && pwd)}
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
slack=$((CALL_S - SETUP_S - total))
echo "steps:$STEPS-- limits ${total} s + setup ${SETUP_S} s; of a ${CALL_S} s call that leaves ${slack} s" \
    | tee -a "$R/session.log"
((slack >= 60)) || echo "WARNING: under 60 s of slack: name fewer steps in this call" | tee -a "$R/session.log"
[[ "${PLAN_ONLY:-0}" == 1 ]] && exit 0  # PLAN_ONLY=1: the line above, nothing run
pack() {  # the results back through the device tool: at most 8 files come back, so two archives
    [[ -n "${OUT:-}" && -d "${OUT:-}" ]] || return 0
    tar -czf "$OUT/results.tgz" -C "$(dirname "$R")" --exclude=traces "$(basename "$R")"
    [[ -d "$R/traces" ]] && tar -czf "$OUT/traces.tgz" -C "$R" traces
    return 0
}
trap pack EXIT
unpack() {  # unpack DIR: FA4's library parts (benchmarks/gpu_wheels.sh fa4) into .fa4site/, once each
    local t
    for t in "$1"/*.tar.xz; do
        [[ -e "$t" ]] || continue
        [[ -e ".fa4site/$(dirname "$t").done" ]] && continue
        mkdir -p .fa4site
        timeout 120 python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
            "$t" .fa4site && touch ".fa4site/$(dirname "$t").done" && echo "unpacked $t into .fa4site/"
    done
}
unpack .fa4a 2>&1 | tee -a "$R/session.log"
if [[ "$STEPS" == " fa4stage " ]]; then
    echo "fa4stage: .fa4site/ holds $(du -sh .fa4site 2>/dev/null | cut -f1); next call: carry .whl and .fa4b" \
        | tee -a "$R/session.log"
    exit 0
fi
unpack .fa4b 2>&1 | tee -a "$R/session.log"
if [[ "${WHEELS:-1}" != 0 ]] && compgen -G ".whl/*.whl" > /dev/null; then  # WHEELS=0: the installed packages
    stamp=$(ls -l .whl | md5sum | cut -d' ' -f1)
    if [[ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$stamp" ]]; then
        t0=$SECONDS
        timeout $PIP_S python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl > "$R/pip.log" 2>&1 || { cat "$R/pip.log"; exit 1; }
        echo "$stamp" > /tmp/site/.wheels
        echo "pip: .whl/ installed into /tmp/site in $((SECONDS - t0)) s" | tee -a "$R/session.log"
    fi
fi
if [[ -e .fa4site/.fa4a.done && -e .fa4site/.fa4b.done ]]; then  # over the wheels of the same packages
    cp -a .fa4site/. /tmp/site/
elif [[ -e .fa4site/.fa4b.done ]]; then
    echo "FA4: .fa4b is here but not .fa4a's part (the machine was not the warm one of the fa4stage call)" \
        | tee -a "$R/session.log"
fi
export PYTHONPATH=/tmp/site:$PWD
step() {  # step NAME COMMAND...: one step under its limit, its output in session.log
    local name=$1; shift
    [[ "$STEPS" == *" $name "* ]] || return 0
    local limit=${LIMIT[$name]}
    echo "=== $name ($(date +%T), limit ${limit}s)" | tee -a "$R/session.log"
    timeout "$limit" "$@" >> "$R/session.log" 2>&1
    echo "=== $name: exit $? ($(date +%T))" | tee -a "$R/session.log"
}
{ nvidia-smi; nvcc --version | tail -2; timeout $ENV_S python3 - <<'EOF'
import importlib.util
import torch, triton, transformers, deepspeed
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "triton",
      triton.__version__, "transformers", transformers.__version__, "deepspeed", deepspeed.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
print({m: importlib.util.find_spec(m) is not None for m in ("flash_attn", "fla", "mamba_ssm", "causal_conv1d",
                                                            "liger_kernel", "cutlass")})
EOF
} >> "$R/env.txt" 2>&1
python3 -c "import deepspeed" 2>/dev/null || { echo "no DeepSpeed: make .whl/ with benchmarks/gpu_wheels.sh"; exit 1; }
# ds-usp's native CUDA op, built before any timed step (steps without ds-usp skip it)
if [[ "$STEPS" =~ \ (usp|peers3b|usp1b|prof1b|usp3b128|budget3b|longest3b_usp|shared4|train|offload|pytest)\  ]]
then
    t0=$SECONDS
    MAX_JOBS=16 timeout $BUILD_S python3 -c "import torch; from ds_usp.native import resolve_native_op as r; \
print('native op:', r(True, torch.device('cuda')).source, r(True, torch.device('cpu')).source)" > "$R/build.log" 2>&1
    echo "native op build: exit $? in $((SECONDS - t0)) s ($(tail -1 "$R/build.log"))" | tee -a "$R/session.log"
fi
cd benchmarks
SHAPE=${SHAPE:-1b} FIRST=${FIRST:-16384} LAST=${LAST:-131072}
# ---- issue 49's first run: the 1.5B Llama-3 shape, bf16, ZeRO-3, world size 1, 16K to 128K (the GPU otherwise idle)
step attention python3 gpu_train.py --attention --shape "$SHAPE" \
    --seqs "${ATTENTION_SEQS:-16384,32768,65536,131072}" --iters 3 --json "$R/gpu_attention.json"
LENGTHS=(--shape "$SHAPE" --start "$FIRST" --max-seq "$LAST" --steps 4 --budget 600 --trace-dir "$R/traces")
step alst python3 gpu_train.py "${LENGTHS[@]}" --systems "ALST full" --profile-seqs "$FIRST" \
    --json "$R/gpu_alst.json"
step usp python3 gpu_train.py "${LENGTHS[@]}" --systems "ds-usp" --profile-seqs "$FIRST,$LAST" \
    --json "$R/gpu_usp.json"
step alstoffload python3 gpu_train.py --shape "$SHAPE" --systems "ALST full offload" --start "$LAST" \
    --max-seq "$LAST" --steps 2 --budget 600 --json "$R/gpu_alst_offload.json"
# ---- issue 65: the peers at their best, the longest sequence, MFU, the budget (3B: SHAPE3, 1.5B: SHAPE)
SHAPE3=${SHAPE3:-3b}
PEERS="ds-usp,HF plain,ALST tiled loss,Liger all,Liger" CKPT="ALST full,ALST full offload"
[[ "$SHAPE" == tiny ]] && PEERS=${PEERS/,Liger all/}  # Liger's RoPE, RMSNorm and SwiGLU kernels need a GPU
issue65_jsons() {  # this call's and PRIOR's issue-65 result files, PRIOR's first (a later file's rows replace)
    local f names=()
    for f in ${PRIOR:+"$PRIOR"/gpu_*.json} "$R"/gpu_*.json; do
        [[ -e "$f" && "$f" != *gpu_issue65_* ]] && names+=("$f")
    done
    (IFS=,; echo "${names[*]}")
}
step peers3b python3 gpu_train.py --shape "$SHAPE3" --systems "$PEERS" --start "$FIRST" --max-seq $((FIRST * 2)) \
    --steps 3 --budget 60 --profile-seqs "$FIRST" --trace-dir "$R/traces" --json "$R/gpu_peers3b.json"
step peers3b_ckpt python3 gpu_train.py --shape "$SHAPE3" --systems "$CKPT" --start "$FIRST" \
    --max-seq $((FIRST * 2)) --steps 3 --budget 80 --json "$R/gpu_peers3b_ckpt.json"
step fa4 python3 fa4_check.py $([[ "$SHAPE" == tiny ]] && echo --dry-run) --out "$R/fa4_check.json"
step usp3b128 python3 gpu_train.py --shape "$SHAPE3" --systems ds-usp --start "$LAST" --max-seq "$LAST" \
    --steps 2 --budget 120 --profile-seqs "$LAST" --trace-dir "$R/traces" --json "$R/gpu_usp3b128.json"
step budget3b python3 gpu_train.py --shape "$SHAPE3" --systems "ds-usp budget" --memory-gib "${BUDGET_GIB:-60}" \
    --start $((FIRST * 2)) --max-seq $((FIRST * 4)) --steps 2 --budget 60 --json "$R/gpu_budget3b.json"
step longest3b_usp python3 gpu_train.py --shape "$SHAPE3" --systems ds-usp --start $((LAST * 3 / 2)) \
    --max-seq $((LAST * 9 / 4)) --growth 1.5 --steps 1 --one-step-from 0 --budget 280 --json "$R/gpu_longest3b.json"
step longest3b_alst python3 gpu_train.py --shape "$SHAPE3" --systems "ALST full offload" --start "$LAST" \
    --max-seq $((LAST * 3 / 2)) --growth 1.5 --steps 1 --one-step-from 0 --budget 200 \
    --json "$R/gpu_longest3b_alst.json"
# issue 49's 55% spread of steps 2-4 at 16K (1.5B): 5 timed steps, each step's time in the row, then a 6th profiled
step usp1b python3 gpu_train.py --shape "$SHAPE" --systems ds-usp --start "$FIRST" --max-seq $((FIRST * 4)) \
    --steps 5 --budget 60 --profile-seqs "$FIRST" --trace-dir "$R/traces" --json "$R/gpu_usp1b.json"
step prof1b python3 gpu_train.py --shape "$SHAPE" --systems ds-usp --start "$FIRST" --max-seq "$FIRST" --steps 3 \
    --profile-seqs "$FIRST" --profile-step 2 --budget 30 --trace-dir "$R/traces" --json "$R/profile1b_step2.json"
step peers1b python3 gpu_train.py --shape "$SHAPE" --systems "${PEERS#ds-usp,}" --start "$FIRST" \
    --max-seq $((FIRST * 4)) --steps 3 --budget 60 --json "$R/gpu_peers1b.json"
step peers1b_ckpt python3 gpu_train.py --shape "$SHAPE" --systems "$CKPT" --start "$FIRST" --max-seq $((FIRST * 4)) \
    --steps 3 --budget 90 --json "$R/gpu_peers1b_ckpt.json"
[[ "$STEPS" == *" report3b "* ]] && J=$(issue65_jsons) && [[ -n "$J" ]] && \
    step report3b python3 gpu_train.py --shape "$SHAPE3" --report --prior-json "$J" --json "$R/gpu_issue65_3b.json"
[[ "$STEPS" == *" report1b "* ]] && J=$(issue65_jsons) && [[ -n "$J" ]] && \
    step report1b python3 gpu_train.py --shape "$SHAPE" --report --prior-json "$J" --json "$R/gpu_issue65_1b.json"
# ---- issue 63: the multi-rank GPU path, 4 ranks sharing the one GPU over gloo
step shared4 python3 gpu_shared.py $([[ "$SHAPE" == tiny ]] && echo --dry-run) --json "$R/gpu_shared.json"
# ---- issue 40's steps
# the whole training step, 1B Llama-3 shape, bf16, ZeRO-3, S doubling from 16K (the GPU otherwise idle)
step train python3 gpu_train.py --shape 1b --systems "ALST full,ds-usp,ds-usp off" --steps 3 --budget 120 \
    --profile --json "$R/gpu_train.json"
# DeepSpeed's ALST recipe at 128K, which the budget above may stop before
step alst128 python3 gpu_train.py --shape 1b --systems "ALST full" --start 131072 --max-seq 131072 --steps 2 \
    --budget 90 --json "$R/gpu_alst128.json"
# offload_activations: "ds-usp" above offloads at 128K ("auto"); the same step with it off
step offload python3 gpu_train.py --shape 1b --systems "ds-usp no offload" --start 131072 --max-seq 131072 \
    --steps 2 --budget 60 --json "$R/gpu_offload.json"
# hybrid families with the kernels transformers picks on CUDA, against the unsharded model
step hybrid python3 gpu_hybrid.py --families qwen3_5_text,jamba,nemotron_h --json "$R/gpu_hybrid.json"
cd ..
# the GPU tests (native CUDA op, Triton compiled, CUDA kernels) on the GPU host
step pytest python3 -m pytest -q -m gpu -p no:cacheprovider
# the Triton kernels with soft-capping against PyTorch's attention
step triton python3 benchmarks/triton_attn.py --seqs 16384 --softcap 50 --iters 3 --warmup 1 \
    --json "$R/triton_softcap.json"
tail -5 "$R/session.log"

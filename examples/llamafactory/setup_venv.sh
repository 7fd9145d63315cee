#!/usr/bin/env bash
# The environment run_llamafactory.py runs in: LLaMA-Factory 0.9.5 from PyPI with the versions it resolves
# (transformers, accelerate, TRL, PEFT, datasets), DeepSpeed 0.19.8, torch 2.13.0 (CPU) and this checkout of ds-usp
# (editable, --no-deps, so that it changes none of them).
#
#   bash examples/llamafactory/setup_venv.sh [VENV]      # default venvs/llamafactory; run from the repo root
#
# On a CPU-only machine: PyPI's torchvision and torchaudio wheels are CUDA builds (their native libraries need
# libc10_cuda.so), and the CPU builds are not on PyPI. LLaMA-Factory needs neither for text, but imports torchaudio
# at start (llamafactory/data/mm_plugin.py) and transformers imports torchvision when it is installed. So, where torch
# has no CUDA, this script uninstalls torchvision and moves torchaudio's native libraries aside (*.so ->
# *.so.cuda-build-disabled): torchaudio then imports as pure Python (its _load_lib finds no library). Nothing else
# is changed.
set -euo pipefail
VENV=${1:-venvs/llamafactory}
mkdir -p "$(dirname "$VENV")"
python -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install torch==2.13.0
"$PIP" install llamafactory==0.9.5 torch==2.13.0          # torch==2.13.0 as a constraint: keep the CPU build
"$PIP" install deepspeed==0.19.8 torch==2.13.0
"$PIP" install --no-deps -e "$(cd "$(dirname "$0")/../.." && pwd)"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)"; then
    "$PIP" uninstall -y torchvision
    SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    for so in "$SITE"/torchaudio/lib/*.so; do
        [ -e "$so" ] && mv "$so" "$so.cuda-build-disabled"
    done
fi
"$VENV/bin/python" -c "import torchaudio, llamafactory.data.mm_plugin, deepspeed, ds_usp; print('environment ready')"
"$PIP" list 2>/dev/null | grep -iE "^(torch|transformers|accelerate|trl|peft|datasets|deepspeed|ds-usp|llamafactory) "

#!/usr/bin/env bash
# The wheels the GPU machine's image lacks, for its Python (CPython 3.12, x86-64 manylinux), made here, where the
# package registry is reached (nothing can be fetched there). Run from anywhere, on a machine with pip and this
# repository's pinned environment (the versions are this environment's: setup.py's dev pins):
#
#     bash benchmarks/gpu_wheels.sh          # .whl/: what benchmarks/gpu_session.sh installs with --no-index
#     bash benchmarks/gpu_wheels.sh fa4      # also flash-attn-4 (issue 65): see "fa4" below
#
# .whl/ (made anew each time: two versions of one package stop the install there) gets:
#   deepspeed      built here from its sdist (PyPI has no wheel), no op prebuilt (DS_BUILD_OPS=0): a py3-none-any
#                  wheel; ds-usp's and DeepSpeed's ops are JIT-built on the GPU machine
#   transformers   this environment's (setup.py's dev pin, >=5.23,<5.24; the image has 5.17)
#   pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions (pydantic-core needs >= 4.14.1),
#   hjson          DeepSpeed's and ds-usp's requirements the image lacks
#   regex          transformers checks regex >= 2025.10.22 at import
#   liger-kernel   the Liger peers of benchmarks/gpu_train.py (pure Python, Triton kernels)
# The rest of transformers' and DeepSpeed's requirements are in the image (huggingface-hub 1.33, tokenizers 0.23.2,
# safetensors 0.8, msgpack, ninja, py-cpuinfo, psutil, einops, nvidia-ml-py: KINDS.md of the device tool).
# About 20 MB; the device call carries the working tree and the carried paths, 64 MiB in all.
#
# fa4: flash-attn-4 and what it needs (4.0.0b36: nvidia-cutlass-dsl, its -libs-base and -libs-core, quack-kernels,
# apache-tvm-ffi, torch-c-dlpack-ext, about 10 MB, into .whl/), and the CuTe DSL's CUDA 13 libraries
# (nvidia-cutlass-dsl-libs-cu13, a 92 MB wheel, 237 MB unpacked, for the image's torch 2.11.0+cu130), which do not
# fit one call: its largest file (the MLIR compiler) goes xz-compressed into .fa4a/, every other file of it into
# .fa4b/ (docs/benchmarks.md measured 50.1 and 13.5 MB). On the GPU machine, two calls, the second within the
# machine's warm window (30 s after the first ends) so that the first's unpacked files are still there:
#   call 1, carry [".fa4a"]:          bash benchmarks/gpu_session.sh /tmp/r fa4stage
#   call 2, carry [".whl", ".fa4b"]:  bash benchmarks/gpu_session.sh /tmp/r fa4 ...
# gpu_session.sh unpacks each part into .fa4site/ (ignored; a warm machine keeps ignored paths between calls) and
# puts it on PYTHONPATH. This script adds /.fa4a/, /.fa4b/ and /.fa4site/ to .git/info/exclude.
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-base}
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
get() {  # get DIR NAME==VERSION...: binary wheels for the GPU machine's Python, no dependencies (each is named)
    local dir=$1; shift
    python3 -m pip download -q --pre --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$dir" "$@"
}
version() {  # this environment's version of a distribution
    python3 -c "from importlib.metadata import version; print(version('$1'))"
}
limit_mib=64
tree_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
mib() { echo $(( ($1 + 1048575) / 1048576 )); }
size() { du -cb "$@" | tail -1 | cut -f1; }

rm -rf .whl
mkdir -p .whl
base=(transformers pydantic pydantic-core annotated-types typing-inspection typing-extensions hjson regex liger-kernel)
pins=()
for name in "${base[@]}"; do
    pins+=("$name==$(version "$name")")
done
get .whl "${pins[@]}"
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w .whl "deepspeed==$(version deepspeed)"
ls .whl | grep -qi '^deepspeed-.*-py3-none-any\.whl$' || { echo "no py3-none-any DeepSpeed wheel in .whl/"; exit 1; }
echo "base wheels: $(ls .whl | wc -l) files, $(mib "$(size .whl)") MiB; the tracked tree $(mib "$tree_bytes") MiB"

if [[ "$WHAT" == fa4 ]]; then
    get .whl flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
        nvidia-cutlass-dsl-libs-core==4.8.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    get "$work" "${FA4_LIBS:-nvidia-cutlass-dsl-libs-cu13==4.8.1}"  # FA4_LIBS: another (e.g. a small one, to try this)
    mkdir "$work/x"
    python3 -m zipfile -e "$work"/*.whl "$work/x"
    big=$(cd "$work/x" && find . -type f -printf '%s %P\n' | sort -n | tail -1 | cut -d' ' -f2-)
    rm -rf .fa4a .fa4b
    mkdir -p .fa4a .fa4b
    XZ_OPT="-9e -T0" tar -C "$work/x" -cJf .fa4a/part1.tar.xz "$big"
    (cd "$work/x" && find . -type f ! -path "./$big" -printf '%P\n') > "$work/rest"
    XZ_OPT="-9e -T0" tar -C "$work/x" -cJf .fa4b/part2.tar.xz -T "$work/rest"
    mkdir -p .git/info
    for path in /.fa4a/ /.fa4b/ /.fa4site/; do
        grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
    done
    call1=$(( tree_bytes + $(size .fa4a) ))
    call2=$(( tree_bytes + $(size .whl .fa4b) ))
    echo "fa4: .fa4a/ (${big}) $(mib "$(size .fa4a)") MiB, .fa4b/ $(mib "$(size .fa4b)") MiB; call 1 carries" \
         "$(mib $call1) MiB, call 2 $(mib $call2) MiB (limit ${limit_mib} MiB each)"
    (( call1 <= limit_mib * 1048576 && call2 <= limit_mib * 1048576 )) || { echo "over the limit of a call"; exit 1; }
else
    rm -rf .fa4b  # a stale second part would travel with nothing to match it
    total=$(( tree_bytes + $(size .whl) ))
    echo "a call carries $(mib $total) MiB of ${limit_mib}"
    (( total <= limit_mib * 1048576 )) || { echo "over the limit of a call"; exit 1; }
fi

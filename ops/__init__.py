"""DeepSpeed op builders for the ds-usp native op (ring LSE merge, Ulysses packing, fp32 accumulation).

Two variants, as DeepSpeed does it for ops that run on both: :class:`USPCPUBuilder` (a
``CPUOpBuilder``: C++ kernels, OpenMP, ``-march=native``) and :class:`USPCUDABuilder` (a
``CUDAOpBuilder``: the same frontend and CPU kernels plus the ``.cu`` kernels, built with
``-DUSP_WITH_CUDA``). This folder is the repository's top-level ``ops/`` (beside ``ds_usp/``, as DeepSpeed
keeps ``op_builder/`` and ``csrc/``); setup.py installs it as ``ds_usp.native.op_builder`` with ``csrc/`` as
package data, so a plain ``pip install .`` can JIT-build it; both builders return absolute source paths.

* ``builder.jit_load()`` (DeepSpeed's) builds with ninja into torch's extension cache
  (``~/.cache/torch_extensions``, in a directory per build command: ``build_name()``; rebuilt only when a source
  changes); :mod:`ds_usp.native` calls it.
* ``builder.is_compatible()`` checks for the compilers and sets ``error_log`` to the reason.
* ``builder.builder()`` returns the setuptools extension for ``DS_BUILD_USP=1 pip install``.

This file imports nothing from ``ds_usp`` (setup.py loads it by path before ds_usp is installed).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from deepspeed.ops.op_builder.builder import CUDAOpBuilder
from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder

CSRC = Path(__file__).resolve().parent / "csrc"
BUILD_VAR = "DS_BUILD_USP"
_PROBED: dict[str, str] = {}  # DeepSpeed's CPU flag probes (cpu_arch, simd_width), answered once per process


def _cxx_problem() -> str | None:
    """Why no C++ compiler can be used (torch's extension build runs ``$CXX``, default ``c++``), or None."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler: {cxx!r} (from $CXX, default 'c++') was not found"
    return None


def plain_arch_list(archs: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` with arch-specific suffixes dropped: ``"8.0 9.0a+PTX"`` -> ``"8.0 9.0+PTX"``."""
    return re.sub(r"(\d+\.\d+)[a-z]+", r"\1", archs)


def _detected_archs() -> str:
    """The compute capabilities of the visible GPUs (``"8.0 9.0"``), as DeepSpeed's JIT build probes them when
    ``TORCH_CUDA_ARCH_LIST`` is unset; ``""`` without a GPU, or where CUDA cannot be asked (a forked child)."""
    import torch

    try:
        if not torch.cuda.is_available() or getattr(torch.cuda, "_is_in_bad_fork", lambda: False)():
            return ""
        found = {"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return " ".join(sorted(found))
    except (RuntimeError, AssertionError):
        return ""


def cuda_arch_tag(archs: str | None = None) -> str:
    """The CUDA architectures a build compiles for, as a part of its build name: ``"8.0;9.0a+PTX"`` -> ``"sm80_90ptx"``.

    Args:
        archs: a ``TORCH_CUDA_ARCH_LIST`` value; None: the environment's, else the visible GPUs' capabilities (what
            DeepSpeed's JIT build compiles for, in the same order of precedence).

    Returns:
        ``"sm"`` and the sorted plain capabilities (``a``/``f`` suffixes dropped, as :meth:`USPCUDABuilder.
        compute_capability_args` drops them) joined by ``_``; ``"smnone"`` when there are none (no GPU and no list:
        DeepSpeed's build then refuses by itself).
    """
    if archs is None:
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip() or _detected_archs()
    entries = {e.lower().replace(".", "").replace("+", "") for e in plain_arch_list(archs).replace(";", " ").split()}
    ordered = sorted(entries, key=lambda e: (int(re.match(r"\d*", e).group() or 0), e))
    return "sm" + ("_".join(ordered) if ordered else "none")


class _USPBuilderMixin:
    """What both variants share: sources, flags, and a build directory of their own per build command."""

    BUILD_VAR = BUILD_VAR

    def build_name(self) -> str:
        """``NAME`` + a digest of what makes the build command: the sources' place, the compiler, its flags and the
        ninja that runs it.

        torch's extension cache keys a build directory by name alone, and ninja rebuilds when the command line
        differs from its log's: two installs (editable and not, two checkouts) or two ninja binaries on ``PATH``
        (pip's and the system's hash command lines differently) shared one directory and rebuilt each other's op
        for a minute at every switch. With the digest each keeps its own directory, built once. The CUDA build's name
        also holds the architectures it compiles for (:func:`cuda_arch_tag`): two nodes with different GPUs sharing
        ``TORCH_EXTENSIONS_DIR`` never share a build folder (the arch flags are not in the host flags digested
        above: the nodes rebuilt each other's op, and a node that waited on the other's build lock loaded that
        build as it was, with kernels for the other GPU: "no kernel image is available").
        """
        ninja = shutil.which("ninja") or "no ninja"
        try:
            version = subprocess.run([ninja, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            version = "unknown"
        key = "\n".join([str(CSRC), os.environ.get("CXX", "c++"), " ".join(self.cxx_args()), ninja, version])
        return "_".join([self.NAME, *self._name_parts(), hashlib.sha256(key.encode()).hexdigest()[:10]])

    def _name_parts(self) -> list[str]:
        """What the build name holds between ``NAME`` and the digest (nothing for the CPU build)."""
        return []

    def cpu_arch(self) -> str:
        """DeepSpeed's ``-march`` flag, asked once per process (see :meth:`simd_width`)."""
        return _PROBED.get("cpu_arch") or _PROBED.setdefault("cpu_arch", super().cpu_arch())

    def simd_width(self) -> str:
        """DeepSpeed's SIMD flag, asked once per process: each of DeepSpeed's probes asks py-cpuinfo, which runs a
        Python subprocess (1.3 s of CPU), and loading an already built op read the flags 4 times (its build
        directory's name, the progress message's cache check, DeepSpeed's jit_load): 8 subprocesses, 10 of the
        14 s a rank took to load the op."""
        return _PROBED.get("simd_width") or _PROBED.setdefault("simd_width", super().simd_width())

    def jit_load(self, verbose: bool = True) -> object:
        """DeepSpeed's JIT build, into the build directory of :meth:`build_name`."""
        self.name = self.build_name()
        return super().jit_load(verbose)

    def include_paths(self) -> list[str]:
        """Absolute include directories."""
        return [str(CSRC / "includes")]

    def _common_sources(self) -> list[str]:
        return [str(CSRC / "usp_frontend.cpp"), str(CSRC / "cpu" / "usp_cpu.cpp")]

    def _extra_cxx(self) -> list[str]:
        # -ffp-contract=off: a*b + c*d rounds like the PyTorch twin's separate mul/add, no fused FMA.
        return ["-fopenmp", "-ffp-contract=off"]

    @staticmethod
    def _without_debug_info(args: list[str]) -> list[str]:
        """DeepSpeed's host flags less ``-g``: debug information for torch's and pybind11's templates took 40% of the
        frontend's compile (108 s -> 64 s at -O3 on 2 cores) and most of the module's 12 MB."""
        return [a for a in args if a != "-g"]


class USPCPUBuilder(_USPBuilderMixin, CPUOpBuilder):
    """CPU variant: C++ kernels with OpenMP and vectorized inner loops."""

    NAME = "ds_usp_cpu"

    def __init__(self) -> None:
        super().__init__(name=self.NAME)

    def absolute_name(self) -> str:
        """Import path of the prebuilt module."""
        return "ds_usp.native._usp_cpu"

    def sources(self) -> list[str]:
        """Absolute source paths."""
        return self._common_sources()

    def cxx_args(self) -> list[str]:
        """DeepSpeed's CPU flags (-O3, -march, SIMD width, -fopenmp; not -g) plus ours."""
        return self._without_debug_info(super().cxx_args()) + ["-ffp-contract=off"]

    def is_compatible(self, verbose: bool = False) -> bool:
        """A C++ compiler is present (``error_log`` says which is missing otherwise)."""
        problem = _cxx_problem()
        if problem is not None:
            self.error_log = problem
            return False
        return super().is_compatible(verbose)


class USPCUDABuilder(_USPBuilderMixin, CUDAOpBuilder):
    """CUDA variant: the CPU kernels plus the ``.cu`` kernels (the frontend dispatches on the device)."""

    NAME = "ds_usp_cuda"

    def __init__(self) -> None:
        super().__init__(name=self.NAME)

    def absolute_name(self) -> str:
        """Import path of the prebuilt module."""
        return "ds_usp.native._usp_cuda"

    def sources(self) -> list[str]:
        """Absolute source paths."""
        return self._common_sources() + [str(CSRC / "cuda" / "usp_cuda.cu")]

    def cxx_args(self) -> list[str]:
        """DeepSpeed's CUDA-op host flags (not -g) plus OpenMP, no FP contraction and ``USP_WITH_CUDA``."""
        return self._without_debug_info(super().cxx_args()) + self._extra_cxx() + ["-DUSP_WITH_CUDA"]

    def _name_parts(self) -> list[str]:
        """The architectures compiled for (:func:`cuda_arch_tag`)."""
        return [cuda_arch_tag()]

    def nvcc_args(self) -> list[str]:
        """DeepSpeed's nvcc flags without ``--use_fast_math`` (the merge must round like the twin)."""
        return [a for a in super().nvcc_args() if a != "--use_fast_math"]

    def compute_capability_args(self, cross_compile_archs: str | None = None) -> list[str]:
        """DeepSpeed's, after reducing arch-specific entries of ``TORCH_CUDA_ARCH_LIST`` to the plain capability.

        CUDA images for Hopper/Blackwell set entries like ``9.0a`` or ``10.0f``; DeepSpeed 0.19.8 reads each
        entry's minor as an integer and fails (``invalid literal for int() with base 10: '0a'``), so the op
        never built on an H100 image. These kernels use no arch-specific instructions: ``9.0a`` -> ``9.0``.
        """
        for holder, key in ((os.environ, "TORCH_CUDA_ARCH_LIST"), (self.__dict__, "_jit_arch_list")):
            if holder.get(key):
                holder[key] = plain_arch_list(holder[key])
        if cross_compile_archs:
            cross_compile_archs = plain_arch_list(cross_compile_archs)
        return super().compute_capability_args(cross_compile_archs)

    def is_compatible(self, verbose: bool = False) -> bool:
        """A C++ compiler and nvcc (CUDA_HOME) are present (``error_log`` says what is missing otherwise)."""
        import torch
        from torch.utils.cpp_extension import CUDA_HOME

        problem = _cxx_problem()
        if problem is None and torch.version.cuda is None:
            problem = f"torch {torch.__version__} is a build without CUDA (install the torch that matches your CUDA)"
        if problem is None and not (CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))):
            problem = "no CUDA compiler: nvcc was not found under CUDA_HOME (set CUDA_HOME)"
        if problem is not None:
            self.error_log = problem
            return False
        return super().is_compatible(verbose)


def builder_for(device_type: str) -> USPCPUBuilder | USPCUDABuilder:
    """The builder variant for a device type.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.

    Returns:
        A fresh builder.

    Raises:
        ValueError: any other device type.
    """
    if device_type == "cpu":
        return USPCPUBuilder()
    if device_type == "cuda":
        return USPCUDABuilder()
    raise ValueError(f"the ds-usp native op has no kernels for device type {device_type!r} (cpu and cuda only)")

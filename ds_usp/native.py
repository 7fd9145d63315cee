"""The native op (``ops/``): lazy loading, the ``usp.native_op`` setting, and a typed wrapper.

The op is built from ``ops/csrc/usp`` by the DeepSpeed op builders in ``ops/op_builder/usp.py``:
prebuilt by ``DS_BUILD_USP=1 pip install --no-build-isolation .``, otherwise JIT-built with ninja
on first use and cached in torch's extension directory. Nothing happens at import time.

Every native function has a PyTorch twin at its call site, which is the fallback and the test oracle:

* :meth:`NativeOps.merge_block_`: :func:`ds_usp.ring.merge_block_`;
* :meth:`NativeOps.accumulate_`: ``acc += x`` in :func:`ds_usp.ring._ring_backward`;
* :meth:`NativeOps.pack_seq_to_head` and the other packing methods: the reshape/permute/``cat``/
  ``repeat_interleave`` packing in :mod:`ds_usp.comm` and :func:`ds_usp.ulysses.qkv_seq_to_head`.

Callers pass a :class:`NativeOps` (or ``None`` for the twins) down to the call sites; the one piece
of module state is ``_LOADED``, a cache keyed by device type (``"cpu"``/``"cuda"``) holding the loaded
op or the reason it could not be loaded, so a process builds/loads at most once per device type
and warns at most once.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = ["NativeOps", "NativeOpUnavailable", "NativeOpState", "check_native_op", "load_native_op",
           "native_op_state", "resolve_native_op"]

NativeOpSetting = Union[bool, str]
_BUILDER_FILE = Path(__file__).resolve().parent.parent / "ops" / "op_builder" / "usp.py"
_PREBUILT = {"cpu": "ds_usp._usp_cpu", "cuda": "ds_usp._usp_cuda"}

# device type -> NativeOps, or the NativeOpUnavailable that loading raised (filled lazily, see module doc)
_LOADED: dict[str, Union["NativeOps", "NativeOpUnavailable"]] = {}


class NativeOpUnavailable(RuntimeError):
    """The native op cannot be built or loaded here; the message says why (missing compiler, build error...)."""


class NativeOps:
    """The loaded native op, with the same signatures as the PyTorch twins.

    Args:
        module: the extension module.
        source: ``"prebuilt"`` or ``"jit"``.
    """

    def __init__(self, module: ModuleType, source: str) -> None:
        self.module = module
        self.source = source

    def __repr__(self) -> str:
        return f"NativeOps({self.module.__name__}, {self.source})"

    def merge_block_(self, out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
        """Native :func:`ds_usp.ring.merge_block_`: one pass, in place, fp32, -inf rows stay zero.

        Args:
            out: running output, fp32 ``(b, s, h, d)`` (may be a strided view); updated in place.
            lse: running LSE, fp32 ``(b, h, s)`` (may be a strided view); updated in place.
            block_out: ``(b, s, h, d)``, fp32/bf16/fp16.
            block_lse: fp32 ``(b, h, s)``.

        Raises:
            RuntimeError: bad shapes, dtypes or devices.
        """
        self.module.merge_block_(out, lse, block_out, block_lse)

    def accumulate_(self, acc: Tensor, x: Tensor) -> None:
        """``acc += x`` with ``x`` converted to fp32 on the fly, in place, one pass.

        Args:
            acc: fp32 ``(b, s, h, d)`` accumulator (may be a strided view).
            x: ``(b, s, h, d)`` of any supported float dtype.

        Raises:
            RuntimeError: bad shapes, dtypes or devices.
        """
        self.module.accumulate_(acc, x)

    def pack_seq_to_head(self, xs: Sequence[Tensor], reps: Sequence[int], world: int) -> Tensor:
        """Sequence shards straight into the all-to-all send buffer (GQA replication included).

        Args:
            xs: tensors ``(b, s, h_i, d)`` of one dtype (e.g. q, k, v).
            reps: per tensor, how often each head is replicated (``U // hkv`` for kv heads that the
                Ulysses degree does not divide, else 1).
            world: the Ulysses degree U.

        Returns:
            The contiguous send buffer ``(U, b, s, sum_i h_i * reps_i / U, d)``; chunk ``u`` holds the
            heads of every tensor destined for Ulysses rank ``u``, tensor after tensor.
        """
        return self.module.pack_seq_to_head(list(xs), list(reps), world)

    def unpack_seq_to_head(self, recv: Tensor, heads: Sequence[int]) -> list[Tensor]:
        """The received buffer as head shards.

        With batch 1 the results are views of ``recv`` (no copy, as in the twin); otherwise one
        kernel pass writes contiguous tensors.

        Args:
            recv: ``(U, b, s, Hp, d)`` contiguous, chunk ``u`` from Ulysses rank ``u``.
            heads: head counts per result, summing to ``Hp``.

        Returns:
            ``[(b, U*s, heads_i, d)]``.
        """
        u, b, s, hp, d = recv.shape
        if b == 1:
            # (U, 1, s, Hp, d) -> (1, U*s, Hp, d): a view; then split the head columns
            return list(recv.view(1, u * s, hp, d).split(list(heads), dim=2))
        return self.module.unpack_seq_to_head(recv, list(heads))

    def pack_head_to_seq(self, xs: Sequence[Tensor], world: int) -> Tensor:
        """Head shards straight into the all-to-all send buffer.

        One contiguous tensor with batch 1 is already laid out as the buffer and is returned as a
        view (as in the twin); otherwise one kernel pass gathers every tensor.

        Args:
            xs: tensors ``(b, U*s, h_i, d)`` of one dtype.
            world: the Ulysses degree U.

        Returns:
            The contiguous send buffer ``(U, b, s, sum_i h_i, d)``.
        """
        if len(xs) == 1 and xs[0].shape[0] == 1 and xs[0].is_contiguous():
            _, big_s, h, d = xs[0].shape
            return xs[0].view(world, 1, big_s // world, h, d)  # (1, U*s, h, d) -> (U, 1, s, h, d)
        return self.module.pack_head_to_seq(list(xs), world)

    def unpack_head_to_seq(self, recv: Tensor, heads: Sequence[int], reps: Sequence[int]) -> list[Tensor]:
        """The received buffer as sequence shards, summing replicated heads (fp32 sum, one rounding).

        Args:
            recv: ``(U, b, s, Hp, d)`` contiguous.
            heads: head columns per result in the buffer, summing to ``Hp``.
            reps: replication factor per result (as given to :meth:`pack_seq_to_head`).

        Returns:
            ``[(b, s, U * heads_i / reps_i, d)]``, contiguous.
        """
        return self.module.unpack_head_to_seq(recv, list(heads), list(reps))


@dataclass(frozen=True)
class NativeOpState:
    """What :func:`native_op_state` found.

    Attributes:
        state: ``"prebuilt"``, ``"jit-built"`` (in the extension cache), ``"jit-buildable"`` (builds on
            first use) or ``"not buildable"``.
        detail: the module path, cache directory or the reason it cannot be built.
    """

    state: str
    detail: str


def _builder_module() -> ModuleType:
    """``ops/op_builder/usp.py``, loaded by path (``ops/`` is not a Python package of this project)."""
    if not _BUILDER_FILE.exists():
        raise NativeOpUnavailable(f"the native op sources are not installed (expected {_BUILDER_FILE}); install "
                                  f"from a checkout (pip install -e .) or prebuild with DS_BUILD_USP=1 pip install .")
    spec = importlib.util.spec_from_file_location("ds_usp_op_builder", _BUILDER_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _builder(device_type: str) -> Any:
    try:
        return _builder_module().builder_for(device_type)
    except ValueError as e:
        raise NativeOpUnavailable(str(e)) from None


def _import_prebuilt(device_type: str) -> Optional[ModuleType]:
    name = _PREBUILT.get(device_type)
    if name is None:
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def load_native_op(device: Union[torch.device, str], verbose: bool = False) -> NativeOps:
    """Load the native op for ``device``'s type: prebuilt if installed, else JIT-build (once per process).

    Args:
        device: the device the tensors live on (``cpu`` or ``cuda``).
        verbose: show the compiler output of a JIT build.

    Returns:
        The op.

    Raises:
        NativeOpUnavailable: no compiler (named), unsupported device type, or the build failed
            (with the compiler's error); the same error is raised again on later calls.
    """
    device_type = torch.device(device).type
    cached = _LOADED.get(device_type)
    if isinstance(cached, NativeOps):
        return cached
    if cached is not None:
        raise cached
    try:
        module = _import_prebuilt(device_type)
        if module is not None:
            ops = NativeOps(module, "prebuilt")
        else:
            builder = _builder(device_type)
            if not builder.is_compatible(verbose):
                raise NativeOpUnavailable(f"cannot build the ds-usp native op ({builder.NAME}): {builder.error_log}")
            try:
                ops = NativeOps(builder.jit_load(verbose), "jit")
            except Exception as e:  # noqa: BLE001 - any build failure becomes one clear error
                raise NativeOpUnavailable(f"building the ds-usp native op ({builder.NAME}) failed: "
                                          f"{type(e).__name__}: {_short(str(e))}") from e
    except NativeOpUnavailable as e:
        _LOADED[device_type] = e
        raise
    _LOADED[device_type] = ops
    return ops


def _short(msg: str, limit: int = 1500) -> str:
    msg = msg.strip()
    return msg if len(msg) <= limit else msg[:limit] + " ..."


def check_native_op(setting: Any) -> None:
    """Validate a ``usp.native_op`` value.

    Args:
        setting: the value.

    Raises:
        ValueError: anything but ``"auto"``, ``True`` or ``False``.
    """
    if not (setting is True or setting is False or setting == "auto"):
        raise ValueError(f"usp.native_op={setting!r} is invalid; use 'auto', True or False")


def resolve_native_op(setting: NativeOpSetting, device: Union[torch.device, str]) -> Optional[NativeOps]:
    """Turn the ``usp.native_op`` setting into the ops object passed to the call sites.

    Args:
        setting: ``"auto"`` (the op when it builds, else the PyTorch twins with one warning),
            ``True`` (the op, a failed build is an error) or ``False`` (the twins; never builds).
        device: the device of the tensors.

    Returns:
        The :class:`NativeOps`, or ``None`` for the PyTorch twins.

    Raises:
        ValueError: an invalid setting.
        NativeOpUnavailable: ``setting`` is True and the op cannot be built or loaded.
    """
    check_native_op(setting)
    if setting is False:
        return None
    device_type = torch.device(device).type
    first = device_type not in _LOADED
    try:
        return load_native_op(device)
    except NativeOpUnavailable as e:
        if setting is True:
            raise NativeOpUnavailable(f"usp.native_op=True but {e}") from None
        if first:
            warnings.warn(f"usp.native_op='auto': {e}; falling back to the PyTorch implementation "
                          f"(set usp.native_op=false to silence this)", RuntimeWarning, stacklevel=3)
        return None


def native_op_state(device_type: str) -> NativeOpState:
    """Whether the op is prebuilt, JIT-built, buildable or not here, without building anything.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.

    Returns:
        The state and its detail.
    """
    module = _import_prebuilt(device_type)
    if module is not None:
        return NativeOpState("prebuilt", str(getattr(module, "__file__", module.__name__)))
    try:
        builder = _builder(device_type)
    except NativeOpUnavailable as e:
        return NativeOpState("not buildable", str(e))
    if not builder.is_compatible(False):
        return NativeOpState("not buildable", str(builder.error_log))
    from torch.utils.cpp_extension import _get_build_directory  # private, but only used for this report
    build_dir = _get_build_directory(builder.NAME, False)
    if os.path.exists(os.path.join(build_dir, f"{builder.NAME}.so")):
        return NativeOpState("jit-built", f"cached in {build_dir} (rebuilt when a source changes)")
    return NativeOpState("jit-buildable", f"will be JIT-built with ninja on first use into {build_dir}")

"""The native op and its PyTorch twins behind one interface, and the ``usp.native_op`` setting.

The op (the ring's LSE merge, the Ulysses all-to-all packing with GQA replication, the ring backward's fp32
accumulation; C++ with OpenMP for CPU tensors, CUDA kernels for CUDA tensors) is built from ``ops/csrc`` by the
DeepSpeed op builders of the repository's top-level ``ops/``, installed as :mod:`ds_usp.native.op_builder`: prebuilt
by ``DS_BUILD_USP=1 pip install --no-build-isolation .``, otherwise JIT-built with ninja on first use (about a
minute) and cached in torch's extension directory (``TORCH_EXTENSIONS_DIR``, by default under
``~/.cache/torch_extensions``). Nothing happens at import time.

:func:`resolve_native_op` returns a :class:`NativeOps` (the op) or a :class:`~ds_usp.native.twins.TorchOps`
(the PyTorch twins, the fallback and the test oracle): both have the same six methods with the same
signatures and numbers (bitwise, except the merge, whose exp/log1p agree within a few ulp, and the replica
sums of ``unpack_head_to_seq``, within fp32 rounding), so the attention code calls ``ops.merge_block_(...)``
without ever asking which it holds. The one piece of module state is ``_LOADED``, a cache keyed by device
type (``"cpu"``/``"cuda"``) holding the loaded op or the reason it could not be loaded, so a process
builds/loads at most once per device type and warns at most once per device type.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor

from ds_usp.native.build_locks import recording_holder, watch_build_locks
from ds_usp.log import log_rank0
from ds_usp.native.twins import TorchOps

__all__ = ["NativeOps", "NativeOpUnavailable", "NativeOpState", "TorchOps", "check_native_op", "load_native_op",
           "native_op_state", "resolve_native_op"]

NativeOpSetting = Union[bool, str]
_PREBUILT = {"cpu": "ds_usp.native._usp_cpu", "cuda": "ds_usp.native._usp_cuda"}

# device type -> NativeOps, or the NativeOpUnavailable that loading raised (filled lazily, see module doc)
_LOADED: dict[str, Union["NativeOps", "NativeOpUnavailable"]] = {}
_TWINS = TorchOps()  # stateless


class NativeOpUnavailable(RuntimeError):
    """The native op cannot be built or loaded here; the message says why (missing compiler, build error...)."""


class NativeOps(TorchOps):
    """The loaded native op: :class:`TorchOps`' methods, each one native kernel pass.

    Args:
        module: the extension module.
        source: ``"prebuilt"`` or ``"jit"``.
    """

    def __init__(self, module: ModuleType, source: str) -> None:
        self.module = module
        self.source = source

    def merge_block_(self, out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
        """See :meth:`TorchOps.merge_block_` (one pass; glibc's exp/log1p, so within a few ulp of the twin).

        Raises:
            RuntimeError: bad shapes, dtypes or devices.
        """
        self.module.merge_block_(out, lse, block_out, block_lse)

    def accumulate_(self, acc: Tensor, x: Tensor) -> None:
        """See :meth:`TorchOps.accumulate_` (one pass, bitwise equal).

        Raises:
            RuntimeError: bad shapes, dtypes or devices.
        """
        self.module.accumulate_(acc, x)

    def pack_seq_to_head(self, xs: Sequence[Tensor], reps: Sequence[int], world: int) -> Tensor:
        """See :meth:`TorchOps.pack_seq_to_head` (one pass straight into the send buffer, bitwise equal)."""
        return self.module.pack_seq_to_head(list(xs), list(reps), world)

    def unpack_seq_to_head(self, recv: Tensor) -> Tensor:
        """See :meth:`TorchOps.unpack_seq_to_head` (a view for ``b == 1``, else one kernel pass)."""
        u, b, s, hp, d = recv.shape
        if b == 1:
            return recv.view(1, u * s, hp, d)  # (U, 1, s, Hp, d) -> (1, U*s, Hp, d)
        return self.module.unpack_seq_to_head(recv, [hp])[0]

    def pack_head_to_seq(self, xs: Sequence[Tensor], world: int) -> Tensor:
        """See :meth:`TorchOps.pack_head_to_seq` (a view in the same case, else one kernel pass)."""
        if len(xs) == 1 and xs[0].shape[0] == 1 and xs[0].is_contiguous():
            _, big_s, h, d = xs[0].shape
            return xs[0].view(world, 1, big_s // world, h, d)  # (1, U*s, h, d) -> (U, 1, s, h, d)
        return self.module.pack_head_to_seq(list(xs), world)

    def unpack_head_to_seq(self, recv: Tensor, heads: Sequence[int], reps: Sequence[int]) -> list[Tensor]:
        """See :meth:`TorchOps.unpack_head_to_seq` (one pass; replica sums within fp32 rounding of the twin)."""
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


OP_BUILDER = "ds_usp.native.op_builder"


def _op_builders() -> ModuleType:
    """The op builders: ``ds_usp.native.op_builder`` as installed (setup.py maps the top-level ``ops/`` there), or,
    in a source checkout used without installing (``PYTHONPATH`` at the repository), that ``ops/`` loaded under the
    same name. Imports DeepSpeed's op builders: only when needed."""
    try:
        return importlib.import_module(OP_BUILDER)
    except ModuleNotFoundError as e:
        if e.name != OP_BUILDER:
            raise
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ops",
                        "__init__.py")
    if not os.path.isfile(path):
        raise NativeOpUnavailable(f"{OP_BUILDER} is not installed and no ops/ folder is beside the package "
                                  f"(reinstall ds-usp: pip install .)")
    spec = importlib.util.spec_from_file_location(OP_BUILDER, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[OP_BUILDER] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[OP_BUILDER]  # no half-made module for the next import to find
        raise
    return module


def _builder(device_type: str) -> Any:
    builder_for = _op_builders().builder_for
    try:
        return builder_for(device_type)
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
                with _progress(builder):
                    ops = NativeOps(builder.jit_load(verbose), "jit")
            except Exception as e:  # noqa: BLE001 - any build failure becomes one clear error
                raise NativeOpUnavailable(f"building the ds-usp native op ({builder.NAME}) failed: "
                                          f"{type(e).__name__}: {_short(str(e))}") from e
    except NativeOpUnavailable as e:
        _LOADED[device_type] = e
        raise
    _LOADED[device_type] = ops
    return ops


def _build_dir(builder: Any) -> str:
    from torch.utils.cpp_extension import _get_build_directory  # private, but only used for messages

    return _get_build_directory(builder.build_name(), False)


def _jit_cached(builder: Any) -> bool:
    """Whether a JIT build of ``builder``'s op is already in torch's extension cache."""
    return os.path.exists(os.path.join(_build_dir(builder), f"{builder.build_name()}.so"))


@contextlib.contextmanager
def _progress(builder: Any, every: float = 15.0) -> Iterator[None]:
    """Say that a JIT build starts, how long it has been running every ``every`` seconds, and when it is done
    (rank 0 only; nothing when the build is cached); meanwhile the watcher of stale locks runs, and this process is
    recorded as the holder of the build's lock while it holds it (another node sharing the folder sees the host)."""
    if _jit_cached(builder):
        yield
        return
    watch_build_locks()  # a lock left by a build killed earlier would make this one wait forever in silence
    log_rank0(f"building the ds-usp native op ({builder.NAME}) with ninja: about a minute, once per machine and "
              f"environment, cached in {_build_dir(builder)} (usp.native_op=false skips it)")
    start, done = time.monotonic(), threading.Event()

    def tick() -> None:
        while not done.wait(every):
            log_rank0(f"  ... still building the native op ({time.monotonic() - start:.0f} s)")

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        with recording_holder(Path(_build_dir(builder)) / "lock"):  # another host sharing the folder sees the holder
            yield
    finally:
        done.set()
        ticker.join()
    log_rank0(f"built the ds-usp native op in {time.monotonic() - start:.0f} s")


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


def resolve_native_op(setting: NativeOpSetting, device: Union[torch.device, str]) -> TorchOps:
    """Turn the ``usp.native_op`` setting into the ops object passed to the call sites.

    Args:
        setting: ``"auto"`` (the op when it builds, else the PyTorch twins with one warning),
            ``True`` (the op, a failed build is an error) or ``False`` (the twins; never builds).
        device: the device of the tensors.

    Returns:
        The :class:`NativeOps`, or a :class:`TorchOps` (the PyTorch twins, same interface).

    Raises:
        ValueError: an invalid setting.
        NativeOpUnavailable: ``setting`` is True and the op cannot be built or loaded.
    """
    check_native_op(setting)
    if setting is False:
        return _TWINS
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
        return _TWINS


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
    if _jit_cached(builder):
        return NativeOpState("jit-built", f"cached in {_build_dir(builder)} (rebuilt when a source changes)")
    return NativeOpState("jit-buildable", f"will be JIT-built with ninja on first use into {_build_dir(builder)}")

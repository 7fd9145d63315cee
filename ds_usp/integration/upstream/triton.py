"""ds-usp's changes to Triton: its interpreter switch, set while ds-usp's kernels are defined."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ds_usp.integration.upstream.registry import Patch, refuse, register

register("triton_interpret", Patch(
    "triton.knobs.runtime.interpret (Triton's process-wide interpreter switch, TRITON_INTERPRET)",
    "triton.knobs.runtime having an interpret knob and a scope() that restores every knob as it was",
    "Triton decides between its interpreter and its compiler when a function is decorated, from this one "
    "process-wide setting; ds-usp chooses per tensor (CPU tensors interpreted, CUDA ones compiled in the same "
    "process), so each mode's kernels are defined with the switch set for that mode",
    "a per-kernel choice (an interpret argument of triton.jit, or the launcher choosing by the tensors' device)"))


@contextlib.contextmanager
def interpreted(interpret: bool) -> Iterator[None]:
    """While the block runs, Triton's ``@triton.jit`` makes interpreted (``True``) or compiled kernels; the knob (and
    ``TRITON_INTERPRET``) is as it was afterwards.

    Args:
        interpret: the mode of the kernels defined inside the block.

    Raises:
        UpstreamChanged: Triton has no such knob or no ``scope``.
    """
    from triton import knobs

    runtime: Any = getattr(knobs, "runtime", None)
    if not hasattr(runtime, "interpret") or not callable(getattr(runtime, "scope", None)):
        refuse("triton_interpret", "triton.knobs.runtime has no interpret knob or no scope()")
    with runtime.scope():  # restores TRITON_INTERPRET as it was
        runtime.interpret = interpret
        yield

"""ds-usp's changes to Triton: its interpreter switch, set while ds-usp's kernels are defined."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ds_usp.upstream.registry import Patch, refuse, register

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


register("triton_interpreted_helpers", Patch(
    "the @triton.jit helpers of ds-usp's own interpreted kernel module (ds_usp.kernels._triton_kernels)",
    "triton.runtime.interpreter.InterpretedFunction.rewrite() returning the plain function the interpreter runs, "
    "and kernels finding their helpers in their module's globals",
    "each call of a @triton.jit helper from an interpreted kernel patches triton.language again "
    "(InterpretedFunction.__call__ runs _patch_lang, about 4 ms, though the kernel's launch has already patched it): "
    "a quarter of the time of tests/test_packed.py's Triton cases went there",
    "InterpretedFunction.__call__ patching only when triton.language is not patched yet"))


def inline_interpreted_helpers(module: Any) -> None:
    """Replace each interpreted ``@triton.jit`` helper of ``module`` (one that is not launched itself, its name
    starting with ``_``) by the plain function the interpreter runs for it: called from an interpreted kernel, whose
    launch has already patched ``triton.language``, it then runs without patching it again. Where Triton's interpreter
    is not what this was written for, the helpers are left as they are (correct, slower)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return
    if not callable(getattr(InterpretedFunction, "rewrite", None)):
        return
    for name, value in list(vars(module).items()):
        if name.startswith("_") and isinstance(value, InterpretedFunction):
            setattr(module, name, value.rewrite())

"""The registry of every change ds-usp makes to third-party code: :class:`Patch` records, :data:`PATCHES`, and the
checks a patch runs before it applies (:func:`require_parameters`, :func:`refuse`).

Each patch first checks the exact upstream signature or behaviour it relies on. When that changed, it refuses with
:class:`UpstreamChanged`, naming the patched object, what it relied on, what was found and the upstream fix that would
make it unnecessary, instead of silently patching something else. :data:`PATCHES` is the table docs/architecture.md
shows ("Patches of third-party code"); the patches themselves live in this package's module of each upstream project.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any


class UpstreamChanged(RuntimeError):
    """A third-party internal ds-usp patches is not what the patch was written for."""


@dataclass(frozen=True)
class Patch:
    """One patch of third-party code.

    Attributes:
        target: the patched object.
        relies_on: the upstream signature or behaviour checked before patching.
        why: what would go wrong without it.
        upstream_fix: the upstream change that would make it unnecessary.
    """

    target: str
    relies_on: str
    why: str
    upstream_fix: str


PATCHES: dict[str, Patch] = {}  # every patch, registered by its upstream project's module (register)


def register(key: str, patch: Patch) -> str:
    """Add ``patch`` to :data:`PATCHES` under ``key`` (each module of this package registers its own at import).

    Returns:
        ``key``, for the module to name its patch by.
    """
    if PATCHES.get(key, patch) != patch:
        raise ValueError(f"two upstream patches are registered as {key!r}")
    PATCHES[key] = patch
    return key


def refuse(key: str, found: str) -> None:
    """Raise :class:`UpstreamChanged` for the patch registered as ``key``, saying what was ``found`` instead.

    Raises:
        UpstreamChanged: always.
    """
    patch = PATCHES[key]
    raise UpstreamChanged(f"ds-usp patches {patch.target}, relying on {patch.relies_on}; but {found}. It would "
                          f"otherwise go wrong as follows: {patch.why}. Use the versions setup.py's dev extra pins, or "
                          f"report it; the upstream fix that makes the patch unnecessary: {patch.upstream_fix}")


def innermost(fn: Any) -> Any:
    """``fn`` under its decorators: ``functools.wraps``' ``__wrapped__``, or the ``func`` a closure wraps (DeepSpeed's
    ``instrument_w_nvtx`` keeps no ``__wrapped__``)."""
    fn = getattr(fn, "__func__", fn)  # a bound method
    while True:
        inner = getattr(fn, "__wrapped__", None)
        code = getattr(fn, "__code__", None)
        if inner is None and code is not None and "func" in code.co_freevars and fn.__closure__:
            inner = fn.__closure__[code.co_freevars.index("func")].cell_contents
        if not callable(inner):
            return fn
        fn = inner


def lacking_parameters(fn: Any, params: tuple[str, ...]) -> list[str]:
    """Those of ``params`` that ``fn`` (callable, under its decorators) does not take."""
    return [p for p in params if p not in inspect.signature(innermost(fn)).parameters]


def require_parameters(key: str, fn: Any, params: tuple[str, ...]) -> None:
    """Refuse (:func:`refuse`) unless ``fn`` is callable and takes every one of ``params`` (under its decorators)."""
    if not callable(fn):
        refuse(key, "it does not exist in the installed version")
    lacking = lacking_parameters(fn, params)
    if lacking:
        refuse(key, f"it takes no {', '.join(lacking)} in the installed version")

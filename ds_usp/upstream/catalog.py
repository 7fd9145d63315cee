"""The whole table of patches: every upstream project's module imported, so that :data:`PATCHES` holds each
module's records (the table docs/architecture.md shows; the tests read it from here)."""
from ds_usp.upstream import (  # noqa: F401 - their records
    accelerate, c10d, deepspeed, diffusers, imports, torch, transformers, transformers_trainer, triton, trl)
from ds_usp.upstream.registry import PATCHES

__all__ = ["PATCHES", "patch_table"]


def patch_table() -> str:
    """:data:`PATCHES` as the Markdown table docs/architecture.md shows (tests/test_upstream.py compares the two), by
    key (the same order whichever module was imported first).

    Returns:
        The table's Markdown.
    """
    rows = ["| patched | why | checked before patching | upstream fix |", "| --- | --- | --- | --- |"]
    rows += [f"| {p.target} | {p.why} | {p.relies_on} | {p.upstream_fix} |" for _, p in sorted(PATCHES.items())]
    return "\n".join(rows)

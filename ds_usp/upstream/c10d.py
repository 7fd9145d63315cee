"""ds-usp's use of torch.distributed's (c10d's) internals: a process group looked up by its name."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch.distributed as dist

from ds_usp.upstream.registry import Patch, refuse, register

register("group_by_name", Patch(
    "torch.distributed.distributed_c10d._resolve_process_group (a private function, called)",
    "the function existing and taking (group_name) (a pybind builtin: its docstring's signature), the group_name a "
    "ProcessGroup reports",
    "the USP custom operators cannot take a process group (an operator schema has no such type): they take the "
    "group's name, and only torch's own registry maps the name back to the group",
    "a public torch.distributed function resolving a group_name (torch's functional collectives resolve it in C++)"))


@functools.cache
def _resolver() -> Callable[[str], Any]:
    """torch's name -> group lookup, checked once (a cache: the check reads its signature)."""
    resolve = getattr(dist.distributed_c10d, "_resolve_process_group", None)
    if not callable(resolve):
        refuse("group_by_name", "it does not exist in the installed version")
    try:
        takes_name = "group_name" in inspect.signature(resolve).parameters
    except (TypeError, ValueError):  # a pybind builtin: the signature is its docstring's first line
        takes_name = (resolve.__doc__ or "").startswith("_resolve_process_group(group_name")
    if not takes_name:
        refuse("group_by_name", "it takes no group_name in the installed version")
    return resolve


def process_group_named(name: str) -> Any:
    """The process group whose ``group_name`` is ``name``, from torch.distributed's own registry.

    Args:
        name: the group's ``group_name``.

    Returns:
        The process group.

    Raises:
        UpstreamChanged: torch has no such lookup, or it takes no ``group_name``.
    """
    return _resolver()(name)

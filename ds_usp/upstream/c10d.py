"""ds-usp's use of torch.distributed's (c10d's) internals: a process group looked up by its name, and a group's
timeout read."""
from __future__ import annotations

import datetime
import functools
import inspect
from typing import Any, Callable, Optional

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


register("group_timeout", Patch(
    "torch.distributed.ProcessGroup._get_backend (a private method, called) and the options._timeout of the backend it "
    "returns (read)",
    "the method existing and taking a device type, and the backend's options carrying _timeout as a datetime.timedelta "
    "(gloo's and NCCL's do); otherwise the timeout counts as unknown and the topology's kinds over every rank get a "
    "group of their own, as before",
    "a USP topology's kinds over every rank (with one replica the SP and sequence x data-parallel groups) use the "
    "default group, one NCCL communicator rather than a second one beside it, only where its collectives' timeout is "
    "usp.timeout_seconds, and torch has no public getter of a group's timeout",
    "a public getter of a ProcessGroup's timeout (torch has ProcessGroup.set_timeout only)"))


def group_timeout(group: Any) -> Optional[datetime.timedelta]:
    """The timeout of ``group``'s collectives (its backend's, set when the group was created or by ``set_timeout``),
    None when torch does not say (a backend without ``options._timeout``).

    Args:
        group: the process group.

    Returns:
        The timeout, or None.
    """
    get = getattr(group, "_get_backend", None)
    if not callable(get):
        return None
    for device_type in getattr(group, "_device_types", ()):
        try:
            timeout = getattr(getattr(get(device_type), "options", None), "_timeout", None)
        except RuntimeError:  # no backend for that device type
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None

"""The ``ds_usp`` logger: one place that decides how the library speaks."""
from __future__ import annotations

import logging
from typing import Callable, Hashable

_LOGGER_NAME = "ds_usp"


def get_logger() -> logging.Logger:
    """Return the ``ds_usp`` logger, giving it a stderr handler on first use.

    Returns:
        The logger; INFO and above reach stderr unless the application configured logging itself.
    """
    logger = logging.getLogger(_LOGGER_NAME)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[ds_usp] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    return logger


def log_info(msg: str) -> None:
    """Log ``msg`` at INFO level on the ``ds_usp`` logger."""
    get_logger().info(msg)


def log_warning(msg: str) -> None:
    """Log ``msg`` at WARNING level on the ``ds_usp`` logger."""
    get_logger().warning(msg)


def log_rank0(msg: str) -> None:
    """Log ``msg`` at INFO level once per job: on rank 0, or in a process without torch.distributed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        log_info(msg)


def log_error(msg: str) -> None:
    """Log ``msg`` at ERROR level on the ``ds_usp`` logger (on this rank: a failure every rank reports for itself)."""
    get_logger().error(msg)


_SAID: set = set()  # the keys say_once has spoken under in this process


def say_once(key: Hashable, msg: str, log: Callable[[str], None] = log_warning) -> None:
    """``log(msg)`` the first time this process says something under ``key`` (a tuple naming the matter first): for a
    condition that code asked several times per process (``ds_usp.initialize`` and each topology build) meets again.

    Args:
        key: what is said (the same key: said once).
        msg: the message.
        log: how (:func:`log_warning`, :func:`log_rank0`...).
    """
    if key not in _SAID:
        _SAID.add(key)
        log(msg)

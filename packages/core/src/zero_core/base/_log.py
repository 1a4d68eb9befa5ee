"""zero's logger tree: ``zero`` and one child per distribution.

Library code logs and never prints. zero-core logs under ``zero.core``; a plugin takes its logger
from :func:`get_logger` (``zero.offload``, ``zero.strategy.chunk``, ...), so one
``logging.getLogger("zero").setLevel(...)`` reaches all of them. No handler is added: where the
records go is the application's choice.
"""

from __future__ import annotations

import logging

__all__ = ["get_logger", "logger", "root"]

ROOT = "zero"
#: The root of the tree, made first so every ``zero.<name>`` logger is its child from the start.
root = logging.getLogger(ROOT)


def get_logger(name: str) -> logging.Logger:
    """The logger ``zero.<name>`` (``get_logger("offload")`` is ``zero.offload``)."""
    return logging.getLogger(f"{ROOT}.{name}")


#: zero-core's own logger.
logger = get_logger("core")

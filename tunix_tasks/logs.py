"""Logging a warning once: for what every episode, program or poll may meet again.

warn_once(log, f"sandbox layers failed: {failures}")   # logged the first time only
"""

from __future__ import annotations

import logging
import threading

__all__ = ["warn_once"]

MAX_KINDS = 1024  # distinct messages remembered; later new ones are not logged

_seen: set[str] = set()
_lock = threading.Lock()


def warn_once(log: logging.Logger, message: str) -> None:
    """`log.warning(message)` the first time this process meets `message`."""
    with _lock:
        if message in _seen or len(_seen) >= MAX_KINDS:
            return
        _seen.add(message)
    log.warning(message)

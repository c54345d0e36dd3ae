"""Reading what others wrote (a request body, a file on a shared disk) without trusting it:
a bounded read of a regular file, and JSON whose shape cannot crash its reader.

    raw = read_regular(path, limit=1 << 20)  # OSError: gone, not a regular file, too large
    data = json_loads(raw)                   # ValueError: not JSON, or nested too deeply

Both say what is wrong in words a user can act on, never Python's internals.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

__all__ = ["json_loads", "read_regular"]


def read_regular(path: Path, limit: int) -> bytes:
    """`path`'s bytes, symlinks followed; OSError unless it is a regular file of at most
    `limit` bytes (its message says why; the caller names the file). A FIFO opens without
    waiting for a writer (O_NONBLOCK) and is refused, as a device is: one would hang the
    reader, `/dev/zero` would fill its memory. The check is of the file opened, so
    nothing can swap it between the check and the read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError("not a regular file (a FIFO, a device or a folder)")
        if st.st_size > limit:
            raise OSError(f"{st.st_size} bytes, over the limit of {limit} bytes")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)  # it may have grown since the fstat
    finally:
        os.close(fd)
    if len(data) > limit:
        raise OSError(f"over the limit of {limit} bytes")
    return data


def json_loads(raw: bytes | str) -> Any:
    """`raw` parsed as JSON; ValueError naming what is wrong. `json.loads` raises
    RecursionError (not a ValueError: it escaped callers' handlers) for deep nesting,
    and a ValueError quoting `sys.set_int_max_str_digits` for a number over 4,300 digits."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(str(err)) from None
    except UnicodeDecodeError as err:
        raise ValueError(f"not UTF-8 text (byte {err.start})") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError:  # the only other: an int past Python's limit on digits
        raise ValueError(f"a number of more than {sys.get_int_max_str_digits()} digits") from None

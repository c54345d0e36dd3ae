"""What a run's actors coordinate through on the shared `weights_dir` (engine.py): claims
and each server's record.

A claim is a file created exclusively that holds its holder's token. The holder touches it
every `CLAIM_BEAT_S` while it works and removes it at the end, if it still holds that
token. A claim untouched for `CLAIM_STALE_S` is a dead holder's (killed mid-write). The
first waiter to move it aside takes it over. A waiter that moved aside a fresh claim (a
live holder's, which replaced the stale one meanwhile) puts it back.

    with claimed(folder_claim, ready=folder.is_dir, timeout_s=600) as mine:
        if mine and not folder.is_dir():
            ...  # write the folder; the other actors wait until it is there
    record = ServerRecord(run_folder, url)
    record.read()  # {"version", "digest", "created_at"} the server was last told to load
    record.write(version=3, digest=d, created_at=t, writer="actor-0")

Times are the shared disk's mtimes against this machine's clock: a few seconds of skew
between machines is fine.

Anything on the shared disk may be another's (a foreign or torn file, a FIFO, a folder):
a record is read only as a regular file of at most 64 KiB and used only if each field is
of what the engine writes (else it is no record: the actor pushes); a stale claim that is
not a regular file (a folder) is removed, never waited on.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import re
import shutil
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tunix_tasks.actor.remote.wire import publish_time_problem
from tunix_tasks.storage.snapshot_format import short_repr
from tunix_tasks.untrusted import json_loads, read_regular

__all__ = ["CLAIM_STALE_S", "DIGEST", "ServerRecord", "age_s", "claimed", "touching"]

log = logging.getLogger(__name__)

# A waiter looks again after 5 ms, doubling to 0.25 s: a small model's folder lands in
# milliseconds, a large one's in tens of seconds. (From 10 ms, a fleet's two waits, folder
# then push, took 0.04-0.08 s, not 0.04-0.05 s: benchmarks/remote_engine.py --fleet.)
CLAIM_POLL_S = (0.005, 0.25)
# A holder touches its claim (and its half-written folder) every 2 s; one untouched for
# 30 s is a dead holder's, and the clean-up may remove what it left.
CLAIM_BEAT_S = 2.0
CLAIM_STALE_S = 30.0


def age_s(path: Path) -> float:
    """Seconds since `path` was last touched; 0 if it is gone (its holder finished)."""
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


@contextlib.contextmanager
def touching(paths: list[Path]) -> Iterator[None]:
    """Touch `paths` every `CLAIM_BEAT_S` while the block runs: a live holder's claim never
    looks stale, however long its work takes."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(CLAIM_BEAT_S):
            for path in paths:
                with contextlib.suppress(OSError):
                    os.utime(path)

    thread = threading.Thread(target=beat, name="weights-claim", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _create(claim: Path, token: bytes) -> bool:
    """Create `claim` holding `token`; False when it exists."""
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, token)
    finally:
        os.close(fd)
    return True


def _take_over(claim: Path, token: bytes) -> None:
    """Remove a stale claim so that one waiter does: moving it aside is atomic. If what
    was moved is fresh, a live holder replaced the stale claim meanwhile: it goes back."""
    aside = claim.with_name(f"{claim.name}.{token.decode()}.stale")
    try:
        os.rename(claim, aside)
    except FileNotFoundError:
        return  # another waiter took it over first
    mode = os.lstat(aside).st_mode
    if not stat.S_ISREG(mode):
        # No holder's: claims are regular files. Left alone it would block every waiter (a
        # folder cannot be linked back or unlinked); it lies in the run's folder, whose
        # stale leftovers the engine's clean-up removes the same way.
        log.warning("%s: not a regular file, so no claim: removing it", claim)
        if stat.S_ISDIR(mode):
            shutil.rmtree(aside, ignore_errors=True)
        else:
            aside.unlink(missing_ok=True)
        return
    if age_s(aside) <= CLAIM_STALE_S:
        with contextlib.suppress(FileExistsError):  # else yet another claim is there
            os.link(aside, claim)
    else:
        log.warning("%s: its holder stopped (a stale claim): taking it over", claim)
    aside.unlink(missing_ok=True)


def _release(claim: Path, token: bytes) -> None:
    """Remove `claim` if it still holds `token` (a holder stalled past the stale limit may
    have lost it to another)."""
    with contextlib.suppress(OSError):  # gone, or replaced by what is not a claim
        if read_regular(claim, len(token)) == token:
            claim.unlink()


@contextlib.contextmanager
def claimed(claim: Path, *, ready: Callable[[], bool], timeout_s: float | None) -> Iterator[bool]:
    """Hold `claim` while the block runs (module docstring). While another actor holds
    it, wait: yields False once `ready()` (what the holder was doing is done), True once
    claimed. Past `timeout_s` the block runs without it (True, logged); None: wait for as
    long as the holder lives."""
    token = uuid.uuid4().hex.encode()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    delay = CLAIM_POLL_S[0]
    while not ready():
        if not _create(claim, token):
            if age_s(claim) > CLAIM_STALE_S:
                _take_over(claim, token)
            elif deadline is None or time.monotonic() < deadline:
                time.sleep(delay)
                delay = min(2 * delay, CLAIM_POLL_S[1])
            else:
                log.warning("%s: still held after timeout_s=%g: going on", claim, timeout_s)
                yield True
                return
            continue
        try:
            with touching([claim]):
                yield True
        finally:
            _release(claim, token)
        return
    yield False


def _server_key(url: str) -> str:
    """8 hex naming a server: of its URL, and of this machine's name when the URL is a
    loopback one (each machine's own server, at the same URL)."""
    host = urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback or host in ("0.0.0.0", "::"):
        url = f"{socket.gethostname()}/{url}"
    return hashlib.sha256(url.encode()).hexdigest()[:8]


_RECORD_BYTES = 1 << 16  # a record is ~150 bytes
DIGEST = re.compile(r"[0-9a-f]{64}")  # a manifest's sha256, as the engine writes it
_MAX_VERSION = 2**53  # a JSON number's exact ints


def _version(value: Any) -> bool:
    return type(value) is int and 0 <= value < _MAX_VERSION  # bool is refused


def _record_problem(held: Any) -> str | None:
    """What makes `held` no record the engine wrote, or None. Each field is used: the
    digest names a folder (a path outside the run's folder would be pushed), and a
    `created_at` in the far future (or Infinity, which Python's JSON reads) would make
    every actor of the run lag behind it: no push again."""
    return _snapshot_problem(held) or publish_time_problem(held.get("created_at"))


def _snapshot_problem(held: Any) -> str | None:
    """What makes `held` no {"version", "digest"} of a snapshot, or None."""
    if not isinstance(held, dict):
        return "not a JSON object"
    if not _version(held.get("version")):
        return f"version is not an int in [0, 2**53): {short_repr(held.get('version'))}"
    if not isinstance(held.get("digest"), str) or not DIGEST.fullmatch(held["digest"]):
        return f"digest is not 64 lowercase hex: {short_repr(held.get('digest'))}"
    return None


class ServerRecord:
    """What one server was last told to load by the run's actors, in the run's folder:
    `.server-<key>.json`, and `.server-<key>.lock`, the claim its pushes are made under."""

    FIELDS = ("version", "digest", "created_at")

    def __init__(self, run_folder: Path, url: str) -> None:
        name = f".server-{_server_key(url)}"
        self.path = run_folder / f"{name}.json"
        self.lock = run_folder / f"{name}.lock"
        self._warned = False  # an unreadable record is logged once: it is read every poll

    def read(self) -> dict[str, Any] | None:
        """{"version", "digest", "created_at", "previous"}, and "written" (the record's
        mtime); None when there is none or it is unreadable (a torn or foreign one, or one
        with a field the engine would not write: then push). "previous": the (version,
        digest) held before, or None."""
        try:
            held = json_loads(read_regular(self.path, _RECORD_BYTES))
            written = self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            return self._unreadable(str(err))
        problem = _record_problem(held)
        if problem is not None:
            return self._unreadable(problem)
        previous = held.get("previous")
        if _snapshot_problem(previous) is None:
            previous = (previous["version"], previous["digest"])
        else:  # none, or a record of before digests named adapters
            previous = None
        return {k: held[k] for k in self.FIELDS} | {"written": written, "previous": previous}

    def _unreadable(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s: not a server record (%s): pushing as if none", self.path, why)

    def write(
        self,
        *,
        version: int,
        digest: str,
        created_at: float,
        writer: str,
        previous: tuple[int, str] | None = None,
    ) -> None:
        """Replace the record in one step (a reader sees the old one or the new one).
        `previous`: the (version, digest) it held before (a LoRA run's adapters: the one
        to unload once the next is loaded)."""
        partial = self.path.with_name(f"{self.path.name}.{writer}.partial")
        body = {"version": version, "digest": digest, "created_at": created_at}
        if previous is not None:
            body["previous"] = {"version": previous[0], "digest": previous[1]}
        partial.write_text(json.dumps(body))
        try:
            partial.replace(self.path)
        except IsADirectoryError:  # no record (records are files): it would fail every push
            shutil.rmtree(self.path, ignore_errors=True)
            partial.replace(self.path)

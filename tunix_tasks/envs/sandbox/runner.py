"""Choosing the isolation, launching the child, enforcing wall-clock and output limits."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import pwd
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import tunix_tasks.envs.sandbox.bwrap as bwrap
from tunix_tasks.envs.sandbox.limits import (
    INSTALL_HINT,
    MODES,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    Status,
)
from tunix_tasks.logs import warn_once

logger = logging.getLogger(__name__)

_SETUP_FAILED = 70  # exit code of the bootstrap when its own setup crashed
_UID_RANGE = (1_000_000, 2_000_000_000)
_BOOTSTRAP = (Path(__file__).parent / "child.py").read_text()
# What the namespace fallback must achieve (as root, with CAP_SYS_ADMIN) to count.
_FALLBACK_NEEDS = {"netns", "readonly_fs", "unique_uid", "nproc", "hidepid", "seccomp"}
T = TypeVar("T")


@dataclass(frozen=True)
class _Plan:
    kind: str  # "bwrap" | "namespaces" | "unsafe"
    bwrap: str | None = None
    runtime: bwrap.Runtime | None = None


_plans: dict[tuple, _Plan] = {}
_plans_lock = threading.Lock()


def _fresh_uid() -> int:
    while True:
        uid = secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0]) + _UID_RANGE[0]
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process still running as the sandbox's unique uid."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            os.kill(int(entry), signal.SIGKILL)
                        break
        except (OSError, ValueError):
            continue


def _classify(exit_code: int | None, stderr: str, timed_out: bool, output_exceeded: bool) -> Status:
    if timed_out:
        return "timeout"
    if output_exceeded:
        return "output_limit"
    if exit_code is None:
        return "killed"
    if exit_code < 0:
        return "timeout" if -exit_code == signal.SIGXCPU else "killed"
    if exit_code == 0:
        return "ok"
    if "MemoryError" in stderr[-2000:]:
        return "memory"
    return "error"


def _blocking(make: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion from sync code, also from inside a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    box: list[T] = []
    t = threading.Thread(target=lambda: box.append(asyncio.run(make())))
    t.start()
    t.join()
    return box[0]


def _key(limits: SandboxLimits) -> tuple:
    python = limits.python or sys.executable
    return (
        limits.mode,
        limits.bwrap,
        python,
        limits.isolate_network,
        limits.readonly_fs,
        limits.drop_privileges,
        os.geteuid(),
    )


def check_isolation(limits: SandboxLimits = SandboxLimits()) -> str:
    """The isolation runs with ``limits`` get: ``"bwrap"``, ``"namespaces"`` (the kernel
    fallback, as root) or ``"unsafe"`` (neither works, and the caller opted in). Probes
    once per configuration and process (one short sandbox run each). Raises
    :class:`SandboxUnavailable` when nothing acceptable works, ``ValueError`` for an
    unknown mode."""
    return _plan(limits).kind


def _plan(limits: SandboxLimits) -> _Plan:
    if limits.mode not in MODES:
        raise ValueError(f"sandbox mode {limits.mode!r}: expected one of {', '.join(MODES)}")
    key = _key(limits)
    plan = _plans.get(key)
    if plan is None:
        plan = _resolve(limits)
        with _plans_lock:
            _plans[key] = plan
    return plan


def _resolve(limits: SandboxLimits) -> _Plan:
    # The probe judges the isolation, not the caller's (possibly tiny) limits.
    probe = dataclasses.replace(
        limits,
        wall_s=20.0,
        cpu_s=10,
        memory_bytes=max(limits.memory_bytes, 256 << 20),
        max_output_bytes=65536,
        max_open_files=max(limits.max_open_files, 64),
    )
    reasons = []
    path = bwrap.find_bwrap(limits.bwrap)
    if path is None:
        reasons.append(f"bubblewrap: {limits.bwrap or 'bwrap'} not found")
    elif "--size" not in bwrap.features(path):
        reasons.append(f"bubblewrap: {path} is older than 0.7 (no --size)")
    else:
        try:
            rt = bwrap.runtime(limits.python or sys.executable, os.geteuid() == 0)
            plan = _Plan("bwrap", path, rt)
            r = _blocking(lambda: _execute("pass", probe, plan))
            if r.status == "ok" and "rlimits" in r.mechanisms:
                return plan
            reasons.append(f"bubblewrap: {r.status}: {r.stderr.strip()[-300:]}")
        except (OSError, ValueError) as e:
            reasons.append(f"bubblewrap: {e}")
    if limits.mode == "bwrap":
        pass
    elif os.geteuid() != 0:
        reasons.append("kernel namespaces: need root")
    else:
        plan = _Plan("namespaces")
        r = _blocking(lambda: _execute("pass", probe, plan))
        missing = sorted(_FALLBACK_NEEDS - set(r.mechanisms))
        if r.status == "ok" and not missing:
            warn_once(
                logger,
                f"sandbox: bubblewrap unusable ({'; '.join(reasons)}); using the kernel-"
                "namespace fallback, which leaves world-readable host files readable. "
                + INSTALL_HINT,
            )
            return plan
        reasons.append(f"kernel namespaces: missing {', '.join(missing) or r.status}")
    if limits.mode == "unsafe-audit-only":
        warn_once(
            logger,
            f"sandbox: UNSAFE (unsafe-audit-only): model code runs without real isolation "
            f"({'; '.join(reasons)}). " + INSTALL_HINT,
        )
        return _Plan("unsafe")
    raise SandboxUnavailable(
        "python sandbox: no real isolation available (" + "; ".join(reasons) + "). " + INSTALL_HINT
    )


async def run_python_async(code: str, *, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` as a script in the sandbox without blocking the event loop. Raises
    :class:`SandboxUnavailable` (before running anything) when isolation is missing."""
    python = limits.python or sys.executable
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return SandboxResult("", f"sandbox: cannot start {python}", None, "killed", 0.0)
    plan = _plans.get(_key(limits))
    if plan is None:
        plan = await asyncio.to_thread(_plan, limits)
    return await _execute(code, limits, plan)


def run_python(code: str, *, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Blocking variant of :func:`run_python_async`. Called from a thread that is running an
    event loop it still works (in a helper thread) but blocks that loop: use the async one."""
    return _blocking(lambda: run_python_async(code, limits=limits))


def _command(
    code: str, limits: SandboxLimits, plan: _Plan, report_w: int, fds: list[int]
) -> tuple[list[str], dict, tuple[str, ...], int | None, str | None]:
    """(argv, extra Popen kwargs, parent-side mechanisms, uid to reap, host work dir)."""
    is_root = os.geteuid() == 0
    cfg = {
        "report_fd": report_w,
        "cpu_s": max(1, int(limits.cpu_s)),
        "memory_bytes": limits.memory_bytes,
        "max_file_bytes": limits.max_file_bytes,
        "max_open_files": limits.max_open_files,
        "isolate_network": limits.isolate_network,
        "readonly_fs": limits.readonly_fs,
        "drop_privileges": limits.drop_privileges,
        "audit_hook": limits.audit_hook,
    }
    if plan.kind == "bwrap":
        assert plan.runtime is not None and plan.bwrap is not None
        code_fd = os.memfd_create("main.py")
        fds.append(code_fd)
        os.write(code_fd, code.encode())
        os.lseek(code_fd, 0, os.SEEK_SET)
        uid = _fresh_uid() if is_root else None
        # The sandbox's user namespace also holds bubblewrap's init: one more process.
        cfg.update(
            workdir=bwrap.WORK, uid=None, kernel_ns=False, expose=[], nproc=limits.max_processes + 1
        )
        argv = bwrap.argv(
            plan.bwrap,
            plan.runtime,
            code_fd=code_fd,
            work_bytes=limits.work_bytes,
            share_net=not limits.isolate_network,
        )
        kw = dict(user=uid, group=uid, extra_groups=[]) if uid is not None else {}
        mech = ("bwrap", "userns", "pidns", "mountns", "ipcns")
        mech += ("netns",) if limits.isolate_network else ()
        mech += ("unique_uid",) if uid is not None else ()
        return [*argv, "-I", "-S", "-B", "-c", _BOOTSTRAP, json.dumps(cfg)], kw, mech, uid, None
    python = limits.python or sys.executable
    uid = _fresh_uid() if is_root and limits.drop_privileges else None
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="tunix-sandbox-"))
    with open(os.path.join(workdir, "main.py"), "w") as f:
        f.write(code)
    if uid is not None:
        os.chown(workdir, uid, uid)
        os.chown(os.path.join(workdir, "main.py"), uid, uid)
    expose = (
        sorted({sys.base_prefix, sys.base_exec_prefix})
        if python == sys.executable
        else [os.path.dirname(os.path.dirname(os.path.realpath(python)))]
    )
    cfg.update(
        workdir=workdir,
        uid=uid,
        kernel_ns=True,
        expose=expose,
        nproc=limits.max_processes if uid is not None else None,
    )
    argv = [python, "-I", "-S", "-B", "-c", _BOOTSTRAP, json.dumps(cfg)]
    return argv, {"cwd": workdir}, (), uid, workdir


async def _execute(code: str, limits: SandboxLimits, plan: _Plan) -> SandboxResult:
    t0 = time.monotonic()
    report_r, report_w = os.pipe()
    fds = [report_r, report_w]
    proc: asyncio.subprocess.Process | None = None
    workdir = uid = None
    timed_out = output_exceeded = False
    out = {"stdout": bytearray(), "stderr": bytearray()}
    try:
        argv, kw, parent_mech, uid, workdir = _command(code, limits, plan, report_w, fds)
        env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": workdir or bwrap.WORK}
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,
                pass_fds=tuple(fds[1:]),
                **kw,
            )
        except OSError as e:
            return SandboxResult(
                "", f"sandbox: cannot start {argv[0]}: {e}", None, "killed", time.monotonic() - t0
            )
        finally:
            for fd in fds[1:]:
                os.close(fd)
            del fds[1:]
        total = 0

        async def pump(stream: asyncio.StreamReader, buf: bytearray) -> None:
            nonlocal total, output_exceeded
            while chunk := await stream.read(4096):  # read to EOF: the transport closes
                buf += chunk[: max(0, limits.max_output_bytes - total)]
                total += len(chunk)
                if total > limits.max_output_bytes and not output_exceeded:
                    output_exceeded = True
                    _kill_group(proc.pid)

        assert proc.stdout is not None and proc.stderr is not None
        pumps = asyncio.gather(pump(proc.stdout, out["stdout"]), pump(proc.stderr, out["stderr"]))
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
            async with asyncio.timeout(limits.wall_s):
                await asyncio.shield(pumps)
            async with asyncio.timeout(max(0.1, limits.wall_s - (time.monotonic() - t0))):
                await proc.wait()
        except TimeoutError:
            timed_out = not output_exceeded
        _kill_group(proc.pid)  # under bubblewrap this ends its pid namespace: everything
        if uid is not None:
            _kill_uid(uid)
        await proc.wait()
        # A process that escaped the group could hold the pipes open: do not wait (the
        # timeout cancels the pumps).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                await pumps
        os.set_blocking(report_r, False)
        try:
            report = os.read(report_r, 65536).decode(errors="replace")
        except BlockingIOError:
            report = ""
    finally:  # also on cancellation: never leave a child, a directory or an fd behind
        if proc is not None:
            if proc.returncode is None:
                _kill_group(proc.pid)
            proc._transport.close()  # pipes an escaped process may hold: do not leak them
        for fd in fds:
            os.close(fd)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    lines = report.splitlines()
    mechanisms = parent_mech + tuple(ln[1:] for ln in lines if ln.startswith("+"))
    failures = [ln[1:] for ln in lines if ln.startswith("-")]
    stdout, stderr = (out[k].decode(errors="replace") for k in ("stdout", "stderr"))
    if proc.returncode == _SETUP_FAILED and "sandbox setup failed" in stderr:
        logger.error("sandbox bootstrap failed: %s", stderr[-1000:])
    if failures and plan.kind != "bwrap":
        warn_once(logger, f"sandbox layers failed: {failures}")
    rc = proc.returncode
    if plan.kind == "bwrap" and rc is not None and 128 < rc <= 128 + 64:
        rc = 128 - rc  # bubblewrap reports a child killed by signal N as exit code 128 + N
    status = _classify(rc, stderr, timed_out, output_exceeded)
    return SandboxResult(stdout, stderr, rc, status, time.monotonic() - t0, mechanisms)

"""Sandbox for untrusted, model-written Python: owns process isolation and resource limits.

Every run gets a fresh child interpreter (``python -I -S -B``, stdlib only) started in its
own session, with a throwaway working directory and an empty environment. A small
bootstrap runs first inside the child and applies, strongest first:

* kernel isolation when we are root: a private network namespace (no interfaces but a
  downed loopback, so nothing is reachable), a private mount namespace in which every
  mount is remounted read-only except the work directory (and home directories that
  hide the interpreter are replaced by an empty tmpfs exposing only the interpreter),
  then a switch to a fresh, unique unprivileged uid. The unique uid is what makes
  ``RLIMIT_NPROC`` meaningful (for root it is ignored and for a shared uid it counts
  unrelated processes) and it keeps other processes' ``/proc/<pid>/environ`` unreadable;
* when not root: an unprivileged user namespace owning new network and mount namespaces
  (same network cut-off and read-only remount) if the kernel allows it;
* resource limits: ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``,
  ``RLIMIT_CORE``, ``RLIMIT_NPROC`` (only with the unique uid), ``PR_SET_NO_NEW_PRIVS``;
* a best-effort audit hook (``sys.addaudithook``) that refuses sockets, process creation,
  ctypes, writes outside the work directory and reads of other processes' ``/proc``.
  Audit hooks are not a security boundary on their own; they are the last layer and the
  only one when the kernel layers fail.

The parent enforces the wall-clock limit and the output limit by killing the child's
whole process group (and, with a unique uid, every process of that uid). Which layers
were applied is returned in ``SandboxResult.mechanisms``; a requested layer that could
not be applied is logged once as a warning.

    result = run_python("print(3+4)")
    result.status, result.stdout        # ("ok", "7\\n")
    result = await run_python_async("while True: pass")
    result.status                       # "timeout"

Bad user code never raises: it is reported through ``status``.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

Status = Literal["ok", "error", "timeout", "memory", "output_limit", "killed"]

# Exit code the bootstrap uses when its own setup crashed (not the user's code).
_SETUP_FAILED = 70
_UID_RANGE = (1_000_000, 2_000_000_000)
_MAIN = "main.py"


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. Booleans request isolation layers; unavailable ones degrade."""

    wall_s: float = 5.0
    cpu_s: int = 2
    memory_bytes: int = 256 * 1024 * 1024  # RLIMIT_AS (virtual address space)
    max_output_bytes: int = 64 * 1024  # stdout + stderr together; the run is killed past it
    max_file_bytes: int = 1024 * 1024  # RLIMIT_FSIZE
    max_open_files: int = 64
    max_processes: int = 1  # RLIMIT_NPROC for the unique uid: 1 = no fork, no threads
    isolate_network: bool = True
    readonly_fs: bool = True
    drop_privileges: bool = True
    audit_hook: bool = True
    python: str | None = None  # interpreter; defaults to sys.executable


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal; None: never started
    status: Status
    wall_s: float
    mechanisms: tuple[str, ...] = ()  # isolation layers actually applied in the child


# Runs inside the child, as the first thing, before the user's code. Kept free of
# imports from this package: the child sees only the stdlib.
_BOOTSTRAP = r"""
import os, sys

def _setup(cfg):
    import ctypes, resource
    done, failed = [], []
    libc = ctypes.CDLL(None, use_errno=True)
    work = cfg["workdir"]
    root = os.geteuid() == 0

    def _err(what):
        e = ctypes.get_errno()
        return OSError(e, os.strerror(e), what)

    def mount(src, tgt, fstype, flags, data=None):
        enc = lambda s: s.encode() if s is not None else None
        if libc.mount(enc(src), enc(tgt), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
            raise _err(tgt)

    NEWNS, NEWNET, NEWUSER = 0x00020000, 0x40000000, 0x10000000
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
    MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
    # statvfs flag bit -> mount flag bit, so a read-only remount keeps the other flags.
    KEEP = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}

    def fs_setup():
        mount(None, "/", None, MS_REC | MS_PRIVATE)  # never propagate to the host
        # Open targets first: a tmpfs may hide them, the fds still reach them.
        targets = [os.path.realpath(p) for p in cfg["expose"]] + [work]
        fds = {t: os.open(t, os.O_PATH) for t in targets}
        hidden = set()
        for t in targets[:-1]:
            parts = t.split("/")
            for i in range(2, len(parts)):
                anc = "/".join(parts[:i])
                if os.stat(anc).st_mode & 0o001 == 0:  # others cannot traverse it
                    if anc not in hidden:
                        mount("tmpfs", anc, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64k")
                        hidden.add(anc)
                    break
        for t, fd in fds.items():
            os.makedirs(t, exist_ok=True)
            mount("/proc/self/fd/%d" % fd, t, None, MS_BIND | MS_REC)
            os.close(fd)
        if hidden:
            done.append("hide_private_dirs")
        if not cfg["readonly_fs"]:
            return
        with open("/proc/self/mountinfo") as f:
            points = [ln.split()[4] for ln in f]
        bad = []
        for p in points:
            p = p.encode().decode("unicode_escape")  # mountinfo escapes spaces as \040
            if p == work:
                continue
            try:
                keep = 0
                fl = os.statvfs(p).f_flag
                for sbit, mbit in KEEP.items():
                    if fl & sbit:
                        keep |= mbit
                mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
            except OSError:
                bad.append(p)
        if bad:
            failed.append("readonly_fs(partial:%s)" % ",".join(bad[:5]))
        else:
            done.append("readonly_fs")

    if root:
        want_ns = cfg["isolate_network"] or cfg["readonly_fs"] or cfg["drop_privileges"]
        flags = (NEWNET if cfg["isolate_network"] else 0) | (NEWNS if want_ns else 0)
        net_tag = "netns"
    else:
        # Unprivileged fallback: a user namespace lets us own network and mount namespaces.
        want_ns = cfg["isolate_network"] or cfg["readonly_fs"]
        flags = NEWUSER | NEWNS | (NEWNET if cfg["isolate_network"] else 0)
        net_tag = "userns+netns"
    if want_ns and libc.unshare(flags) == 0:
        if cfg["isolate_network"]:
            done.append(net_tag)
        try:
            fs_setup()
        except OSError as e:
            failed.append("mountns(%s)" % e)
    elif want_ns:
        failed.append("unshare(%s)" % os.strerror(ctypes.get_errno()))

    def lim(res, soft, hard=None):
        resource.setrlimit(res, (soft, soft if hard is None else hard))

    lim(resource.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1)  # SIGXCPU, then SIGKILL
    lim(resource.RLIMIT_AS, cfg["memory_bytes"])
    lim(resource.RLIMIT_FSIZE, cfg["max_file_bytes"])
    lim(resource.RLIMIT_NOFILE, cfg["max_open_files"])
    lim(resource.RLIMIT_CORE, 0)
    done.append("rlimits")
    if root and cfg["drop_privileges"] and cfg["uid"] is not None:
        try:
            lim(resource.RLIMIT_NPROC, cfg["max_processes"])
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
            done += ["unique_uid", "nproc"]
        except OSError as e:
            failed.append("drop_privileges(%s)" % e)
    if libc.prctl(38, 1, 0, 0, 0) == 0:  # PR_SET_NO_NEW_PRIVS: setuid binaries stay powerless
        done.append("no_new_privs")
    os.chdir(work)
    if cfg["audit_hook"]:
        done.append("audit_hook")
    os.write(cfg["report_fd"], ("\n".join(["+" + d for d in done] + ["-" + f for f in failed])).encode())
    os.close(cfg["report_fd"])
    return libc


def _install_audit_hook(work):
    import os.path as osp
    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    BLOCKED = {"os.system", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn",
               "subprocess.Popen", "pty.spawn", "os.startfile", "sys.remote_exec"}
    PATH_EVENTS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown",
                   "os.link", "os.symlink", "os.truncate", "os.utime", "os.mkfifo", "os.mknod",
                   "shutil.rmtree", "shutil.move", "shutil.copyfile", "shutil.copytree"}
    realpath, join, fsdecode = osp.realpath, osp.join, os.fsdecode

    def inside(p):
        if isinstance(p, int):
            return True  # an fd: it was checked when it was opened
        r = realpath(join(work, fsdecode(p)))
        return r == work or r.startswith(work + "/") or r == "/dev/null"

    mypid = str(os.getpid())

    def other_proc(p):
        # /proc/<other pid>/... (environ, cmdline, fds) of same-uid processes is readable
        # without a unique uid; /proc/self resolves to our own pid and stays allowed.
        if isinstance(p, int):
            return False
        parts = realpath(join(work, fsdecode(p))).split("/")
        return len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[2] != mypid

    def hook(event, args):
        if event.startswith(("socket.", "ctypes.")) or event in BLOCKED:
            raise PermissionError("sandbox: %s is not allowed" % event)
        if event == "import" and args[0] in ("ctypes", "_ctypes", "_posixsubprocess"):
            raise PermissionError("sandbox: importing %s is not allowed" % args[0])
        if event == "open" and args[0] is not None:
            mode, fl = args[1], args[2] or 0
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or fl & WRITE_FLAGS
            if writing and not inside(args[0]):
                raise PermissionError("sandbox: writing outside the work directory")
            if other_proc(args[0]):
                raise PermissionError("sandbox: reading other processes is not allowed")
        elif event in PATH_EVENTS:
            for a in args[:2]:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                    raise PermissionError("sandbox: %s outside the work directory" % event)

    sys.addaudithook(hook)


def _main():
    import json, traceback
    cfg = json.loads(sys.argv[1])
    try:
        libc = _setup(cfg)
        with open(cfg["workdir"] + "/main.py") as f:
            code = compile(f.read(), "main.py", "exec")
        del libc
        for m in ("ctypes", "ctypes._endian", "_ctypes", "json", "json.decoder", "json.scanner",
                  "json.encoder", "resource"):
            sys.modules.pop(m, None)
        if cfg["audit_hook"]:
            _install_audit_hook(cfg["workdir"])
    except SyntaxError:
        traceback.print_exc(limit=0)
        sys.exit(1)
    except BaseException:
        traceback.print_exc()
        sys.stderr.write("sandbox setup failed\n")
        sys.exit(70)
    sys.argv = ["main.py"]
    g = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "main.py"}
    try:
        exec(code, g)
    except SystemExit:
        raise
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # hide this frame
        sys.exit(1)

_main()
"""

_warned: set[str] = set()
_warn_lock = threading.Lock()


def _expose_paths(python: str) -> list[str]:
    """Interpreter trees the unprivileged child must be able to read (stdlib lives here)."""
    if python == sys.executable:
        return sorted({sys.base_prefix, sys.base_exec_prefix})
    return [os.path.dirname(os.path.dirname(os.path.realpath(python)))]


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
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            os.kill(int(entry), signal.SIGKILL)
                        break
        except (OSError, ValueError):
            continue


def _warn_missing(limits: SandboxLimits, mechanisms: tuple[str, ...], failures: list[str]) -> None:
    missing = []
    if limits.isolate_network and not {"netns", "userns+netns"} & set(mechanisms):
        missing.append("network isolation (audit hook only)")
    if limits.drop_privileges and os.geteuid() == 0 and "unique_uid" not in mechanisms:
        missing.append("privilege drop / RLIMIT_NPROC")
    if limits.readonly_fs and os.geteuid() == 0 and "readonly_fs" not in mechanisms:
        missing.append("read-only filesystem")
    key = ";".join(missing + failures)
    if not key:
        return
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning("sandbox degraded: missing %s; failures: %s", missing, failures)


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


async def run_python_async(code: str, *, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` as a script in the sandbox without blocking the event loop."""
    t0 = time.monotonic()
    python = limits.python or sys.executable
    is_root = os.geteuid() == 0
    uid = _fresh_uid() if is_root and limits.drop_privileges else None
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="tunix-sandbox-"))
    report_r, report_w = os.pipe()
    proc: asyncio.subprocess.Process | None = None
    timed_out = output_exceeded = False
    out = {"stdout": bytearray(), "stderr": bytearray()}
    try:
        with open(os.path.join(workdir, _MAIN), "w") as f:
            f.write(code)
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(os.path.join(workdir, _MAIN), uid, uid)
        cfg = {
            "workdir": workdir,
            "uid": uid,
            "expose": _expose_paths(python),
            "report_fd": report_w,
            "cpu_s": max(1, int(limits.cpu_s)),
            "memory_bytes": limits.memory_bytes,
            "max_file_bytes": limits.max_file_bytes,
            "max_open_files": limits.max_open_files,
            "max_processes": limits.max_processes,
            "isolate_network": limits.isolate_network,
            "readonly_fs": limits.readonly_fs,
            "drop_privileges": limits.drop_privileges,
            "audit_hook": limits.audit_hook,
        }
        # No inherited variables: secrets in the parent's environment stay there.
        env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": workdir}
        try:
            proc = await asyncio.create_subprocess_exec(
                python, "-I", "-S", "-B", "-c", _BOOTSTRAP, json.dumps(cfg),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                cwd=workdir,
                start_new_session=True,  # own process group: one killpg ends it all
                pass_fds=(report_w,),
            )  # fmt: skip
        except OSError as e:
            return SandboxResult("", f"sandbox: cannot start {python}: {e}", None, "killed",
                                 time.monotonic() - t0)  # fmt: skip
        finally:
            os.close(report_w)
            report_w = -1
        total = 0

        async def pump(stream: asyncio.StreamReader, buf: bytearray) -> None:
            nonlocal total, output_exceeded
            while chunk := await stream.read(4096):
                room = limits.max_output_bytes - total
                buf += chunk[: max(0, room)]
                total += len(chunk)
                if total > limits.max_output_bytes:
                    output_exceeded = True
                    _kill_group(proc.pid)
                    return

        assert proc.stdout is not None and proc.stderr is not None
        pumps = asyncio.gather(pump(proc.stdout, out["stdout"]), pump(proc.stderr, out["stderr"]))
        try:
            await asyncio.wait_for(asyncio.shield(pumps), timeout=limits.wall_s)
            await asyncio.wait_for(
                proc.wait(), timeout=max(0.1, limits.wall_s - (time.monotonic() - t0))
            )
        except TimeoutError:
            timed_out = not output_exceeded
        _kill_group(proc.pid)
        if uid is not None:
            _kill_uid(uid)
        await proc.wait()
        # A process that escaped the group could hold the pipes open: do not wait for it.
        try:
            await asyncio.wait_for(pumps, timeout=0.5)
        except TimeoutError:
            pumps.cancel()
        exit_code = proc.returncode
        os.set_blocking(report_r, False)
        try:
            report = os.read(report_r, 65536).decode(errors="replace")
        except BlockingIOError:
            report = ""
    finally:  # also on cancellation: never leave a child, a directory or an fd behind
        if proc is not None and proc.returncode is None:
            _kill_group(proc.pid)
        for fd in (report_r, report_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
    mechanisms = tuple(ln[1:] for ln in report.splitlines() if ln.startswith("+"))
    failures = [ln[1:] for ln in report.splitlines() if ln.startswith("-")]
    stdout = out["stdout"].decode(errors="replace")
    stderr = out["stderr"].decode(errors="replace")
    if exit_code == _SETUP_FAILED and "sandbox setup failed" in stderr:
        logger.error("sandbox bootstrap failed: %s", stderr[-1000:])
    _warn_missing(limits, mechanisms, failures)
    status = _classify(exit_code, stderr, timed_out, output_exceeded)
    return SandboxResult(stdout, stderr, exit_code, status, time.monotonic() - t0, mechanisms)


def run_python(code: str, *, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Blocking variant of :func:`run_python_async`. Called from a thread that is running an
    event loop it still works (in a helper thread) but blocks that loop: use the async one."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_python_async(code, limits=limits))
    # Called from a running loop's thread: run our own loop in a helper thread.
    box: list[SandboxResult] = []
    t = threading.Thread(
        target=lambda: box.append(asyncio.run(run_python_async(code, limits=limits)))
    )
    t.start()
    t.join()
    return box[0]

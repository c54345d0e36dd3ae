"""Sandbox for untrusted, model-written Python: owns process isolation and resource limits.

Every run gets a fresh interpreter (``python -I -S -B``, stdlib only, empty environment)
inside bubblewrap (``bwrap``, see :mod:`.bwrap`): new user, pid, network, mount, ipc and
uts namespaces, an empty read-only root holding only the interpreter, its stdlib and
shared libraries, the pid namespace's own ``/proc`` and a size-limited tmpfs work
directory. Nothing outlives the run (the pid namespace dies with it), no host process is
visible or signalable, nothing is reachable over the network, and no host file outside
the interpreter is visible. As root, bubblewrap runs under a fresh unprivileged uid.
A bootstrap (:mod:`.child`) then applies ``RLIMIT_CPU``, ``RLIMIT_AS``,
``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_NPROC``, ``RLIMIT_CORE`` and
``PR_SET_NO_NEW_PRIVS``, and an audit hook as a last, never relied-upon layer. The parent
enforces the wall-clock and output limits by killing the run.

Without a working bubblewrap, ``mode="auto"`` falls back (as root with ``CAP_SYS_ADMIN``
only) to in-child kernel namespaces: no network, read-only mounts, a fresh uid with
``RLIMIT_NPROC``, a ``hidepid`` /proc, and a seccomp filter refusing Unix sockets (host
ones would be reachable) and new namespaces; world-readable host files stay readable there.
With neither, :class:`SandboxUnavailable` is raised unless the caller opted in with
``mode="unsafe-audit-only"``. Guarantees and requirements: docs/sandbox.md.

    result = run_python("print(3+4)")
    result.status, result.stdout        # ("ok", "7\\n")
    result = await run_python_async("while True: pass")
    result.status                       # "timeout"

Bad user code never raises: it is reported through ``status``.

limits.py   ``SandboxLimits``: the resource limits and the isolation mode asked for
runner.py   choosing (and refusing) the isolation, running one script, its result
bwrap.py    the bubblewrap command line and the runtime it mounts
child.py    the bootstrap inside the sandbox: rlimits, no-new-privs, the fallback's
            namespaces and seccomp filter, audit hook
"""

from tunix_tasks.envs.sandbox.limits import (
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
)
from tunix_tasks.envs.sandbox.runner import check_isolation, run_python, run_python_async

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "check_isolation",
    "run_python",
    "run_python_async",
]

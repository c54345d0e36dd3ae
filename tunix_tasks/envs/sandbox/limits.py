"""The sandbox's value types: per-run limits, results, and the refusal error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tunix_tasks.env_kwargs import SANDBOX_MODES, SandboxMode

Status = Literal["ok", "error", "timeout", "memory", "output_limit", "killed"]
Mode = SandboxMode  # defined where the config can check `env.kwargs.sandbox` without the sandbox
MODES: tuple[str, ...] = SANDBOX_MODES

INSTALL_HINT = (
    "Install bubblewrap (Debian/Ubuntu: `apt-get install -y bubblewrap`, Fedora: "
    "`dnf install bubblewrap`; `make venv` does it when run as root) and allow unprivileged "
    "user namespaces (Docker's default seccomp profile forbids them: run the actor with "
    "`--security-opt seccomp=unconfined` or a profile that allows clone/unshare of user "
    "namespaces). To run model code without real isolation anyway, opt in explicitly with "
    "`env.kwargs.sandbox: unsafe-audit-only` (the audit hook is not a security boundary). "
    "See docs/sandbox.md."
)


class SandboxUnavailable(RuntimeError):
    """No real isolation is available and the configuration did not opt out of it."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits and the isolation mode.

    ``mode``: ``"auto"`` uses bubblewrap when it works, else (as root with
    ``CAP_SYS_ADMIN``) the in-child kernel namespaces, else refuses; ``"bwrap"`` accepts
    bubblewrap only; ``"unsafe-audit-only"`` is ``"auto"`` that, instead of refusing, runs
    whatever layers apply, even none but the audit hook. ``isolate_network``, ``readonly_fs`` and ``drop_privileges`` shape the
    namespace fallback; under bubblewrap the filesystem is always private and read-only
    and, as root, the run always gets a fresh uid."""

    wall_s: float = 5.0
    cpu_s: int = 2
    memory_bytes: int = 256 * 1024 * 1024  # RLIMIT_AS (virtual address space)
    max_output_bytes: int = 64 * 1024  # stdout + stderr together; the run is killed past it
    max_file_bytes: int = 1024 * 1024  # RLIMIT_FSIZE
    max_open_files: int = 64
    max_processes: int = 1  # RLIMIT_NPROC for the sandbox's uid: 1 = no fork, no threads
    work_bytes: int = 16 * 1024 * 1024  # size of the work directory's tmpfs (bubblewrap)
    isolate_network: bool = True
    readonly_fs: bool = True
    drop_privileges: bool = True
    audit_hook: bool = True  # extra layer only: never relied upon
    python: str | None = None  # interpreter; defaults to sys.executable
    mode: Mode = "auto"
    bwrap: str | None = None  # bubblewrap binary; None: `bwrap` on PATH


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal; None: never started
    status: Status
    wall_s: float
    mechanisms: tuple[str, ...] = ()  # isolation layers actually applied to the run

"""Bubblewrap command lines: what the sandbox sees of the host, and nothing more.

The sandboxed interpreter runs in new user, pid, network, mount, ipc, uts and cgroup
namespaces (``--unshare-all``) on an empty, read-only root that holds only:

* the interpreter, its shared library and its standard library (read-only; the
  stdlib's ``site-packages`` is hidden under an empty tmpfs) and the system's shared
  library directory (read-only);
* ``/proc`` of the new pid namespace (the run's own processes only) and a minimal,
  read-only ``/dev``;
* ``/work``: a tmpfs of ``work_bytes`` holding ``main.py``, the only writable place.

When the actor runs as root, bubblewrap itself is started under a fresh unprivileged uid,
so it may only open what "others" may open. An interpreter under a private directory
(pyenv in ``/root``) is then staged once per process: its files are hard-linked (copied
across filesystems) into a world-readable temporary directory and mounted back at their
original paths inside the sandbox.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass

WORK = "/work"
_PROBE = r"""
import json, os, sys, sysconfig
v = sysconfig.get_config_var
lib = None
if v("Py_ENABLE_SHARED") and v("INSTSONAME") and v("LIBDIR"):
    lib = os.path.join(v("LIBDIR"), v("INSTSONAME"))
print(json.dumps({
    "exe": sys.executable, "stdlib": sysconfig.get_path("stdlib"),
    "dynload": v("DESTSHARED"), "libpython": lib, "multiarch": v("MULTIARCH"),
    "venv_cfg": os.path.join(sys.prefix, "pyvenv.cfg") if sys.prefix != sys.base_prefix else None,
}))
"""
_STAGE = "tunix-sandbox-python-"
# Never staged: big and useless to a short script (site-packages is hidden anyway).
_SKIP = set(
    [
        "site-packages",
        "dist-packages",
        "test",
        "idlelib",
        "tkinter",
        "turtledemo",
        "ensurepip",
        "lib2to3",
    ]
)


@dataclass(frozen=True)
class Runtime:
    """What the sandbox mounts to run ``exe``: read-only binds and symlinks."""

    exe: str
    binds: tuple[tuple[str, str], ...]  # (host source, sandbox path)
    symlinks: tuple[tuple[str, str], ...]  # (link target, sandbox path)
    hidden: tuple[str, ...]  # sandbox directories covered by an empty tmpfs


def find_bwrap(path: str | None) -> str | None:
    found = path or shutil.which("bwrap") or "/usr/bin/bwrap"
    return found if os.path.isfile(found) and os.access(found, os.X_OK) else None


@functools.lru_cache(maxsize=4)
def features(path: str) -> frozenset[str]:
    """Options this bubblewrap knows: ``--size`` (0.7) is required, ``--disable-userns``
    (0.8) is used when present."""
    out = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10)
    return frozenset(f for f in ("--size", "--disable-userns") if f in out.stdout + out.stderr)


def _public(path: str) -> bool:
    """Whether a user with no relation to the file's owner can open ``path``."""
    parts = os.path.abspath(path).split("/")
    for i in range(2, len(parts)):
        if not os.stat("/".join(parts[:i])).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(path).st_mode
    return bool(mode & stat.S_IROTH) and (not stat.S_ISDIR(mode) or bool(mode & stat.S_IXOTH))


def _nest(paths: list[str]) -> list[str]:
    """Drop paths inside another one of ``paths`` (a bind inside a read-only bind fails)."""
    out: list[str] = []
    for p in sorted(set(paths)):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


def _lib_dirs(multiarch: str | None) -> tuple[list[str], list[tuple[str, str]]]:
    """System library directories (dynamic loader, libc, ...): binds and symlinks."""
    binds, links = [], []
    for d in ("/lib64", "/usr/lib64", "/lib", "/usr/lib", "/lib32", "/usr/lib32"):
        if os.path.islink(d):
            links.append((os.readlink(d), d))
        elif os.path.isdir(d):
            sub = os.path.join(d, multiarch) if multiarch else ""
            binds.append(sub if sub and os.path.isdir(sub) else d)
    return binds, links


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _stage(paths: list[str]) -> str:
    """World-readable mirror of ``paths`` (absolute) under a fresh temporary directory."""
    bases = (tempfile.gettempdir(), "/var/tmp", "/tmp")
    base = next((b for b in bases if os.path.isdir(b) and _public(b)), None)
    if base is None:
        raise ValueError("no world-readable temporary directory to stage the interpreter in")
    for name in os.listdir(base):  # stages of processes that died without cleaning up
        pid, path = name.removeprefix(_STAGE).split("-")[0], os.path.join(base, name)
        dead = name.startswith(_STAGE) and pid.isdigit() and not os.path.exists(f"/proc/{pid}")
        if dead and os.stat(path).st_uid == os.geteuid():
            shutil.rmtree(path, ignore_errors=True)
    owner = os.getpid()  # a forked child exiting must not delete its parent's stage
    root = tempfile.mkdtemp(prefix=f"{_STAGE}{owner}-", dir=base)
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(root, ignore_errors=True))
    for p in paths:
        dst = root + p
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.isdir(p):
            ignore = shutil.ignore_patterns(*_SKIP, "config-*")
            shutil.copytree(p, dst, symlinks=True, ignore=ignore, copy_function=_link_or_copy)
        else:
            _link_or_copy(p, dst)
    for dirpath, _, _ in os.walk(root):
        os.chmod(dirpath, 0o755)
    return root


@functools.lru_cache(maxsize=8)
def runtime(python: str, public_only: bool) -> Runtime:
    """Mounts for ``python``; with ``public_only`` (bubblewrap runs under another uid)
    files others cannot reach are staged. Raises OSError or ValueError."""
    exe = os.path.realpath(python)  # a symlinked venv interpreter: its base install
    out = subprocess.run(
        [exe, "-I", "-S", "-B", "-c", _PROBE],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin"},
        cwd="/",
    )
    if out.returncode != 0:
        raise ValueError(f"cannot inspect {exe}: {out.stderr.strip()[-300:]}")
    info = json.loads(out.stdout)
    stdlib = info["stdlib"]
    paths = [exe, stdlib]
    for extra in (info["dynload"], info["libpython"], info["venv_cfg"]):
        if extra and os.path.exists(extra):
            paths.append(os.path.realpath(extra) if extra == info["libpython"] else extra)
    libs, links = _lib_dirs(info["multiarch"])
    mine = _nest(paths)
    hidden = tuple(
        os.path.join(stdlib, d)
        for d in ("site-packages", "dist-packages")
        if os.path.isdir(os.path.join(stdlib, d))
    )
    if public_only and not all(_public(p) for p in mine):
        root = _stage(mine)
        binds = [(root + p, p) for p in mine]
        hidden = ()  # not staged at all
    else:
        binds = [(p, p) for p in mine if not any(p.startswith(d + "/") for d in libs)]
    binds += [(d, d) for d in _nest(libs) if not any(d.startswith(m + "/") for m in mine)]
    return Runtime(exe, tuple(binds), tuple(links), hidden)


def argv(bwrap: str, rt: Runtime, *, code_fd: int, work_bytes: int, share_net: bool) -> list[str]:
    """The bubblewrap command line up to (and including) the interpreter."""
    args = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"]
    args += ["--hostname", "sandbox", "--cap-drop", "ALL", "--clearenv"]
    for name, value in (
        ("PATH", "/usr/bin:/bin"),
        ("LC_ALL", "C.UTF-8"),
        ("HOME", WORK),
        ("TMPDIR", WORK),
    ):
        args += ["--setenv", name, value]
    if share_net:
        args.append("--share-net")
    if "--disable-userns" in features(bwrap):  # no nested namespaces: less kernel surface
        args.append("--disable-userns")
    for target, link in rt.symlinks:
        args += ["--symlink", target, link]
    for src, dst in rt.binds:
        args += ["--ro-bind", src, dst]
    for d in rt.hidden:
        args += ["--size", "4096", "--tmpfs", d, "--remount-ro", d]
    args += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    args += ["--size", str(work_bytes), "--tmpfs", WORK]
    args += ["--file", str(code_fd), f"{WORK}/main.py", "--remount-ro", "/", "--chdir", WORK]
    return [*args, rt.exe]

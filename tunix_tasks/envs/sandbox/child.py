"""The sandbox's child side: runs first inside the sandboxed interpreter, then the user's code.

`runner.py` starts `python -I -S -B -c <this file's source> <json config>` (inside
bubblewrap, or directly for the namespace fallback); this code applies the in-child layers
(for the fallback: namespaces, read-only mounts, a private /proc, a fresh uid, a seccomp
filter; always: rlimits, no_new_privs, the optional audit hook), reports which ones took effect on the
report pipe, and executes `main.py`. It imports only the standard library: the child sees
nothing else. Never imported.
"""

import os
import sys


def _setup(cfg):
    import ctypes
    import resource

    done, failed = [], []
    libc = ctypes.CDLL(None, use_errno=True)
    work = cfg["workdir"]
    root = os.geteuid() == 0

    def _err(what):
        e = ctypes.get_errno()
        return OSError(e, os.strerror(e), what)

    def mount(src, tgt, fstype, flags, data=None):
        def enc(s):
            return s.encode() if s is not None else None

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
            mount(f"/proc/self/fd/{fd}", t, None, MS_BIND | MS_REC)
            os.close(fd)
        if hidden:
            done.append("hide_private_dirs")
        if root:  # a /proc showing only processes of the viewer's (fresh) uid
            try:
                mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
                done.append("hidepid")
            except OSError as e:
                failed.append(f"hidepid({e})")
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
            failed.append("readonly_fs(partial:{})".format(",".join(bad[:5])))
        else:
            done.append("readonly_fs")

    if not cfg["kernel_ns"]:
        want_ns = False  # bubblewrap already did it, better
    elif root:
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
            failed.append(f"mountns({e})")
    elif want_ns:
        failed.append(f"unshare({os.strerror(ctypes.get_errno())})")

    def lim(res, soft, hard=None):
        resource.setrlimit(res, (soft, soft if hard is None else hard))

    lim(resource.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1)  # SIGXCPU, then SIGKILL
    lim(resource.RLIMIT_AS, cfg["memory_bytes"])
    lim(resource.RLIMIT_FSIZE, cfg["max_file_bytes"])
    lim(resource.RLIMIT_NOFILE, cfg["max_open_files"])
    lim(resource.RLIMIT_CORE, 0)
    done.append("rlimits")
    if cfg["uid"] is not None:
        try:
            lim(resource.RLIMIT_NPROC, cfg["nproc"])
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
            done += ["unique_uid", "nproc"]
        except OSError as e:
            failed.append(f"drop_privileges({e})")
    elif cfg["nproc"] is not None:  # bubblewrap: counted per user namespace, non-root uid
        lim(resource.RLIMIT_NPROC, cfg["nproc"])
        done.append("nproc")
    if libc.prctl(38, 1, 0, 0, 0) == 0:  # PR_SET_NO_NEW_PRIVS: setuid binaries stay powerless
        done.append("no_new_privs")
    if cfg["kernel_ns"]:  # bubblewrap hides host sockets and forbids user namespaces itself
        try:
            _seccomp(libc, ctypes)
            done.append("seccomp")
        except OSError as e:
            failed.append(f"seccomp({e})")
    os.chdir(work)
    if cfg["audit_hook"]:
        done.append("audit_hook")
    os.write(
        cfg["report_fd"], ("\n".join(["+" + d for d in done] + ["-" + f for f in failed])).encode()
    )
    os.close(cfg["report_fd"])
    return libc


def _seccomp(libc, ctypes):
    """Without bubblewrap: no Unix sockets (a host socket on any mount could be reached),
    no new namespaces (a nested user namespace gives back mount, chroot, ...), no
    io_uring (it can open sockets past this filter). Other syscalls are allowed."""
    import errno

    # AUDIT_ARCH_*, then: socket, clone, unshare, setns, chroot, mount, umount2, pivot_root
    table = {
        "x86_64": (0xC000003E, 41, 56, 272, 308, 161, 165, 166, 155),
        "aarch64": (0xC00000B7, 198, 220, 97, 268, 51, 40, 39, 41),
    }
    machine = os.uname().machine
    if machine not in table:
        raise OSError(errno.ENOSYS, "no seccomp filter for this architecture", machine)
    arch, socket_nr, clone_nr, *deny = table[machine]
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|..|K, RET|K
    ALLOW, KILL, ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
    AF_UNIX, CLONE_NS = 1, 0x7E020000  # every CLONE_NEW* flag
    deny += [425, 428, 429, 430, 431, 432, 433, 442]  # io_uring_setup, the new mount API
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, KILL), (LD, 0, 0, 0)]
    if arch == 0xC000003E:  # x32 system calls: the same arch, nr | 0x40000000
        prog += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, ERRNO | errno.EPERM)]
    for nr in deny:
        prog += [(JEQ, 0, 1, nr), (RET, 0, 0, ERRNO | errno.EPERM)]
    prog += [(JEQ, 0, 1, 435), (RET, 0, 0, ERRNO | errno.ENOSYS)]  # clone3: libc uses clone
    # On the first argument (its low 32 bits, offset 16): each block returns.
    for nr, test, k, err in (
        (socket_nr, JEQ, AF_UNIX, errno.EACCES),
        (clone_nr, JSET, CLONE_NS, errno.EPERM),
    ):
        prog += [(JEQ, 0, 4, nr), (LD, 0, 0, 16), (test, 0, 1, k), (RET, 0, 0, ERRNO | err)]
        prog += [(RET, 0, 0, ALLOW)]
    prog.append((RET, 0, 0, ALLOW))

    class Insn(ctypes.Structure):
        _fields_ = [
            ("code", ctypes.c_ushort),
            ("jt", ctypes.c_ubyte),
            ("jf", ctypes.c_ubyte),
            ("k", ctypes.c_uint),
        ]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]

    insns = (Insn * len(prog))(*(Insn(*i) for i in prog))
    fprog = Prog(len(prog), insns)
    # PR_SET_SECCOMP, SECCOMP_MODE_FILTER (needs no_new_privs, set just before)
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), "prctl(PR_SET_SECCOMP)")


def _install_audit_hook(work):
    import os.path as osp

    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    BLOCKED = {
        "os.system",
        "os.fork",
        "os.forkpty",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "subprocess.Popen",
        "pty.spawn",
        "os.startfile",
        "sys.remote_exec",
    }
    PATH_EVENTS = {
        "os.remove",
        "os.rename",
        "os.mkdir",
        "os.rmdir",
        "os.chmod",
        "os.chown",
        "os.link",
        "os.symlink",
        "os.truncate",
        "os.utime",
        "os.mkfifo",
        "os.mknod",
        "shutil.rmtree",
        "shutil.move",
        "shutil.copyfile",
        "shutil.copytree",
    }
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
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in ("ctypes", "_ctypes", "_posixsubprocess"):
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
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
                    raise PermissionError(f"sandbox: {event} outside the work directory")

    sys.addaudithook(hook)


def _main():
    import json
    import traceback

    cfg = json.loads(sys.argv[1])
    try:
        libc = _setup(cfg)
        with open(cfg["workdir"] + "/main.py") as f:
            code = compile(f.read(), "main.py", "exec")
        del libc
        for m in (
            "ctypes",
            "ctypes._endian",
            "_ctypes",
            "json",
            "json.decoder",
            "json.scanner",
            "json.encoder",
            "resource",
        ):
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


if __name__ == "__main__":
    _main()

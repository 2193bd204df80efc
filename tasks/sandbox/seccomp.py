"""The kernel boundary: the seccomp filter bwrap loads for every run.

Built with libseccomp, it refuses keyrings (but joining a fresh session keyring), io_uring,
userfaultfd, perf_event_open, bpf, fanotify, mount and friends, ptrace and cross-process memory
access, namespace creation (unshare, setns, clone with namespace flags; clone3 reports ENOSYS so
libc falls back to clone), setsid (one session, so one scheduling autogroup, per run), signals to pid 1, every socket
family but Unix (and growing a socket's buffers), the page cache's probes and evictions (fadvise,
readahead, mincore, cachestat, RWF_NOWAIT, madvise COLD/PAGEOUT), O_DIRECT and every I/O class but
idle; flushes (sync, syncfs, fsync, ...) return 0 without running; syscalls of other ABIs (i386,
x32) kill the process. With no_new_privs the program has no capabilities (as root, pid 1 keeps
CAP_SETUID/CAP_SETGID to give the program its uid).
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile


# Refused outright (EPERM): kernel surface that no program here needs, or that reaches past the
# namespaces (keys live in none; a new user namespace would hand out capabilities inside it).
_REFUSED = (
    "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "perf_event_open",
    "bpf", "fanotify_init", "fanotify_mark",
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "unshare", "setns", "setsid",
    "name_to_handle_at", "open_by_handle_at", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct", "quotactl",
    "quotactl_fd", "syslog", "lookup_dcookie", "uselib", "vhangup",
)
_CLONE_NAMESPACES = (  # CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
    0x80, 0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
)
AF_UNIX = 1  # the only socket family allowed: stdlib multiprocessing's pipes and socketpair()
SOL_SOCKET, SO_SNDBUF, SO_RCVBUF = 1, 7, 8
KEYCTL_JOIN_SESSION_KEYRING = 1
# The page cache is the host's: evicting pages of the bound files (fadvise, madvise PAGEOUT/COLD)
# or reading which are resident (mincore, cachestat, RWF_NOWAIT below) is a channel between runs.
_PAGE_CACHE = ("fadvise64", "fadvise64_64", "readahead", "mincore", "cachestat")
MADV_COLD, MADV_PAGEOUT = 20, 21
RWF_NOWAIT = 0x8
# Flushes reach the host's file systems and device caches from any descriptor (syncfs on a bound
# file syncs the whole host file system): answered 0 without running. Everything a run can write
# is tmpfs, which has nothing to flush, so no program can tell.
_FLUSHES = ("sync", "syncfs", "fsync", "fdatasync", "sync_file_range")
MS_SYNC = 4
IOPRIO_CLASS_IDLE = 3
IOPRIO_CLASS_SHIFT = 13
F_SETFL = 4
INT = 0xFFFFFFFF  # the kernel reads int arguments from the low 32 bits of the register


@functools.cache
def _seccomp() -> tuple[bytes, int, int]:
    """The BPF program bwrap loads, and the numbers of keyctl and ioprio_set (the child joins a
    keyring and takes the idle I/O class with them)."""
    import pyseccomp as sc  # loads libseccomp: only when a program runs

    arch = sc.system_arch()
    filt = sc.SyscallFilter(sc.ALLOW)
    filt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)  # i386 or x32 syscalls on x86_64, ...

    def refuse(name: str, *args: sc.Arg, err: int = errno.EPERM) -> None:
        if sc.resolve_syscall(arch, name) >= 0:  # names this libseccomp knows on this arch
            filt.add_rule(sc.ERRNO(err), name, *args)

    for name in _REFUSED:
        refuse(name)
    # keyctl only as KEYCTL_JOIN_SESSION_KEYRING with no name: a fresh, anonymous keyring
    refuse("keyctl", sc.Arg(0, sc.NE, KEYCTL_JOIN_SESSION_KEYRING))
    refuse("keyctl", sc.Arg(1, sc.NE, 0))
    for flag in _CLONE_NAMESPACES:
        refuse("clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    refuse("clone3", err=errno.ENOSYS)  # its flags sit in memory, out of the filter's reach
    # Sockets: Unix only. A run's TCP buffers on its own loopback are kernel memory its v1 memory
    # cgroup does not charge; a computing program needs no network. (Any value but exactly 1 is
    # refused, so upper bits of the register cannot smuggle a family past the filter.)
    for name in ("socket", "socketpair"):
        refuse(name, sc.Arg(0, sc.NE, AF_UNIX), err=errno.EAFNOSUPPORT)
    # Unix socket buffers stay at the system's default size (net.core.wmem_default): up to
    # net.core.wmem_max each (4 MiB on some hosts), 64 descriptors queued about 460 MiB; at the
    # default, about 13 MiB. The memory cgroup charges them; this bounds them without one.
    for option in (SO_SNDBUF, SO_RCVBUF):
        refuse("setsockopt", sc.Arg(1, sc.MASKED_EQ, INT, SOL_SOCKET), sc.Arg(2, sc.MASKED_EQ, INT, option))
    for name in _PAGE_CACHE:
        refuse(name)
    for advice in (MADV_COLD, MADV_PAGEOUT):
        refuse("madvise", sc.Arg(2, sc.MASKED_EQ, INT, advice))
    for name in ("preadv2", "pwritev2"):  # flags: argument 5 (pos is passed as two halves)
        refuse(name, sc.Arg(5, sc.MASKED_EQ, RWF_NOWAIT, RWF_NOWAIT))
    # Disk bandwidth: the run's I/O stays in the idle class (pid 1 sets it; no other class may be
    # set), no O_DIRECT (reads past the page cache, straight from the disk), no flushes.
    for cls in range(IOPRIO_CLASS_IDLE):  # NONE (follow the nice value), RT, BE
        refuse("ioprio_set", sc.Arg(2, sc.MASKED_EQ, 7 << IOPRIO_CLASS_SHIFT, cls << IOPRIO_CLASS_SHIFT))
    refuse("open", sc.Arg(1, sc.MASKED_EQ, os.O_DIRECT, os.O_DIRECT))
    refuse("openat", sc.Arg(2, sc.MASKED_EQ, os.O_DIRECT, os.O_DIRECT))
    refuse("fcntl", sc.Arg(1, sc.MASKED_EQ, INT, F_SETFL), sc.Arg(2, sc.MASKED_EQ, os.O_DIRECT, os.O_DIRECT))
    refuse("openat2", err=errno.ENOSYS)  # its flags sit in memory; libc's open() uses openat
    # No signal reaches pid 1, the run's reaper (kill(-1) already spares it): as root the program's own
    # uid makes kill(1) EPERM; without root both share a uid, and pid 1 of a PID namespace ignores
    # SIGKILL from inside, so the same call would answer 0. EPERM in both modes, whatever the call.
    for name in ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open"):
        refuse(name, sc.Arg(0, sc.MASKED_EQ, INT, 1))
    refuse("pidfd_send_signal")  # its target is a descriptor (open("/proc/1") gives one), out of the filter's reach
    for name in _FLUSHES:
        refuse(name, err=0)
    refuse("msync", sc.Arg(2, sc.MASKED_EQ, MS_SYNC, MS_SYNC), err=0)
    with tempfile.TemporaryFile() as out:
        filt.export_bpf(out)
        out.seek(0)
        return out.read(), sc.resolve_syscall(arch, "keyctl"), sc.resolve_syscall(arch, "ioprio_set")

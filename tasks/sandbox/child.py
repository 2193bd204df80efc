"""The trusted bootstrap of one sandboxed run (see `blockgen.tasks.sandbox`).

bwrap execs it as `python -I -S -B -X utf8 -c <this file> <args>` with the program on stdin, as
pid 1 of the run's PID namespace, inside the minimal root and under the seccomp filter. It forks
the program's process, which lowers its rlimits, drops to the run's uid (evaluator as root), joins
a fresh session keyring and then runs the program and calls its entry point; pid 1 stays behind,
reaps, reports how the program's process ended and exits, and with it the whole namespace.

Records go to the result pipe as lines, each one JSON array of strings in ASCII (a leading newline
too, so bytes a program left on the pipe cannot merge into a record). The evaluator never imports
this module; it passes its text. Kept small: interpreter start-up is most of a run's cost.
"""

import os
import sys

from _json import encode_basestring_ascii as _quote

MAX_INT_BITS = 4096  # larger integers come back as +-inf: str() of them raises
NAME_LIMIT = 200
KEYCTL_JOIN_SESSION_KEYRING = 1
IOPRIO_WHO_PROCESS = 1
IOPRIO_IDLE = 3 << 13  # IOPRIO_CLASS_IDLE: disk time only when no one else wants it
PR_SET_DUMPABLE = 4


def say(fd, write, *fields):
    write(fd, ("\n[" + ",".join([_quote(f) for f in fields]) + "]\n").encode("ascii"))


def typename(obj):
    # type.__name__ read through `type` itself: a metaclass cannot make it lie or raise
    return type.__dict__["__name__"].__get__(type(obj))[:NAME_LIMIT]


def libc(name="syscall"):
    # A libc function through _ctypes directly: importing the ctypes package costs more than a
    # tenth of a whole run. None where that fails (the keyring then stays the inherited one).
    try:
        import _ctypes

        class Int(_ctypes._SimpleCData):
            _type_ = "l"

        class Fn(_ctypes.CFuncPtr):
            _flags_ = _ctypes.FUNCFLAG_CDECL
            _restype_ = Int

        class Libc:
            _handle = _ctypes.dlopen(None, 0)

        return Fn((name, Libc))
    except Exception:
        return None


def drop_privileges(uid, gid):
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise OSError("uid/gid did not change")


def lower_priorities(call, ioprio_set, nice):
    """In pid 1, before the program's process exists (it inherits all of it): first in line for
    the OOM killer, the idle I/O class (the filter refuses every other), a nice value of at least
    `nice`, and no way back up (RLIMIT_RTPRIO, RLIMIT_NICE 0). What held comes back confirmed."""
    import resource as R

    try:  # the evaluator has set it already where it may (as root: also the floor)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    idle = call is not None and call(ioprio_set, IOPRIO_WHO_PROCESS, 0, IOPRIO_IDLE) == 0
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) < nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        pass
    R.setrlimit(R.RLIMIT_RTPRIO, (0, 0))
    R.setrlimit(R.RLIMIT_NICE, (0, 0))
    return idle


def confirmed(uid, keyring, idle):
    """What this process can see is in force (the evaluator adds what bwrap and cgroups give)."""
    import resource as R

    iso = ["rlimits"]
    if uid >= 0:
        iso.append("uid=%d" % uid)
    if keyring:
        iso.append("session-keyring")
    with open("/proc/self/oom_score_adj") as f:
        iso.append("oom_score_adj=%d" % int(f.read()))
    if idle:
        iso.append("ioprio=idle")
    if R.getrlimit(R.RLIMIT_RTPRIO) == (0, 0):
        iso.append("rtprio=0")
    iso.append("nice>=%d" % os.getpriority(os.PRIO_PROCESS, 0))
    with open("/proc/self/status") as f:
        status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    if status.get("Seccomp") == "2":
        iso.append("seccomp")
    if status.get("NoNewPrivs") == "1":
        iso.append("no_new_privs")
    if int(status.get("CapEff", "1"), 16) == 0:
        iso.append("no-capabilities")
    return iso


def serialise(value):
    # By exact type, through int's and float's own methods: a subclass may override any of
    # its methods (bit_length, __repr__, __format__, ...) to lie about what it holds.
    if type(value) is bool:
        return ("nan", "bool")
    if isinstance(value, int):
        value = int.__int__(value)  # the stored integer, whatever the subclass says
        if int.bit_length(value) <= MAX_INT_BITS:
            return ("ok", "i", int.__format__(value, "x"))
        return ("ok", "f", "inf" if value > 0 else "-inf")  # no answer; too large to print
    if isinstance(value, float):
        return ("ok", "f", float.__repr__(float.__float__(value)))
    if not isinstance(value, (str, bytes, complex)) and hasattr(type(value), "__float__"):
        number = float(value)  # Decimal, Fraction: their own conversion, run here in the child
        return ("ok", "f", float.__repr__(float.__float__(number)))
    return ("nan", typename(value))


def run(fd, write, code, entry):
    try:
        program = compile(code, "<program>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        say(fd, write, "syntax", typename(exc))
        os._exit(0)
    except BaseException as exc:
        say(fd, write, "exc", typename(exc))
        os._exit(0)
    me = os.getpid()
    try:
        scope = {"__name__": "__main__", "__builtins__": __builtins__}
        exec(program, scope)
        fn = scope.get(entry)
        if not callable(fn):
            raise NameError("name %r is not defined" % entry)
        value = fn()
        if os.getpid() != me:  # a fork of the program returned: only the program's process reports
            os._exit(0)
        record = serialise(value)
    except BaseException as exc:
        if os.getpid() != me:
            os._exit(1)
        record = ("exc", typename(exc))
        try:
            sys.stderr.write("%s: %s\n" % (typename(exc), exc))
        except BaseException:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    say(fd, write, *record)
    os._exit(0)


def program(fd, write, code, limits, uid, gid, call, keyctl, idle, entry):
    import resource as R

    for res, value in zip(
        (R.RLIMIT_CPU, R.RLIMIT_AS, R.RLIMIT_FSIZE, R.RLIMIT_NPROC, R.RLIMIT_NOFILE), limits
    ):
        R.setrlimit(res, (value, value + (res == R.RLIMIT_CPU)))  # SIGXCPU first, then SIGKILL
    R.setrlimit(R.RLIMIT_CORE, (0, 0))
    if uid >= 0:
        drop_privileges(uid, gid)
    # Keys live in no namespace: leave the evaluator's session keyring for an empty one of our own
    # (the seccomp filter refuses every other keyring operation).
    keyring = call is not None and call(keyctl, KEYCTL_JOIN_SESSION_KEYRING, 0) >= 0
    say(fd, write, "iso", ",".join(confirmed(uid, keyring, idle)))
    run(fd, write, code, entry)


def main():
    fd, write = int(sys.argv[1]), os.write  # bound now: the program may replace os.write
    cpu, mem, fsize, nproc, nofile, uid, gid, keyctl, ioprio_set, nice = (
        int(x) for x in sys.argv[2:12]
    )
    entry = sys.argv[12]
    del sys.argv[1:]
    os.environ.pop("PWD", None)  # set by bwrap; the program gets an empty environment
    code = sys.stdin.buffer.read()
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        call = libc()
        idle = lower_priorities(call, ioprio_set, nice)
        # pid 1 not dumpable, before the fork (the program inherits it): its /proc entries (cwd, root,
        # fd, environ) are out of the program's reach even where both share a uid (an evaluator without
        # root); as root, the program's own uid change already makes it so.
        prctl = libc("prctl")
        if prctl is None or prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError("prctl(PR_SET_DUMPABLE, 0) failed")
        child = os.fork()
        if child == 0:
            limits = (cpu, mem, fsize, nproc, nofile)
            program(fd, write, code, limits, uid, gid, call, keyctl, idle, entry)
    except BaseException as exc:  # a failed setup (a uid that did not change): never run the program
        say(fd, write, "setup", "bootstrap-" + typename(exc))
        os._exit(1)
    # pid 1: reap everything; when the program's process ends, say how, and exit: the kernel
    # then kills whatever is left in the namespace.
    while True:
        try:
            pid, status, usage = os.wait3(0)
        except ChildProcessError:
            os._exit(1)
        if pid == child:
            say(fd, write, "wait", str(status), repr(usage.ru_utime + usage.ru_stime))
            os._exit(0)


if __name__ == "__main__":
    main()

"""How a run ended: `Outcome` and `SandboxResult`, read from the run's result pipe.

The return value travels on its own pipe as JSON records (ASCII, one per line), so neither printing
an answer nor any returned value can pass for or break a record. A program that deliberately writes
to that pipe can forge its own answer: this guards against accidents and hostile side effects, not
against a model that cheats on purpose. The value is serialised in the child by exact type (never
through the value's own methods, which a subclass can override) and parsed with size limits: each
line once, as it arrives; past 16 KiB the run ends as `output_limit`, the program's failure.
"""

from __future__ import annotations

import enum
import json
import os
import re
import signal
from dataclasses import dataclass

from .config import MAX_INT_BITS, SandboxConfig


class Outcome(enum.Enum):
    OK = "ok"  # returned a number (int or float)
    NOT_A_NUMBER = "not_a_number"  # returned something else (None, str, bool, ...)
    EXCEPTION = "exception"  # raised, exited, or never defined the entry point
    SYNTAX_ERROR = "syntax_error"
    TIMEOUT = "timeout"  # wall clock or CPU limit
    MEMORY = "memory"  # address-space limit (MemoryError) or the run's memory cgroup
    KILLED = "killed"  # died from a signal
    OUTPUT_LIMIT = "output_limit"  # wrote more than the result pipe takes (16 KiB) before ending
    SANDBOX_ERROR = "sandbox_error"  # the sandbox itself failed; not the program's fault


@dataclass(frozen=True)
class SandboxResult:
    outcome: Outcome
    value: int | float | None = None  # set only when outcome is OK
    error: str | None = None  # exception type, signal name, returned type or failure reason
    stdout: str = ""  # first max_output_bytes bytes, decoded with replacement
    stderr: str = ""
    elapsed_s: float = 0.0
    # mechanisms in force for this run, e.g. ("minimal-root", "seccomp", "uid=1073741824",
    # "memory<=536870912:cgroup", ...): from the bwrap command line and what the child confirmed
    isolation: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


_FINAL = {"ok": 2, "nan": 1, "exc": 1, "syntax": 1, "setup": 1}  # kind -> fields after it


class _Channel:
    """The result pipe, parsed as it arrives: each complete line once (a program that writes
    line after line costs the evaluator linear time, not quadratic). Records are lines holding a
    JSON array of strings; anything else (bytes a program wrote there) is skipped. Past `limit`
    bytes nothing more is read: `overflow`, the program's failure (Outcome.OUTPUT_LIMIT)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.partial: list[bytes] = []  # the line being received, in pieces
        self.overflow = False
        self.iso: list[str] | None = None  # the first isolation record
        self.final: list[str] | None = None  # the last record that says how the program ended
        self.wait: list[str] | None = None  # the last exit status pid 1 reported

    def add(self, data: bytes) -> None:
        if self.overflow:
            return
        self.size += len(data)
        if self.size > self.limit:
            self.overflow, self.partial = True, []
            return
        lines = data.split(b"\n")  # bytes, never str.splitlines: only b"\n" ends a record
        if len(lines) == 1:
            self.partial.append(data)
            return
        self.partial.append(lines[0])
        lines[0] = b"".join(self.partial)
        tail = lines.pop()  # the start of the next line (empty when the data ended one)
        self.partial = [tail] if tail else []
        for line in lines:
            record = _parse_line(line)
            if record is None:
                continue
            if record[0] in _FINAL:
                self.final = record
            elif record[0] == "iso" and len(record) == 2 and self.iso is None:
                self.iso = record
            elif record[0] == "wait" and len(record) == 3:
                self.wait = record


def _parse_line(line: bytes) -> list[str] | None:
    """One whole line of the result pipe as a record, or None."""
    if not line.startswith(b"["):
        return None
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if isinstance(record, list) and record and all(type(f) is str for f in record):
        return [_printable(f) for f in record]
    return None


def _printable(text: str) -> str:
    """Lone surrogates (JSON can carry them) as escapes: every result prints and encodes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _decide(
    cfg: SandboxConfig,
    granted: list[str],
    returncode: int | None,
    out: bytes,
    err: bytes,
    channel: _Channel,
    timed_out: bool,
    oom_kills: int,
    elapsed: float,
) -> SandboxResult:
    iso, final, wait = channel.iso, channel.final, channel.wait

    def result(outcome: Outcome, error: str | None = None, value: int | float | None = None):
        return SandboxResult(
            outcome,
            value=value,
            error=error,
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            elapsed_s=elapsed,
            isolation=tuple(granted + iso[1].split(",")) if iso else (),
        )

    if final is not None:
        kind, rest = final[0], final[1:]
        if len(rest) != _FINAL[kind]:
            return result(Outcome.NOT_A_NUMBER, "unreadable")
        if kind == "ok":
            value = _parse_number(*rest)
            if value is None:
                return result(Outcome.NOT_A_NUMBER, "unreadable")
            return result(Outcome.OK, value=value)
        if kind == "nan":
            return result(Outcome.NOT_A_NUMBER, rest[0])
        if kind == "syntax":
            return result(Outcome.SYNTAX_ERROR, rest[0])
        if kind == "exc":
            memory = rest[0] == "MemoryError"
            return result(Outcome.MEMORY if memory else Outcome.EXCEPTION, rest[0])
        return result(Outcome.SANDBOX_ERROR, rest[0])
    if channel.overflow:  # before any record said how the program ended
        return result(Outcome.OUTPUT_LIMIT, "result pipe")
    if timed_out:
        return result(Outcome.TIMEOUT, "wall")
    if oom_kills:  # the run's memory cgroup killed a process: the program's or pid 1
        return result(Outcome.MEMORY, "cgroup")
    if wait is not None:
        try:
            status, cpu = int(wait[1]), float(wait[2])
        except ValueError:
            return result(Outcome.SANDBOX_ERROR, "unreadable status")
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= cfg.cpu_time_s):
                return result(Outcome.TIMEOUT, "cpu")
            if sig == signal.SIGABRT and b"MemoryError" in err:
                return result(Outcome.MEMORY, "MemoryError")
            return result(Outcome.KILLED, _signal_name(sig))
        return result(Outcome.EXCEPTION, f"exit {os.waitstatus_to_exitcode(status)}")
    tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"bwrap exit {returncode}"]
    return result(Outcome.SANDBOX_ERROR, tail[0][:200])


_HEX = re.compile(r"-?[0-9a-f]{1,%d}" % (MAX_INT_BITS // 4))
_FLOAT = re.compile(r"-?(?:inf|nan|[0-9]+\.[0-9]+(?:e[-+][0-9]+)?|[0-9]+e[-+][0-9]+)")


def _parse_number(typ: str, number: str) -> int | float | None:
    """`i <hex>` or `f <float repr>` as the child writes them; None for anything else."""
    if typ == "i" and _HEX.fullmatch(number):
        return int(number, 16)
    if typ == "f" and _FLOAT.fullmatch(number):
        return float(number)
    return None


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"

"""Progress of long work: tqdm's bar on a terminal, plain lines in a log file.

A cluster job's stdout and stderr are files, where tqdm's `\\r` redraws pile up into one endless line
(megabytes over a week of training). `Progress` draws the bar only when its stream is a terminal;
otherwise it prints a complete line, the same figures as the bar, every `every_steps` updates or
`every_s` seconds, and at the end.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm.auto import tqdm


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


class Progress:
    """`update`, `set_postfix`, `write`, `close`, as tqdm's. `enabled` False: silent (another rank's).
    `interactive` None: whether `stream` is a terminal."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "it", initial: int = 0, enabled: bool = True,
                 every_steps: int | None = None, every_s: float | None = 60.0, stream: TextIO | None = None,
                 interactive: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.desc, self.total, self.unit, self.enabled = desc, total, unit, enabled
        self.every_steps, self.every_s = every_steps, every_s
        self.n = self.start_n = initial
        self.start = self.last_line = time.monotonic()
        self.postfix: dict[str, Any] = {}
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=not (enabled and self.interactive),
                        dynamic_ncols=True, file=self.stream, unit_scale=unit != "it")

    def update(self, n: int = 1) -> None:
        self.n += n
        self.bar.update(n)
        if not self.enabled or self.interactive:
            return
        now = time.monotonic()
        due_steps = self.every_steps is not None and self.n // self.every_steps != (self.n - n) // self.every_steps
        due_time = self.every_s is not None and now - self.last_line >= self.every_s
        if due_steps or due_time or (self.total is not None and self.n >= self.total):
            self.last_line = now
            print(self.line(now), file=self.stream, flush=True)

    def line(self, now: float | None = None) -> str:
        """What the bar shows, as one line: done/total, rate, elapsed and remaining time, the postfix."""
        elapsed = (time.monotonic() if now is None else now) - self.start
        done = self.n - self.start_n
        rate = done / elapsed if elapsed > 0 else 0.0
        where = f"{self.n:,}" + (f"/{self.total:,} ({self.n / self.total:.0%})" if self.total else "")
        parts = [f"{self.desc}: {where} {self.unit}", f"{rate:,.1f} {self.unit}/s", f"elapsed {_duration(elapsed)}"]
        if self.total and rate > 0:
            parts.append(f"eta {_duration((self.total - self.n) / rate)}")
        parts += [f"{k} {v}" for k, v in self.postfix.items()]
        return ", ".join(parts)

    def set_total(self, total: int) -> None:
        """The total, once it is known (after the source was opened)."""
        self.total = self.bar.total = total
        self.bar.refresh()

    def set_postfix(self, **values: Any) -> None:
        self.postfix = values
        self.bar.set_postfix(**values)

    def write(self, message: str) -> None:
        if self.enabled:
            self.bar.write(message, file=self.stream) if self.interactive else print(message, file=self.stream, flush=True)

    def close(self) -> None:
        self.bar.close()

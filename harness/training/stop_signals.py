"""Stopping a training run on a signal. SIGTERM or SIGUSR1 (what SLURM sends before preemption or the
time limit) and SIGINT (Ctrl-C in a terminal) set a flag instead of killing the process
(`stop_requests`); the ranks agree on it at the next step boundary (`agreed_stop`), save a checkpoint,
and `train` raises `TrainingStopped`; the CLI exits with 128 + the signal's number (143 for SIGTERM, 138
for SIGUSR1, 130 for SIGINT). A second Ctrl-C before that stops at once (`TrainingInterrupted`), saving
nothing more.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from blockgen.harness.runtime.distributed import Distributed

# SLURM: preemption, `--signal=USR1@SECONDS` before the time limit; a terminal: Ctrl-C (torchrun forwards it)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class TrainingStopped(Exception):
    """The run stopped on a signal after writing a checkpoint at `step`; rerunning the command resumes."""

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; checkpoint {checkpoint} written; "
                         f"run the same command again to resume")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention for "ended by this signal"


class TrainingInterrupted(Exception):
    """A second Ctrl-C while the run was finishing its step to save: stopped at once, nothing more saved."""

    exit_code = 128 + signal.SIGINT

    def __init__(self) -> None:
        super().__init__("second Ctrl-C: stopped at once without saving; the steps since the last checkpoint are "
                         "lost (run the same command again to resume from it)")


@contextlib.contextmanager
def stop_requests():
    """While training: STOP_SIGNALS set a flag (a box holding the signal's number) instead of killing the
    process, so the loop can finish its step and save. The previous handlers come back afterwards."""
    box = [0]
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield box
        return

    def handler(signum, frame):
        if signum == signal.SIGINT and box[0]:  # the user insists: do not wait for the step to end
            raise TrainingInterrupted
        box[0] = signum

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield box
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def agreed_stop(signum: int, d: Distributed) -> int:
    """The signal any rank received (0: none), the same on every rank: all must save and stop at the
    same step, or those still training wait in a collective for the ones that left."""
    if d.world_size == 1:
        return signum
    flag = torch.tensor([signum], device=d.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())

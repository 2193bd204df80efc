"""A run's directory across restarts and ranks: resuming from the checkpoint a run left there (which
settings may change), where the copies kept at `keep_steps` go, the check at start that every
rank sees rank 0's directory, and the lock that keeps a second run out of a directory in use. The
checkpoint slots themselves (`checkpoint`, `checkpoint.prev`, and restoring the newest complete one)
are harness/checkpoints/checkpoint.py's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from blockgen.harness.checkpoints.checkpoint import TRAINING_STATE
from blockgen.harness.data.sources import current_names
from blockgen.harness.runtime.distributed import Distributed
from blockgen.harness.training.train_config import TrainConfig

# Settings a resumed run may change (e.g. extending the step budget); anything else must match.
# micro_batch too (a run resumed on smaller GPUs): it splits the same global batch into other slots,
# so the block-size and noise draws differ from the uninterrupted run's, the objective does not.
RESUMABLE_CHANGES = frozenset(
    {"init_from", "max_steps", "eval_every", "save_every", "device", "out_dir", "attention", "compile", "peak_tflops",
     "micro_batch", "dist_timeout_s", "keep_steps", "log_every"}
)


def resume_training_state(ckpt_dir: Path, config: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          ema, device: torch.device) -> int:
    """Load the training state saved in `ckpt_dir` into the model, the optimizer and the EMA (`train.EMA`);
    returns its step. Fails when a setting outside RESUMABLE_CHANGES differs from the checkpoint's."""
    state = torch.load(ckpt_dir / TRAINING_STATE, map_location=device, weights_only=False)
    # a setting added after the checkpoint was written had its default then
    saved = {**TrainConfig().to_dict(), **state["config"]}
    saved["data"] = current_names(saved["data"])  # renamed values ("embedded") in today's spelling
    now = config.to_dict()
    # data.cache_dir is a location, as out_dir is: a run folder moved together with its data cache resumes
    for data in (saved["data"], now["data"]):
        data.pop("cache_dir", None)
    changed = sorted(k for k, v in now.items() if saved.get(k) != v and k not in RESUMABLE_CHANGES)
    if changed:
        raise ValueError(f"{ckpt_dir} was written with different {changed}; use another out_dir")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    ema.shadow = {k: v.to(device) for k, v in state["ema"].items()}
    return state["step"]


def keep_dir(out_dir: str | Path, step: int) -> Path:
    """Where the copy kept at `step` (`keep_steps`) lives."""
    return Path(out_dir) / f"checkpoint-step{step}"


# ---------------------------------------------------------------------------------------------
# one run directory for every rank

RUN_TOKEN = ".run-token"  # rank 0's fresh token in the run directory, read back by every rank at start
SHARED_STORAGE = ("a run's directory (RUNS) and data cache must be on a file system every node shares (NFS, Lustre, "
                  "GPFS; not a node's local disk): docs/training.md, \"Multi-node\"")


class RunDirectoryMismatch(ValueError):
    """A rank sees another run directory than rank 0's: machines without a shared file system."""


def checkpoint_step(ckpt_dir: Path) -> int:
    """The step of the checkpoint at `ckpt_dir` (0: none)."""
    try:
        return int(json.loads((ckpt_dir / "config.json").read_text())["training"]["step"])
    except (OSError, KeyError, ValueError):
        return 0


def check_same_run_directory(out: Path, ckpt_dir: Path, d: Distributed) -> None:
    """Fail at start unless every rank sees rank 0's run directory: the token rank 0 has just written there
    and the same checkpoint step. A rank on a machine without the shared file system would otherwise
    start at step 0 while the others resume (two models, or a hang in mismatched collectives)."""
    if d.world_size == 1:
        return
    if d.is_main:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f"{RUN_TOKEN}.tmp"
        tmp.write_text(os.urandom(16).hex())
        os.replace(tmp, out / RUN_TOKEN)
    dist.barrier()
    try:
        token = (out / RUN_TOKEN).read_text()
    except OSError:
        token = "(none)"
    seen = {"host": socket.gethostname(), "dir": str(out.resolve()), "token": token, "step": checkpoint_step(ckpt_dir)}
    everyone: list = [None] * d.world_size
    dist.all_gather_object(everyone, seen)
    reference = everyone[0]
    differ = [(rank, s) for rank, s in enumerate(everyone) if (s["token"], s["step"]) != (reference["token"], reference["step"])]
    if differ:
        lines = [f"rank {rank} on {s['host']} sees {s['dir']} with checkpoint step {s['step']} "
                 f"({'another run token' if s['token'] != '(none)' else 'no run token'})" for rank, s in differ[:4]]
        raise RunDirectoryMismatch(
            f"the ranks do not share one run directory: rank 0 on {reference['host']} sees {reference['dir']} with "
            f"checkpoint step {reference['step']}, but {'; '.join(lines)}{' ...' if len(differ) > 4 else ''}. "
            f"Training on several machines needs a shared file system: {SHARED_STORAGE}")


# ---------------------------------------------------------------------------------------------
# one run at a time in a directory

TRAIN_LOCK = ".train.lock"  # held (flock) by rank 0 while it trains; the OS drops it when the process dies


class RunDirectoryBusy(RuntimeError):
    """Another live process is training into this run directory."""


@contextlib.contextmanager
def hold_run_directory(out: Path, holder: bool = True) -> Iterator[None]:
    """Keep other runs out of `out` while this one trains (`holder`: rank 0; other ranks hold nothing).

    Two processes training into one directory overwrite each other's checkpoints and metrics and
    resume from each other's steps: the second is refused at start, naming the first. An advisory
    `flock`, so a crashed run leaves no stale lock behind (the file stays, unlocked)."""
    if not holder:
        yield
        return
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / TRAIN_LOCK, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            owner = lock.read().strip() or "another process"
            raise RunDirectoryBusy(f"{out} is in use: {owner} is training into it; wait for it to end, stop it, "
                                   "or train into another out_dir") from None
        lock.truncate(0)
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
        lock.flush()
        try:
            yield
        except BaseException:
            if created and [p.name for p in out.iterdir()] == [TRAIN_LOCK]:  # a run that failed at start leaves no folder
                (out / TRAIN_LOCK).unlink()
                out.rmdir()
            raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

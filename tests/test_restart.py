"""Restarts and faults: `kill -9` of a 2-process torchrun training run (also inside a checkpoint
write), SIGTERM, then the same command again; torn checkpoint slots; kept copies (`keep_steps`); `kill -9` of
`blockgen demo`, whose worker processes must not train on without it.

The rerun resumes from the last complete checkpoint and ends with the weights of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from blockgen.harness.checkpoints.checkpoint import KILL_IN_SAVE_ENV, TRAINING_STATE, restore_latest_checkpoint, save_checkpoint
from blockgen.harness.training.stop_signals import TrainingInterrupted, TrainingStopped, stop_requests
from blockgen.harness.training.metrics_log import keep_records_up_to
from blockgen.harness.training.train_config import TrainConfig
from limits import HANG_S

# The 2-rank runs share the machine: every kill and signal waits for a logged step or a save, never for a time.

PY = sys.executable
MAX_STEPS = 30


def train_command(out: Path, cache: Path) -> list[str]:
    return [
        PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "blockgen.harness.cli",
        "train", "--preset", "ci", "--out-dir", str(out), "--max-steps", str(MAX_STEPS), "--save-every", "5",
        "--eval-every", str(MAX_STEPS), "--device", "cpu", "--data.cache-dir", str(cache),
    ]


def run(cmd: list[str], cwd: Path) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def saved_step(out: Path) -> int:
    """The step a rerun resumes from: `checkpoint`'s, or `.prev`'s after a kill between a save's renames."""
    for slot in ("checkpoint", "checkpoint.prev"):
        config = out / slot / "config.json"
        if config.is_file():
            return json.loads(config.read_text())["training"]["step"]
    return 0


def test_kill_dash_nine_then_rerun_matches_uninterrupted_run(tmp_path):
    """A 2-rank run killed with SIGKILL, then the same command: it resumes and ends bit-identical to an
    uninterrupted run. Over 30 s (about 25-30 s): three 2-rank torchrun trainings (straight, killed, resumed)."""
    cache = tmp_path / "data-cache"
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run(train_command(straight, cache), tmp_path)  # also trains and caches the tokenizer

    cmd = train_command(killed, cache)
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + HANG_S
    try:  # kill the launcher and both workers at once, as a lost machine would, past a checkpoint
        while len(logged_steps(killed)) < 8 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    resumed_from = saved_step(killed)
    assert 5 <= resumed_from < MAX_STEPS, f"killed at checkpoint step {resumed_from}: the kill missed the run"
    assert max(logged_steps(killed)) > resumed_from or resumed_from % 5 == 0

    run(cmd, tmp_path)  # the same command again
    assert logged_steps(killed) == list(range(1, MAX_STEPS + 1))  # each step logged once
    a = torch.load(straight / "checkpoint" / TRAINING_STATE, weights_only=False)
    b = torch.load(killed / "checkpoint" / TRAINING_STATE, weights_only=False)
    assert a["step"] == b["step"] == MAX_STEPS
    for part in ("model", "ema"):
        for key in a[part]:
            torch.testing.assert_close(a[part][key], b[part][key], rtol=0, atol=1e-6, msg=f"{part}.{key}")
    ema_a = load_file(str(straight / "checkpoint" / "model.safetensors"))
    ema_b = load_file(str(killed / "checkpoint" / "model.safetensors"))
    for key in ema_a:
        torch.testing.assert_close(ema_a[key], ema_b[key], rtol=0, atol=1e-6)


def test_metrics_after_the_last_checkpoint_are_dropped(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 9)))
    keep_records_up_to(log, 5)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4, 5]


# ------------------------------------------------------------------------------ what the runs log and train


def test_flops_formula_matches_torch_flop_counter():
    """training_flops_per_step against torch's FlopCounterMode on a real forward + backward (micro model)."""
    from torch.utils.flop_counter import FlopCounterMode

    from blockgen.harness.training.flops_memory import training_flops_per_step
    from blockgen.models.backbone import SIZES
    from blockgen.models.model import BlockGen, BlockGenConfig

    config = BlockGenConfig(vocab_size=300, seq_len=64, block_sizes=(1, 16), block_weights=(0.5, 0.5), shape=SIZES["micro"])
    model = BlockGen(config)
    x = torch.randint(0, 300, (4, 64))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # the math backend runs attention as matmuls the counter sees (it does not count fused CPU kernels)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        total, count = model(x, torch.ones(4, 64), 16, torch.full((4,), 0.5))
        (total / count).backward()
    counted = counter.get_total_flops()
    formula = training_flops_per_step(config, batch_size=4)
    # the formula leaves out adaLN and the time embedding (once per sequence)
    assert 0.99 < formula / counted <= 1.0, (formula, counted)  # measured: 0.998


def test_presets_are_the_papers_baselines():
    from blockgen.harness.training.presets import BENCHMARKS, PRESETS

    for scale in ("", "-embedded"):
        owt, gsm = PRESETS[f"owt{scale}-masked-mix-flat"], PRESETS[f"tinygsm{scale}-uniform-mix"]
        assert (owt.block_sizes, owt.block_weights) == ((1, 2, 4, 8, 16), (0.2,) * 5)
        assert (gsm.prior, gsm.block_sizes, gsm.block_weights) == ("uniform", (1, 16), (0.05, 0.95))
        assert PRESETS[f"owt{scale}-ar"].block_sizes == (1,)
        assert PRESETS[f"owt{scale}-mdlm"].block_sizes == (PRESETS[f"owt{scale}-mdlm"].seq_len,)
        assert PRESETS[f"tinygsm{scale}-duo"].prior == "uniform"
        assert {PRESETS[f"owt{scale}-{p}-{b}"].block_sizes for p in ("masked", "uniform") for b in (4, 8, 16)} == {(4,), (8,), (16,)}
    owt = PRESETS["owt-masked-mix"]
    assert (owt.seq_len, owt.batch_size, owt.max_steps, owt.lr, owt.size, owt.data.source) == (1024, 512, 1_000_000, 3e-4, "paper", "owt")
    assert PRESETS["tinygsm-ar"].max_steps == 250_000 and PRESETS["owt-embedded-ar"].data.source == "text"
    assert all(PRESETS[f"{b}-{v}"].out_dir == f"runs/{b}-{v}" for b, (_, variants) in BENCHMARKS.items() for v in variants)


# ------------------------------------------------------------------------------ checkpoint slots, signals, kept copies

FAULT_STEPS, FAULT_SAVE_EVERY, KEEP = 12, 4, (4, 8)


def fault_command(out: Path, cache: Path) -> list[str]:
    """A 2-rank run short enough to run three times: a checkpoint every 4 steps, copies kept at 4 and 8."""
    return [
        PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "blockgen.harness.cli",
        "train", "--preset", "ci", "--out-dir", str(out), "--max-steps", str(FAULT_STEPS),
        "--save-every", str(FAULT_SAVE_EVERY), "--keep-steps", *map(str, KEEP), "--eval-every", str(FAULT_STEPS),
        "--device", "cpu", "--data.cache-dir", str(cache),
    ]


def run_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != KILL_IN_SAVE_ENV}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> tuple[Path, Path]:
    """(out-dir of an uninterrupted run, the data cache), shared by the fault tests."""
    tmp = tmp_path_factory.mktemp("faults")
    cache, out = tmp / "data-cache", tmp / "straight"
    result = subprocess.run(fault_command(out, cache), capture_output=True, text=True, timeout=HANG_S, cwd=tmp, env=run_env())
    assert result.returncode == 0, result.stderr[-3000:]
    # the run's one closing line, printed by rank 0 only
    assert [line for line in result.stdout.splitlines() if line.startswith("checkpoint:")] == [f"checkpoint: {out / 'checkpoint'}"]
    return out, cache


def assert_same_weights(a: Path, b: Path) -> None:
    """Bit-identical raw weights, EMA and saved (EMA) safetensors of two checkpoint folders."""
    sa = torch.load(a / TRAINING_STATE, weights_only=False)
    sb = torch.load(b / TRAINING_STATE, weights_only=False)
    assert sa["step"] == sb["step"]
    for part in ("model", "ema"):
        for key in sa[part]:
            torch.testing.assert_close(sa[part][key], sb[part][key], rtol=0, atol=0, msg=f"{part}.{key}")
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=0, atol=0)


def test_a_kill_inside_a_checkpoint_write_resumes_from_the_last_complete_one(straight_run, tmp_path):
    """Rank 0 is SIGKILLed while saving step 8, after the step-4 checkpoint became `checkpoint.prev` and
    before step 8's is in place (no `checkpoint` folder at all): the rerun resumes from step 4, kept
    copies are not rewritten, and the final weights equal the uninterrupted run's bit for bit."""
    straight, cache = straight_run
    for step in KEEP:  # the uninterrupted run kept its copies
        kept = straight / f"checkpoint-step{step}"
        assert json.loads((kept / "config.json").read_text())["training"]["step"] == step
    out = tmp_path / "killed"
    cmd = fault_command(out, cache)
    crashed = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path,
                             env=run_env(**{KILL_IN_SAVE_ENV: "8:rotated"}))
    assert crashed.returncode != 0
    assert not (out / "checkpoint").exists() and (out / "checkpoint.prev").is_dir() and (out / "checkpoint.tmp").is_dir()
    kept8 = out / "checkpoint-step8" / TRAINING_STATE
    before = kept8.stat()

    result = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path, env=run_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from step 4 of" in result.stdout
    assert logged_steps(out) == list(range(1, FAULT_STEPS + 1))
    assert not (out / "checkpoint.tmp").exists() and saved_step(out) == FAULT_STEPS
    assert json.loads((out / "checkpoint.prev" / "config.json").read_text())["training"]["step"] == 8
    after = kept8.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # never overwritten
    assert_same_weights(straight / "checkpoint", out / "checkpoint")
    assert_same_weights(straight / "checkpoint-step8", out / "checkpoint-step8")


def worker_pid(launcher: int, rank: int) -> int | None:
    """The pid of torchrun's worker of `rank` (a child of the launcher with RANK=rank), None before it starts."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in env:
            return int(entry.name)
    return None


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_to_one_rank_saves_on_every_rank_and_a_rerun_resumes(straight_run, tmp_path, signum):
    """SIGTERM (SLURM's) or SIGINT (a terminal's Ctrl-C) to rank 1 alone: both ranks stop at the same step
    boundary, rank 0 saves, the workers exit 128 + the signal's number with a message; the same command
    again resumes there and ends bit-identical."""
    straight, cache = straight_run
    out = tmp_path / "signalled"
    cmd = fault_command(out, cache)
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=run_env())
    deadline = time.monotonic() + HANG_S
    try:
        while len(logged_steps(out)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        pid = worker_pid(proc.pid, 1)
        assert pid is not None, "rank 1 not found"
        os.kill(pid, signum)
        _, stderr = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stopped = saved_step(out)
    assert proc.returncode != 0 and 2 <= stopped < FAULT_STEPS, stderr[-3000:]
    assert f"blockgen train: stopped by {signal.Signals(signum).name} at step {stopped}" in stderr
    assert re.search(rf"exitcode\s*:\s*{128 + signum}", stderr)  # torchrun's report of a worker's exit (128 + the signal)
    assert max(logged_steps(out)) == stopped  # no rank went on past the step it saved

    result = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path, env=run_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from step {stopped} of" in result.stdout
    assert logged_steps(out) == list(range(1, FAULT_STEPS + 1))
    assert_same_weights(straight / "checkpoint", out / "checkpoint")


def tiny_slot(directory: Path, step: int, keep_copy: Path | None = None) -> None:
    """A complete checkpoint of a micro model at `step` (what training writes, minus the tokenizer)."""
    from blockgen.models.backbone import SIZES
    from blockgen.models.model import BlockGen, BlockGenConfig

    torch.manual_seed(step)
    model = BlockGen(BlockGenConfig(vocab_size=64, seq_len=16, block_sizes=(4,), block_weights=(1.0,), shape=SIZES["micro"]))
    save_checkpoint(directory, model, training_state={"step": step}, extra={"step": step}, keep_previous=True, keep_copy=keep_copy)


def slot_step(directory: Path) -> int:
    return torch.load(directory / TRAINING_STATE, weights_only=False)["step"]


def test_the_newest_slot_that_reads_cleanly_is_resumed_and_a_torn_one_is_skipped(tmp_path, capsys):
    ckpt = tmp_path / "checkpoint"
    tiny_slot(ckpt, 1)
    tiny_slot(ckpt, 2, keep_copy=tmp_path / "checkpoint-step2")
    assert slot_step(ckpt) == 2 and slot_step(tmp_path / "checkpoint.prev") == 1
    tiny_slot(ckpt, 3, keep_copy=tmp_path / "checkpoint-step2")  # an existing kept copy is never overwritten
    assert slot_step(tmp_path / "checkpoint-step2") == 2 and slot_step(tmp_path / "checkpoint.prev") == 2
    (tmp_path / "checkpoint.tmp").mkdir()  # a save killed while writing: never trusted, removed by the next save
    assert restore_latest_checkpoint(ckpt) == ckpt and slot_step(ckpt) == 3 and capsys.readouterr().err == ""

    state = ckpt / TRAINING_STATE
    state.write_bytes(state.read_bytes()[:100])  # torn (a file system that lost the tail)
    assert restore_latest_checkpoint(ckpt) == ckpt and slot_step(ckpt) == 2
    err = capsys.readouterr().err
    assert f"skipping torn checkpoint {ckpt} (moved to {ckpt}.torn)" in err
    assert not (tmp_path / "checkpoint.prev").exists() and (tmp_path / "checkpoint.torn").is_dir()

    tiny_slot(ckpt, 4)  # the torn one moved aside: the rotation keeps the good step 2 as .prev
    assert not (tmp_path / "checkpoint.tmp").exists() and slot_step(tmp_path / "checkpoint.prev") == 2
    (ckpt / "model.safetensors").write_bytes(b"")
    (tmp_path / "checkpoint.prev" / "config.json").write_text("{\"model_type\": ")
    assert restore_latest_checkpoint(ckpt) is None  # nothing complete: a fresh start, both named
    err = capsys.readouterr().err
    assert str(ckpt) in err and f"{ckpt}.prev" in err
    assert restore_latest_checkpoint(tmp_path / "nothing") is None


def test_keep_steps_is_validated_and_parsed():
    from blockgen.harness.cli import build_parser, config_from_args

    for bad in ((0,), (5, 5), (-1, 3)):
        with pytest.raises(ValueError, match="keep_steps"):
            TrainConfig(keep_steps=bad)
    config = config_from_args(build_parser().parse_args(["train", "--preset", "ci", "--keep-steps", "250000", "500000"]))
    assert config.keep_steps == (250_000, 500_000)


def test_stop_signals_set_a_flag_and_the_exit_code_names_the_signal():
    before = signal.getsignal(signal.SIGTERM)
    with stop_requests() as box:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert box[0] == signal.SIGUSR1
    assert signal.getsignal(signal.SIGTERM) is before
    assert TrainingStopped(signal.SIGTERM, 7, Path("x")).exit_code == 143
    assert TrainingStopped(signal.SIGUSR1, 7, Path("x")).exit_code == 138
    assert TrainingStopped(signal.SIGINT, 7, Path("x")).exit_code == 130


def test_a_second_ctrl_c_stops_at_once():
    """Ctrl-C asks the run to save at the next step; a second one before that stops it there and then."""
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted, match="second Ctrl-C: stopped at once without saving"):
        with stop_requests() as box:
            os.kill(os.getpid(), signal.SIGINT)
            assert box[0] == signal.SIGINT  # the first: a request, no exception
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs between bytecodes; never reached
    assert signal.getsignal(signal.SIGINT) is before
    assert TrainingInterrupted().exit_code == 130


def _children(pid: int) -> set[int]:
    stats = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            stats.append(stat.read_text())
        except OSError:  # ended meanwhile
            pass
    # /proc/PID/stat: "pid (comm) state ppid ...", comm may hold spaces: split after its closing parenthesis
    return {int(s.split()[0]) for s in stats if int(s.rsplit(")", 1)[1].split()[1]) == pid}


def test_a_killed_demo_leaves_no_worker_running_and_its_training_saved(tmp_path):
    """`kill -9` of `blockgen demo` runs no cleanup in it; its worker processes notice their parent is gone, the
    training among them stops at a step boundary and saves its checkpoint (rerunning resumes it), and nothing of the
    demo is left running."""
    out = tmp_path / "demo"
    cmd = [PY, "-m", "blockgen.harness.cli", "demo", "--out-dir", str(out), "--presets", "ci-ar", "--train-only",
           "--max-steps", "100000", "--jobs", "1"]
    demo = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "ci-ar" / "metrics.jsonl"
    deadline = time.monotonic() + HANG_S
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
        assert demo.poll() is None and time.monotonic() < deadline, "the demo ended or never started training"
        time.sleep(0.5)
    workers = _children(demo.pid)
    assert workers, "the demo runs its training in a worker process"
    demo.send_signal(signal.SIGKILL)
    demo.wait()
    while any(Path(f"/proc/{w}").exists() and "(Z" not in Path(f"/proc/{w}/stat").read_text() for w in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived the demo"
        time.sleep(0.5)
    state = torch.load(out / "ci-ar" / "checkpoint" / TRAINING_STATE, weights_only=False)
    assert 3 <= state["step"] < 100000  # saved where it stopped, not only at a save_every boundary

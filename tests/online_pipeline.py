"""The full-scale make targets online at tiny size, against the hub stand-in; then the same runs offline from the hub
cache they filled, with the stand-in stopped; the two leaderboards compared row by row (docs/pipeline.md, "The
full-scale path online").

    python tests/online_pipeline.py --out runs/online-check                    # the four paths
    python tests/online_pipeline.py --out runs/online-check --paths released-owt
    make online-check

A path is the make targets a user with a GPU runs, without OFFLINE=1: `train-owt eval-owt`, `train-tinygsm eval-gsm8k`,
`eval-released-owt`, `eval-released-gsm8k`, each with two models, a few training steps and LIMIT=2 on the CPU.
Every Python process of the runs (make's blockgen commands, torchrun's workers, the vLLM server) starts with a socket
guard (a sitecustomize on PYTHONPATH): a TCP connection to any address but this machine's own is refused and written
to a log, and the check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hub_client import client_env  # tests/ is this script's folder, on sys.path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("BLOCKGEN_RELEASE_FIXTURES", REPO.parent / "shared" / "data"))  # released/, released-gpt2/
MODELS = "ar masked-mix"  # the AR baseline and the paper's main model, in every path
TRAINING = {"NPROC": "2", "SIZE": "micro", "STEPS": "4", "BATCH": "8", "MICRO_BATCH": "4"}
EVALUATION = {"DEVICE": "cpu", "EVAL_NPROC": "1", "LIMIT": "2"}
REL_TOL = 1e-6  # "the same rows up to float tolerance": the runs are the same computation on the same CPU
# what a row records about when and where it ran, not what it measured
CIRCUMSTANCES = ("source", "date", "commit", "hardware", "wall_seconds", "tokens_per_s")


@dataclass(frozen=True)
class OnlinePath:
    targets: tuple[str, ...]
    variables: dict[str, str]
    leaderboard: str  # the Makefile variable naming its leaderboard file
    model_data: dict[str, str] = field(default_factory=dict)


PATHS = {
    "owt": OnlinePath(("train-owt", "eval-owt"), {"MODELS_OWT": MODELS, "SEQ_LEN": "64", "TEMPS_OWT": "1.0", **TRAINING},
                      "LEADERBOARD_OWT"),
    # the SmolLM-layout tokenizer of the stand-in spells characters: a word problem needs 512 positions
    "gsm8k": OnlinePath(("train-tinygsm", "eval-gsm8k"), {"MODELS_GSM": MODELS, "SEQ_LEN": "512", "TEMPS_GSM": "0.5", **TRAINING},
                        "LEADERBOARD_GSM"),
    "released-owt": OnlinePath(("eval-released-owt",), {"MODELS_OWT_RELEASED": MODELS, "TEMPS_OWT": "1.0"},
                               "LEADERBOARD_RELEASED_OWT"),
    "released-gsm8k": OnlinePath(("eval-released-gsm8k",), {"MODELS_GSM_RELEASED": MODELS, "TEMPS_GSM": "0.5"},
                                 "LEADERBOARD_RELEASED_GSM"),
}

def environment(out: Path, endpoint: str, phase: str) -> dict[str, str]:
    """The runs' environment: the stand-in as the hub, a hub cache of their own (shared by both phases: the offline
    phase reads what the online one downloaded), each phase's own release conversions, the socket guard."""
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"} if phase == "offline" else {}
    return client_env(endpoint, out / "hf", out / phase / "release-cache", out / "socket-guard", out / "connections.log",
                      **offline)


# owt_genppl's scorer in process (transformers) instead of a vLLM server: what CI's test runs (the same download of
# gpt2-large from the hub, without two server start-ups)
IN_PROCESS_SCORER = {"EVAL_ARGS": """--metadata '{"scorer": "transformers"}'"""}


def make_command(path: OnlinePath, runs: Path, models: str = MODELS, more: dict[str, str] | None = None) -> list[str]:
    variables = {**EVALUATION, **path.variables, "RUNS": str(runs), path.leaderboard: str(runs / "leaderboard.json"),
                 "TRAIN_ARGS": f"--data.cache-dir {runs / 'data'}", **(more or {})}  # the prepared data of this run only
    variables.update({k: models for k in variables if k.startswith("MODELS_")})
    # the environment this check runs in (an ordinary user's copy of it, under tests/run_unprivileged.sh), taken as
    # installed: `-o` keeps make from reinstalling it
    venv = Path(sys.executable).parent.parent
    return ["make", "--no-print-directory", "-o", f"{venv}/.installed", *path.targets, f"VENV={venv}",
            *(f"{k}={v}" for k, v in variables.items())]


def run_path(name: str, out: Path, endpoint: str, phase: str, models: str = MODELS, more: dict[str, str] | None = None) -> float:
    """One path's make targets in one phase; its output in OUT/PHASE/NAME.log. Returns its wall seconds."""
    runs = out / phase / name
    runs.mkdir(parents=True, exist_ok=True)
    command = make_command(PATHS[name], runs, models, more)
    log = out / phase / f"{name}.log"
    print(f"{phase} {name}: {' '.join(command)} (log: {log})", flush=True)
    start = time.monotonic()
    with open(log, "w") as sink:
        done = subprocess.run(command, cwd=REPO, env=environment(out, endpoint, phase), stdout=sink, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - start
    if done.returncode:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"{phase} {name} failed (exit {done.returncode}) after {seconds:.0f} s; its log {log} ends:\n{tail}")
    return seconds


def compare_boards(online: Path, offline: Path) -> dict:
    """Rows matched by what they measured (`Row.key()`: model, task, metric, sampler settings, ...; not the checkpoint's
    hash, which covers its config and so the run folder's path: `compare_weights` compares the weights); the same keys
    on both sides, every value within REL_TOL. Returns counts and the largest relative difference."""
    from dataclasses import replace

    from blockgen.harness.reports.leaderboard import read

    boards = [{replace(row, checkpoint_sha=None).key(): row for row in read(p).rows} for p in (online, offline)]
    if boards[0].keys() != boards[1].keys():
        only = [sorted(map(str, a.keys() - b.keys()))[:3] for a, b in ((boards[0], boards[1]), (boards[1], boards[0]))]
        raise AssertionError(f"the leaderboards hold different measurements: online only {only[0]}, offline only {only[1]}")
    worst = 0.0
    for key, row in boards[0].items():
        other = boards[1][key]
        a, b = row.value, other.value
        if a is None or b is None or (math.isnan(a) and math.isnan(b)):
            assert (a is None) == (b is None), (key, a, b)
            continue
        worst = max(worst, abs(a - b) / max(abs(a), abs(b), 1e-12))
        if not math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-12):
            raise AssertionError(f"{row.model} {row.task} {row.metric} {row.sampler}: online {a!r}, offline {b!r}")
    return {"rows": len(boards[0]), "max_relative_difference": worst}


def compare_weights(online: Path, offline: Path) -> int:
    """The phases' trained checkpoints and release conversions (`model.safetensors` under each folder, matched by
    relative path) hold the same bytes. Returns how many were compared."""
    import hashlib

    def digests(root: Path) -> dict[str, str]:
        return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("model.safetensors")}

    a, b = digests(online), digests(offline)
    if a != b:
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        raise AssertionError(f"the weights differ between the phases (or exist in one only): {differ}")
    return len(a)


def run_check(names: list[str], out: Path, models: str = MODELS, more: dict[str, str] | None = None) -> dict:
    """Every path online against a fresh stand-in, then offline with it stopped; the leaderboards compared; no
    connection beyond the machine. Returns (and writes to OUT/summary.json) each path's times and comparison.
    `models`: the grids' models each path trains or evaluates (space-separated); `more`: more make variables."""
    from blockgen.harness.checkpoints.hub_standin import HubStandin
    from blockgen.harness.data.hub_standin_repos import write_tiny_hub

    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    connections = out / "connections.log"
    connections.unlink(missing_ok=True)
    summary: dict = {"paths": {}, "fixtures": str(FIXTURES)}
    start = time.monotonic()
    write_tiny_hub(out / "hub", release_fixtures=FIXTURES if FIXTURES.is_dir() else None)
    summary["write_repos_seconds"] = round(time.monotonic() - start, 1)
    with HubStandin(out / "hub") as standin:
        endpoint = standin.endpoint
        for name in names:
            summary["paths"][name] = {"online_seconds": round(run_path(name, out, endpoint, "online", models, more), 1)}
    for name in names:  # the stand-in is stopped: anything not in the cache fails instead of being fetched
        summary["paths"][name]["offline_seconds"] = round(run_path(name, out, endpoint, "offline", models, more), 1)
        summary["paths"][name].update(compare_boards(out / "online" / name / "leaderboard.json",
                                                     out / "offline" / name / "leaderboard.json"))
    for phase in ("online", "offline"):  # the phases' release conversions went to their own caches
        (out / phase / "release-cache").mkdir(parents=True, exist_ok=True)
    summary["weights_compared"] = compare_weights(out / "online", out / "offline")
    if connections.exists():
        raise AssertionError(f"a connection left the machine: {connections.read_text()}")
    summary["connections_refused"] = 0
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the check's folder (hub, caches, runs, logs, summary.json)")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--models", default=MODELS, help=f"the grids' models per path, space-separated (default: {MODELS!r})")
    args = parser.parse_args(argv)
    summary = run_check(args.paths, args.out, args.models)
    for name, result in summary["paths"].items():
        print(f"{name:15s} online {result['online_seconds']:6.1f} s  offline {result['offline_seconds']:6.1f} s  "
              f"{result['rows']} rows, largest relative difference {result['max_relative_difference']:.1e}")
    print(f"{summary['weights_compared']} checkpoints' and conversions' weights byte-identical online and offline; "
          f"no connection left the machine; summary: {args.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

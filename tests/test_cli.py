"""One command line: every subcommand is reachable as `blockgen ...` from harness/cli.py, and no other
module of the package is a program of its own.

The tree of subcommands is read from the parser itself, so a subcommand added anywhere is checked."""

from __future__ import annotations

import argparse
import ast
import io
import json
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from blockgen.harness import cli
from limits import HANG_S

REPO = Path(__file__).resolve().parents[1]
BLOCKGEN = Path(sys.executable).parent / "blockgen"
# Programs that are not command lines of this project: the sandbox's pid 1 (its text runs in the
# sandbox) and `python -m blockgen.lm_eval`, lm-eval's own command with the model registered.
OTHER_PROGRAMS = {REPO / "tasks" / "sandbox" / "child.py", REPO / "blockgen" / "lm_eval" / "__main__.py"}


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every subcommand path of the parser: ("leaderboard",), ("leaderboard", "add"), ..."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += [(*path, name), *commands(sub, (*path, name))]
    return out


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exit:
            code = exit.code
    return code, out.getvalue(), err.getvalue()


def test_every_subcommand_answers_help():
    paths = commands(cli.build_parser())
    expected = {("train",), ("demo",), ("presets",), ("gpu-check",), ("train-scorer",), ("sample",), ("prepare-data",),
                ("hub-check",), ("train-cost",), ("import",), ("released",), ("released", "names"), ("released", "check"), ("released", "import"),
                ("sweep",), ("regression", "check"), ("regression", "update"),
                ("scorers", "check-vllm"), ("variants",), ("hub-standin",)}
    expected |= {("leaderboard", action) for action in ("add", "collect", "show", "plot", "page", "compare", "check")}
    assert expected <= set(paths), sorted(expected - set(paths))
    for path in paths:
        code, out, _ = run([*path, "--help"])
        assert code == 0 and out.startswith(f"usage: blockgen {' '.join(path)}"), (path, out[:200])


def test_one_table_lists_and_runs_every_subcommand():
    top = {path[0] for path in commands(cli.build_parser())}
    assert top == set(cli.SUBCOMMANDS), (sorted(top - set(cli.SUBCOMMANDS)), sorted(set(cli.SUBCOMMANDS) - top))
    for name, command in cli.SUBCOMMANDS.items():
        assert callable(command.mount(argparse.ArgumentParser(prog=f"blockgen {name}"))), name


def test_commands_that_read_json_do_not_import_torch(tmp_path):
    """Only the subcommand run is mounted: `blockgen --help` and the leaderboard, regression and curves commands
    answer without importing torch (about 1 s of CPU each time on a 2-core machine; CI runs them dozens of times)."""
    probe = ("import json, sys\n"
             "from blockgen.harness.cli import main\n"
             "try:\n"
             "    code = main(json.loads(sys.argv[1]))\n"
             "except SystemExit as exit:\n"
             "    code = exit.code\n"
             "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))\n")
    stored = str(REPO / "leaderboards" / "ci_regression.json")
    runs = {"help": ["--help"], "leaderboard show": ["leaderboard", "show", stored],
            "leaderboard page": ["leaderboard", "page", stored, "--out-dir", str(tmp_path / "page")],
            "regression check": ["regression", "check", "--against", stored, stored],
            "curves": ["curves", str(tmp_path / "run"), "--out", str(tmp_path / "curves.png")],
            "variants": ["variants", "arpc", "--nfe", "4"]}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 / s, "grad_norm": 1.0}) + "\n"
                                                             for s in range(1, 21)))
    for name, argv in runs.items():
        r = subprocess.run([sys.executable, "-c", probe, json.dumps(argv)], capture_output=True, text=True, timeout=HANG_S)
        verdict = json.loads(r.stdout.splitlines()[-1])
        assert verdict == {"code": 0, "torch": False}, (name, verdict, r.stderr[-2000:])
    assert "owt-embedded-ar" in (tmp_path / "page" / "index.html").read_text()  # the commands ran, not only parsed
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_no_option_overwrites_the_subcommand_it_belongs_to():
    """argparse writes every option into one namespace: an option whose dest is the top-level
    subcommand's (`regression update --command`, once) would send the run to no subcommand."""
    top = cli.build_parser()
    dest = next(a.dest for a in top._actions if isinstance(a, argparse._SubParsersAction))

    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    clashing = [(p.prog, a.option_strings) for p in parsers(top) if p is not top
                for a in p._actions if a.dest == dest]
    assert not clashing
    args = top.parse_args(["regression", "update", "a.json", "--command", "make x"])
    assert getattr(args, dest) == "regression" and args.command == "make x"


def test_no_module_is_a_program_of_its_own():
    """Only harness/cli.py builds an argument parser or runs as __main__ (torchrun -m blockgen.harness.cli)."""
    found = []
    for folder in ("harness", "models", "tasks", "blockgen"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == REPO / "harness" / "cli.py" or path in OTHER_PROGRAMS:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "__name__" \
                        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.comparators):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: if __name__ == '__main__'")
                if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "ArgumentParser":
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: ArgumentParser(...)")
    assert found == [], "\n".join(found)


def test_mounted_subcommands_run_their_modules(tmp_path):
    code, out, _ = run(["variants", "arpc", "--nfe", "4", "8"])
    assert code == 0 and out == "NFE 4: 3:2:1\nNFE 8: 6:3:0\n"  # each variant under the NFE it belongs to
    code, _, err = run(["variants", "arpc", "--nfe", "5"])
    assert code == 2 and "no arpc variant at NFE 5" in err
    code, out, _ = run(["released", "names"])
    assert code == 0 and "tinygsm-ar=baselines/tinygsm/ar" in out.split()
    code, _, err = run(["import", "a", "b", "--out-dir", str(tmp_path)])
    assert code == 2 and "--out-dir takes one spec" in err
    code, out, _ = run(["sweep", "gsm8k-embedded", "--dry-run"])
    assert code == 0 and out.startswith("# blockgen sweep:") and "total:" in out
    code, _, err = run(["regression", "check", "--against", str(tmp_path / "none"), "--results", str(tmp_path)])
    assert code == 2 and err.startswith("blockgen regression: error:") and "no stored outcomes" in err


def test_regression_check_is_leaderboard_check():
    """The older name stays; both run the same check on the stored reference against itself."""
    reference = REPO / "leaderboards" / "ci_regression.json"
    new = run(["regression", "check", str(reference), "--against", str(reference)])
    old = run(["leaderboard", "check", str(reference), "--against", str(reference)])
    assert new == old and new[0] == 0 and "passed" in new[1]


def test_installed_command_and_torchrun_module_are_the_same_program():
    """`blockgen` (the console script) and `python -m blockgen.harness.cli` (what torchrun launches)."""
    script = subprocess.run([str(BLOCKGEN), "variants", "eipc", "--nfe", "4"], capture_output=True, text=True, timeout=HANG_S)
    module = subprocess.run([sys.executable, "-m", "blockgen.harness.cli", "variants", "eipc", "--nfe", "4"],
                            capture_output=True, text=True, timeout=HANG_S)
    assert script.returncode == module.returncode == 0 and script.stdout == module.stdout == "NFE 4: 4:2:0\n"


def test_sample_on_a_device_it_cannot_use_gives_the_device_policys_message(tmp_path):
    """`blockgen sample --device cuda` on a CPU machine: the message every command gives (`resolve_device`),
    one line and exit 2, not torch's AssertionError; checked before the checkpoint is read."""
    import torch

    from blockgen.harness.runtime.distributed import resolve_device

    for device in ["gpu"] + ([] if torch.cuda.is_available() else ["cuda"]):
        with pytest.raises(ValueError) as policy:
            resolve_device(device)
        r = subprocess.run([str(BLOCKGEN), "sample", "--checkpoint", str(tmp_path / "nowhere"), "--prompt", "", "--device", device],
                           capture_output=True, text=True, timeout=HANG_S)
        assert r.returncode == 2 and r.stderr.strip() == f"blockgen sample: error: {policy.value}", r.stderr[-2000:]


def test_presets_is_a_table_and_json_on_request():
    import json

    from blockgen.harness.training.presets import PRESETS

    table = subprocess.run([str(BLOCKGEN), "presets"], capture_output=True, text=True, timeout=HANG_S)
    assert table.returncode == 0, table.stderr[-2000:]
    header, *rows, footer = table.stdout.splitlines()
    assert header.split()[:4] == ["name", "prior", "block", "sizes"] and "--json" in footer
    assert [row.split()[0] for row in rows] == list(PRESETS)  # one line per preset, in order
    ci = next(row for row in rows if row.startswith("ci "))
    assert ci.split() == ["ci", "masked", "1", "4", "0.5", "0.5", "blockgen", "micro", "128", "16", "40", "0.001", "wordproblems"]
    dumped = subprocess.run([str(BLOCKGEN), "presets", "--json"], capture_output=True, text=True, timeout=HANG_S)
    assert dumped.returncode == 0
    assert json.loads(dumped.stdout) == json.loads(json.dumps({name: c.to_dict() for name, c in PRESETS.items()}))


def test_a_bad_preset_lists_the_presets_once():
    """The usage line says NAME; the error names the valid presets once (it printed all of them twice)."""
    r = subprocess.run([str(BLOCKGEN), "train", "--preset", "nope"], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 2 and "[--preset NAME]" in r.stderr
    assert r.stderr.count("'owt-masked-mix'") == 1 and "invalid choice: 'nope'" in r.stderr.splitlines()[-1]


def test_a_bad_release_name_is_a_usage_error_naming_the_releases():
    """`released check` with a name that is no release: exit 2 naming the choices, before any hub is asked (it was
    exit 1, "the released checkpoints are needed here and unavailable")."""
    code, _, err = run(["released", "check", "owt-ar", "nope"])
    assert code == 2 and "invalid choice: 'nope'" in err and "'tinygsm-masked-mix'" in err


def test_help_speaks_of_what_the_user_controls():
    """No subcommand's --help points at the project's modules or internals (they are for developers)."""
    for name in sorted(cli.SUBCOMMANDS):
        out = io.StringIO()
        with redirect_stdout(out), pytest.raises(SystemExit):
            cli.main([name, "--help"])
        text = out.getvalue()
        assert not any(word in text for word in ("decided_on_rank0", "harness/", "this module")), (name, text[:3000])


@pytest.mark.parametrize("argv,message", [
    (["train-scorer", "--max-steps", "0"], "blockgen train-scorer: error: max_steps=0 (--max-steps); choose a whole number >= 1"),
    (["train-scorer", "--seq-len", "2"], "blockgen train-scorer: error: seq_len=2 (--seq-len)"),
    (["gpu-check", "--budget-s", "0"], "blockgen gpu-check: error: budget_s=0.0"),
    (["sweep", "ci-gsm8k", "--limit", "0", "--dry-run"], "blockgen sweep: limit=0 (--limit); choose a whole number >= 1"),
    (["demo", "--train-only", "--presets", "ci", "--max-steps", "0"], "blockgen demo: error: max_steps=0"),
])
def test_a_setting_no_run_can_use_is_one_line_before_anything_starts(argv, message, tmp_path, monkeypatch):
    """Settings the configs refuse (they crashed mid-run, or ran and did nothing): exit 2 with one line naming the
    flag, and nothing written (the default output folders are relative: this test runs in an empty folder)."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run(argv)
    assert code == 2 and err.startswith(message) and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []

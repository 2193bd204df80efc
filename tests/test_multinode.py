"""Training on several machines: the Makefile's rendezvous launch, the SLURM template of
docs/training.md run with stand-ins for SLURM, and the start-up check that every rank sees rank 0's
run directory (two processes started as two nodes whose run directories are different folders)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from limits import HANG_S

ROOT = Path(__file__).resolve().parents[1]


def make_dry_run(*args: str) -> str:
    done = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    return done.stdout


def launches(text: str) -> list[str]:
    return [line for line in text.splitlines() if "torchrun" in line and " train " in line]


def test_make_prints_a_rendezvous_launch_per_model_for_several_nodes():
    one_node = launches(make_dry_run("train-owt", "NGPU=8"))
    assert one_node and all("--standalone" in line and "--rdzv" not in line for line in one_node)
    for target, bench in (("train-owt", "owt"), ("train-tinygsm", "tinygsm")):
        text = make_dry_run(target, "NNODES=2", "NGPU=8", "MASTER_ADDR=node001", "RDZV_ID=77")
        lines = launches(text)
        assert lines and all("--standalone" not in line for line in lines)
        ids = []
        for line in lines:
            assert "--nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=node001:29500" in line and "--nproc_per_node=8" in line
            model = re.search(r"--preset (\S+)", line).group(1)
            ids.append(re.search(r"--rdzv-id=(\S+)", line).group(1))
            assert ids[-1] == f"77-{bench}-{model.split('-', 1)[1]}"
        assert len(set(ids)) == len(ids)  # consecutive models never share a rendezvous
        assert "prepare-data" in text  # node 0 prepares the data
        other_node = make_dry_run(target, "NNODES=2", "NGPU=8", "NODE_RANK=1")
        assert "prepare-data" not in other_node and "prepared by node 0" in other_node


def slurm_template() -> str:
    doc = (ROOT / "docs" / "training.md").read_text()
    section = doc.split("### Multi-node", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    (script,) = [b for b in blocks if b.startswith("#!/bin/bash") and "#SBATCH" in b]
    return script


def test_slurm_template_launches_torchrun_from_the_variables_slurm_sets(tmp_path):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames node[001-004]" ] && printf "node001\\nnode002\\nnode003\\nnode004\\n"\n')
    # srun: its own options, then the command, run once here (as for this node)
    (stubs / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    script = tmp_path / "train.sbatch"
    script.write_text(slurm_template())
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "MAKEFLAGS": "n", "SLURM_NNODES": "4",
           "SLURM_GPUS_ON_NODE": "8", "SLURM_NODEID": "2", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[001-004]",
           "SLURM_SUBMIT_DIR": str(ROOT), "BENCHMARK": "tinygsm"}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    lines = launches(done.stdout)
    assert lines, done.stdout
    for line in lines:
        assert "--nnodes=4 --rdzv-backend=c10d --rdzv-endpoint=node001:29500 --rdzv-id=4242-tinygsm-" in line
        assert "--nproc_per_node=8" in line and "--preset tinygsm-" in line
    assert "prepare-data" not in done.stdout and "node 2: the data is prepared by node 0" in done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.whole_machine
def test_two_nodes_without_a_shared_run_directory_stop_at_start(tmp_path):
    """Two processes as two machines (RANK 0 and 1, each LOCAL_RANK 0): the same relative --out-dir, but
    each in its own working directory, as two local disks; the data cache is shared (absolute)."""
    port, cache = free_port(), tmp_path / "shared-data"
    procs = []
    for rank in (0, 1):
        node = tmp_path / f"node{rank}"
        node.mkdir()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        cmd = [sys.executable, "-m", "blockgen.harness.cli", "train", "--preset", "ci", "--out-dir", "run", "--max-steps", "2",
               "--device", "cpu", "--data.cache-dir", str(cache)]
        procs.append(subprocess.Popen(cmd, cwd=node, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [(p.wait(timeout=HANG_S), p.stderr.read()) for p in procs]
    for rank, (code, err) in enumerate(results):
        assert code == 2, (rank, err[-3000:])
        assert "the ranks do not share one run directory" in err and "shared file system" in err, err[-3000:]
        assert "rank 1 on" in err and "no run token" in err
    assert (tmp_path / "node0" / "run" / ".run-token").is_file()
    assert not (tmp_path / "node1" / "run").exists()  # the second node's disk: nothing trained there
    assert not (tmp_path / "node0" / "run" / "metrics.jsonl").exists()  # stopped before the first step


def test_make_names_the_cause_when_the_grid_query_fails():
    """The Makefile asks the grid for its models; when that prints nothing, make stops with the command to run."""
    done = subprocess.run(["make", "-n", "train-owt", "OFFLINE=1", "PY=/nonexistent/python"], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 2 and "the grid's models are unknown" in done.stderr and "run make setup first" in done.stderr
    assert "expected at least one argument" not in done.stderr

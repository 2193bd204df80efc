"""The online path against a hub on the loopback (harness/checkpoints/hub_standin.py): the real `blockgen import` of a
release fetches its files and the gpt2 tokenizer over HTTP into a fresh hub cache, the hub's errors reach the user as
the client's exceptions, and with the stand-in stopped the command fails instead of reaching anywhere else.

The clients run in subprocesses with HF_ENDPOINT and HF_HOME set, as a user's shell sets them (huggingface_hub reads
both once, at import), and with the socket guard of tests/hub_client.py: a TCP connection off this machine is refused,
logged, and fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from blockgen.harness.checkpoints.hub_standin import HubStandin, publish
from hub_client import LOG_ENV, client_env

FIXTURES = Path(os.environ.get("BLOCKGEN_RELEASE_FIXTURES_GPT2",
                               Path(__file__).resolve().parents[2] / "shared/data/released-gpt2"))
RELEASE = "blockgen/multi_block_size/8/tiny/0.05_0.95/absorb"  # a release subfolder of the fixtures
needs_fixtures = pytest.mark.skipif(not (FIXTURES / RELEASE).is_dir(), reason=f"release fixtures not found at {FIXTURES}")
TOKEN = "hf_standin_token"

def _env(tmp_path: Path, endpoint: str, **extra: str) -> dict:
    return client_env(endpoint, tmp_path / "hf", tmp_path / "release-cache", tmp_path / "socket-guard",
                      tmp_path / "connections.log", **extra)


def _run(tmp_path: Path, env: dict, target: str, *args: str) -> subprocess.CompletedProcess:
    """`blockgen ARGS` or a Python script, in `env`'s socket guard: a connection off the machine fails the test."""
    command = [sys.executable, "-m", "blockgen.harness.cli"] if target == "blockgen" else [sys.executable, target]
    done = subprocess.run([*command, *args], env=env, capture_output=True, text=True, cwd=tmp_path)
    log = Path(env[LOG_ENV])
    assert not log.exists(), f"a connection left the machine: {log.read_text()}"
    return done


@pytest.fixture
def release_hub(tmp_path):
    """The stand-in with the release's files under their subfolder of jdeschena/blockgen and the gpt2 tokenizer."""
    root = tmp_path / "hub"
    publish(root, "models", "jdeschena/blockgen", {f"{RELEASE}/{n}": FIXTURES / RELEASE / n for n in ("config.json", "model.safetensors")})
    publish(root, "models", "gpt2", {p.name: p for p in (FIXTURES / "tokenizer").iterdir()})
    with HubStandin(root) as standin:
        yield standin


@needs_fixtures
def test_blockgen_import_fetches_a_release_and_its_tokenizer_from_the_hub(release_hub, tmp_path):
    """The real command online: the checkpoint it writes equals the one converted from the local fixture folder, the
    hub cache holds the fixture's bytes, and with the stand-in stopped the same command runs from that cache offline."""
    spec = f"hf:jdeschena/blockgen/{RELEASE}"
    online = _run(tmp_path, _env(tmp_path, release_hub.endpoint), "blockgen", "import", spec, "--tokenizer", "gpt2",
                  "--out-dir", str(tmp_path / "online"))
    assert online.returncode == 0, online.stderr
    local = _run(tmp_path, _env(tmp_path, release_hub.endpoint, HF_HUB_OFFLINE="1"), "blockgen", "import", str(FIXTURES / RELEASE),
                 "--tokenizer", str(FIXTURES / "tokenizer"), "--out-dir", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    a, b = load_file(tmp_path / "online" / "model.safetensors"), load_file(tmp_path / "local" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert json.loads((tmp_path / "online" / "tokenizer.json").read_text()) == json.loads((tmp_path / "local" / "tokenizer.json").read_text())
    cached = {p.name: p.read_bytes() for p in (tmp_path / "hf" / "hub").rglob("snapshots/*/**/model.safetensors")}
    assert cached == {"model.safetensors": (FIXTURES / RELEASE / "model.safetensors").read_bytes()}

    release_hub.stop()
    again = _run(tmp_path, _env(tmp_path, release_hub.endpoint, HF_HUB_OFFLINE="1"), "blockgen", "import", spec, "--tokenizer", "gpt2",
                 "--out-dir", str(tmp_path / "offline"))
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "offline" / "model.safetensors").read_bytes() == (tmp_path / "online" / "model.safetensors").read_bytes()


@needs_fixtures
def test_the_hubs_answers_reach_the_user_as_the_clients_errors(release_hub, tmp_path):
    """What is not there, a revision that does not exist and a gated repository: each the exception huggingface_hub
    raises against the real hub; `blockgen import` of a gated release says to log in or use a local copy, of a missing
    one names the file and the offline fix, each in one line."""
    publish(release_hub.root, "models", "org/gated", {"config.json": b"{}"}, token=TOKEN)
    script = tmp_path / "errors.py"
    script.write_text(
        "import json, sys\n"
        "from huggingface_hub import hf_hub_download\n"
        "out = {}\n"
        "for case, kwargs in [('file', dict(repo_id='gpt2', filename='absent.json')),\n"
        "                     ('revision', dict(repo_id='gpt2', filename='vocab.json', revision='no-such-branch')),\n"
        "                     ('repo', dict(repo_id='nobody/nothing', filename='config.json')),\n"
        "                     ('gated', dict(repo_id='org/gated', filename='config.json')),\n"
        "                     ('wrong token', dict(repo_id='org/gated', filename='config.json', token='hf_wrong')),\n"
        f"                     ('token', dict(repo_id='org/gated', filename='config.json', token='{TOKEN}'))]:\n"
        "    try:\n"
        "        out[case] = open(hf_hub_download(**kwargs)).read()\n"
        "    except Exception as err:\n"
        "        out[case] = type(err).__name__\n"
        "print(json.dumps(out))\n")
    done = _run(tmp_path, _env(tmp_path, release_hub.endpoint), str(script))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "file": "RemoteEntryNotFoundError", "revision": "RevisionNotFoundError", "repo": "RepositoryNotFoundError",
        "gated": "GatedRepoError", "wrong token": "GatedRepoError", "token": "{}"}
    gated = publish(tmp_path / "gated", "models", "jdeschena/blockgen", {f"{RELEASE}/config.json": b"{}"}, token=TOKEN)
    with HubStandin(gated.root) as gated_hub:
        refused = _run(tmp_path, _env(tmp_path, gated_hub.endpoint), "blockgen", "import", f"hf:jdeschena/blockgen/{RELEASE}")
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "gated: log in" in refused.stderr and "HF_TOKEN" in refused.stderr and "GatedRepoError" in refused.stderr
    assert "--local-dir DIR" in refused.stderr  # the local copy's way, as for any release the hub does not give
    missing = "blockgen/single_block_size/16/owt/absorb"
    absent = _run(tmp_path, _env(tmp_path, release_hub.endpoint), "blockgen", "import", f"hf:jdeschena/blockgen/{missing}")
    assert absent.returncode == 1 and len(absent.stderr.strip().splitlines()) == 1, absent.stderr
    assert "EntryNotFoundError" in absent.stderr and f"--include '{missing}/*'" in absent.stderr and "make demo" in absent.stderr


@needs_fixtures
def test_with_the_standin_stopped_a_download_fails_and_reaches_nowhere_else(release_hub, tmp_path):
    """The hub stopped mid-session: `blockgen import` ends with the offline fix, and (the guard of `_run`) no connection
    went anywhere but the loopback. About 25 s: huggingface_hub retries a refused connection five times with backoff
    before giving up, the wait a user sees too."""
    release_hub.stop()
    done = _run(tmp_path, _env(tmp_path, release_hub.endpoint), "blockgen", "import", f"hf:jdeschena/blockgen/{RELEASE}", "--tokenizer", "gpt2")
    assert done.returncode == 1, done.stderr
    assert "could not fetch" in done.stderr and "make demo" in done.stderr


GSM8K = Path(__file__).resolve().parents[2] / "shared/data/gsm8k/test.json"
# openai/gsm8k's README front matter: the configs and their data files, as on the hub (the train split left out)
GSM8K_CARD = b"""---
configs:
- config_name: main
  data_files:
  - split: test
    path: main/test-*
---
"""


@pytest.mark.skipif(not GSM8K.is_file(), reason=f"GSM8K's test split not found at {GSM8K}")
def test_gsm8k_code_loads_gsm8k_from_the_hub_as_parquet(tmp_path):
    """`datasets.load_dataset("openai/gsm8k", "main", split="test")`, the task's own loader, online: the README's configs,
    the tree listing and the parquet shard over HTTP give the same 1,319 rows as the local copy."""
    import pandas as pd

    rows = json.loads(GSM8K.read_text())
    shard = tmp_path / "test.parquet"
    pd.DataFrame({"question": [r["prompt"] for r in rows], "answer": [r["response_ground_truth"] for r in rows]}).to_parquet(shard)
    root = tmp_path / "hub"
    publish(root, "datasets", "openai/gsm8k", {"README.md": GSM8K_CARD, "main/test-00000-of-00001.parquet": shard})
    script = tmp_path / "load.py"
    checkpoint = Path(__file__).resolve().parents[1] / "leaderboards/ci_gsm8k/gsm-masked-mix/checkpoint"  # its tokenizer builds prompts
    script.write_text("import json, sys\nfrom blockgen.tasks.gsm8k_code import load_gsm8k\n"
                      "test = load_gsm8k(pretrained=sys.argv[1])['test']\n"
                      "print(json.dumps([test[0]['question'], test[len(test) - 1]['answer'], len(test)]))\n")
    with HubStandin(root) as hub:
        done = _run(tmp_path, _env(tmp_path, hub.endpoint), str(script), str(checkpoint))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [rows[0]["prompt"], rows[-1]["response_ground_truth"], 1319]


@needs_fixtures
def test_openwebtext_is_read_from_the_hubs_parquet_export_online(tmp_path):
    """`Skylion007/openwebtext` at `refs/convert/parquet` (`plain_text/train/NNNN.parquet`, as the hub's converter lays it
    out): `blockgen hub-check --presets owt-ar` finds its files and gpt2's tokenizer, and training's document split reads
    the shards in order, the last documents held out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"Document {i}. " + "words " * (i % 7 + 1) for i in range(60)]
    shards = [tmp_path / "0000.parquet", tmp_path / "0001.parquet"]
    pq.write_table(pa.table({"text": docs[:35]}), shards[0])
    pq.write_table(pa.table({"text": docs[35:]}), shards[1])
    root = tmp_path / "hub"
    publish(root, "models", "gpt2", {p.name: p for p in (FIXTURES / "tokenizer").iterdir()})
    script = tmp_path / "split.py"
    script.write_text("import json\nfrom blockgen.harness.data import sources\n"
                      "train, held_out = sources.document_split(sources.DataConfig(source='owt'))\n"
                      "print(json.dumps([list(train), list(held_out)]))\n")
    with HubStandin(root) as hub:
        absent = _run(tmp_path, _env(tmp_path, hub.endpoint), "blockgen", "hub-check", "--presets", "owt-ar")
        assert absent.returncode == 1 and "Skylion007/openwebtext" in absent.stderr, absent.stderr
        publish(root, "datasets", "Skylion007/openwebtext", {f"plain_text/train/{p.name}": p for p in shards},
                revision="refs/convert/parquet")
        check = _run(tmp_path, _env(tmp_path, hub.endpoint), "blockgen", "hub-check", "--presets", "owt-ar")
        assert check.returncode == 0, check.stderr
        done = _run(tmp_path, _env(tmp_path, hub.endpoint), str(script))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [docs[:54], docs[54:]]  # a small corpus: its last tenth held out


@needs_fixtures
def test_the_tiny_hub_serves_what_a_full_scale_run_loads(tmp_path):
    """`write_tiny_hub` (hub_standin_repos.py) under the real ids: the Makefile's pre-flight `blockgen hub-check` of the
    OWT and TinyGSM presets and the scorer passes; the datasets load through the project's loaders, the tokenizers and
    GPT-2 Large's architecture through transformers, and releases of both tokenizer layouts convert with the hub's
    tokenizers (no --tokenizer)."""
    from blockgen.harness.data.hub_standin_repos import write_tiny_hub

    root = tmp_path / "hub"
    assert write_tiny_hub(root, FIXTURES.parent) == ["Skylion007/openwebtext", "TinyGSM/TinyGSM", "openai/gsm8k", "gpt2",
                                                     "gpt2-large", "HuggingFaceTB/SmolLM-135M", "jdeschena/blockgen"]
    checkpoint = Path(__file__).resolve().parents[1] / "leaderboards/ci_gsm8k/gsm-masked-mix/checkpoint"
    script = tmp_path / "load.py"
    script.write_text(
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from blockgen.harness.data import sources\n"
        "from blockgen.tasks.gsm8k_code import load_gsm8k\n"
        "scorer = AutoModelForCausalLM.from_pretrained('gpt2-large')\n"
        "gpt2, smollm = AutoTokenizer.from_pretrained('gpt2'), AutoTokenizer.from_pretrained('HuggingFaceTB/SmolLM-135M')\n"
        "logits = scorer(torch.tensor([gpt2.encode('The cat sat.')])).logits\n"
        "tinygsm = sources.load_rows(sources.DataConfig(source='tinygsm'))\n"
        "train, held_out = sources.document_split(sources.DataConfig(source='owt'))\n"
        "print(json.dumps({'scorer': type(scorer).__name__, 'logits': logits.shape[-1], 'gpt2': [len(gpt2), gpt2.eos_token],\n"
        "                  'smollm': [len(smollm), smollm.vocab_size, smollm.pad_token], 'tinygsm': [len(tinygsm), sorted(tinygsm.column_names)],\n"
        "                  'gsm8k': len(load_gsm8k(pretrained=sys.argv[1])['test']), 'owt': [len(train), len(held_out)]}))\n")
    with HubStandin(root) as hub:
        env = _env(tmp_path, hub.endpoint)
        check = _run(tmp_path, env, "blockgen", "hub-check", "--presets", "owt-ar", "tinygsm-masked-mix", "--models", "gpt2-large")
        assert check.returncode == 0, check.stderr
        loaded = _run(tmp_path, env, str(script), str(checkpoint))
        assert loaded.returncode == 0, loaded.stderr
        imported = _run(tmp_path, env, "blockgen", "import", "owt-masked-mix", "tinygsm-masked-mix")
        assert imported.returncode == 0, imported.stderr
    got = json.loads(loaded.stdout.splitlines()[-1])
    assert got.pop("owt") == [72, 7] and got == {  # OWT's 79 documents, the last tenth held out
        "scorer": "GPT2LMHeadModel", "logits": 120, "gpt2": [120, "<|endoftext|>"], "smollm": [64, 64, "<pad>"],
        "tinygsm": [512, ["code", "question"]], "gsm8k": 64}
    assert len(imported.stdout.split()) == 2 and all((Path(p) / "model.safetensors").is_file() for p in imported.stdout.split())


def test_blockgen_hub_standin_prints_its_endpoint_and_serves_a_folder(tmp_path):
    """The command a user starts by hand: one `export HF_ENDPOINT=...` line, then the repositories under --root, and
    nothing outside it however the path is spelled."""
    import urllib.error
    import urllib.request

    publish(tmp_path / "hub", "datasets", "openai/gsm8k", {"main/test.jsonl": b'{"question": "1+1?"}\n'})
    server = subprocess.Popen([sys.executable, "-m", "blockgen.harness.cli", "hub-standin", "--root", str(tmp_path / "hub")],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline().strip()
        assert line.startswith("export HF_ENDPOINT=http://127.0.0.1:"), line
        endpoint = line.split("=", 1)[1]
        with urllib.request.urlopen(f"{endpoint}/api/datasets/openai/gsm8k") as answer:
            info = json.loads(answer.read())
        assert info["id"] == "openai/gsm8k" and [s["rfilename"] for s in info["siblings"]] == ["main/test.jsonl"]
        with urllib.request.urlopen(f"{endpoint}/datasets/openai/gsm8k/resolve/main/main/test.jsonl") as answer:
            assert answer.read() == b'{"question": "1+1?"}\n'
        (tmp_path / "secret.txt").write_text("outside the served folder")
        for escape in ("main/../../../../../secret.txt", "main/..%2F..%2F..%2F..%2F..%2Fsecret.txt", "..%2F..%2F../resolve/x"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"{endpoint}/datasets/openai/gsm8k/resolve/{escape}")
            assert refused.value.code == 404
    finally:
        server.terminate()
        server.wait()



def test_make_hub_standins_command_writes_the_tiny_repositories_without_fixtures(tmp_path):
    """`blockgen hub-standin --write-tiny-repos` (what `make hub-standin` runs) on a machine without the release fixtures:
    every repository but the releases, gpt2's tokenizer a byte-level BPE in GPT-2's files with its one special token."""
    import urllib.request

    server = subprocess.Popen([sys.executable, "-m", "blockgen.harness.cli", "hub-standin", "--root", str(tmp_path / "hub"),
                               "--write-tiny-repos"], stdout=subprocess.PIPE, text=True)
    try:
        wrote, export = server.stdout.readline(), server.stdout.readline().strip()
        assert wrote.startswith("# wrote Skylion007/openwebtext, TinyGSM/TinyGSM, openai/gsm8k, gpt2, gpt2-large, "
                                "HuggingFaceTB/SmolLM-135M under"), wrote
        endpoint = export.split("=", 1)[1]
        with urllib.request.urlopen(f"{endpoint}/api/models/gpt2/revision/main") as answer:
            files = {s["rfilename"] for s in json.loads(answer.read())["siblings"]}
        assert {"vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"} <= files
        with urllib.request.urlopen(f"{endpoint}/gpt2/resolve/main/tokenizer_config.json") as answer:
            config = json.loads(answer.read())
        assert config["eos_token"] == config["bos_token"] == "<|endoftext|>" and config.get("pad_token") is None
    finally:
        server.terminate()
        server.wait()


def test_hub_standin_refuses_a_fixtures_folder_without_the_release_layouts(tmp_path):
    """A wrong --release-fixtures is one line naming the folders it lacks, before any repository is written."""
    done = subprocess.run([sys.executable, "-m", "blockgen.harness.cli", "hub-standin", "--root", str(tmp_path / "hub"),
                           "--write-tiny-repos", "--release-fixtures", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert str(tmp_path / "released-gpt2") in done.stderr and not (tmp_path / "hub").exists()


def test_the_socket_guard_refuses_and_logs_a_connection_off_the_machine(tmp_path):
    """The guard every client of these tests runs with (tests/hub_client.py): a TCP connection to an address off this
    machine (TEST-NET-1, never routed) is refused before it is attempted, and logged; the loopback is let through."""
    env = _env(tmp_path, "http://127.0.0.1:9")
    script = ("import socket\n"
              "for address in (('192.0.2.1', 80), ('127.0.0.1', 9)):\n"
              "    try:\n        socket.create_connection(address, timeout=5)\n    except OSError as err:\n        print(address[0], err)\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=tmp_path)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("192.0.2.1 refused by the test's socket guard"), done.stdout + done.stderr
    assert lines[1].startswith("127.0.0.1") and "guard" not in lines[1]  # attempted: nothing listens on port 9
    assert "192.0.2.1" in (tmp_path / "connections.log").read_text()

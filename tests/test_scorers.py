"""Scorers for generative perplexity (`blockgen.harness.evaluation.scorers`) and the vLLM server they start
(`blockgen.harness.evaluation.vllm_server`).

- The scoring rule (windows, entropy) against brute-force definitions; the transformers scorer's
  batched log-probabilities against one unpadded pass per sequence.
- The vLLM server's lifecycle against a stand-in server (an OpenAI-compatible toy that spawns a child
  process, like vLLM's engine): start, health, stop of the whole process group, Ctrl-C, the death of
  the process that started it, a server that dies mid-run, a start that fails, a busy port.
- A real vLLM server (the `make vllm-env` environment) on the micro scorer: it agrees with the
  transformers scorer to 1e-3, and a server killed mid-run ends in a clear error with no process left.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from blockgen.harness.data.sources import DataConfig, document_split
from blockgen.harness.evaluation import vllm_server
from blockgen.harness.evaluation.scorer_config import ScorerConfig, ScorerError
from blockgen.harness.evaluation.scorers import (
    TransformersScorer,
    gen_ppl,
    open_scorer,
    score_texts,
    scoring_windows,
    unigram_entropy,
)
from blockgen.harness.training.train_scorer import ScorerTrainConfig, train_scorer
from blockgen.tasks.owt import reference_passages
from vllm_env import vllm_python

REPO = Path(__file__).resolve().parents[1]


def group_processes(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            pass
    return out


def wait_gone(pgid: int, timeout: float = 30.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (alive := group_processes(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


@pytest.fixture(scope="module")
def scorer_dir(tmp_path_factory) -> Path:
    """The micro offline scorer (context 64), trained for a few steps on the offline text."""
    work = tmp_path_factory.mktemp("scorer")
    cfg = ScorerTrainConfig(out_dir=str(work / "scorer"), seq_len=64, n_layers=2, max_steps=30,
                            data=DataConfig(source="text", vocab_size=384, cache_dir=str(work / "data"), n_val=8))
    return train_scorer(cfg, progress=False)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Held-out passages of several lengths (one to several scoring windows), an empty text and one
    with a special-token string, which the scorer reads as that special token (as the paper's pipeline
    retokenizes decoded samples: the EOS a length-L sample keeps is the scorer's EOS)."""
    passages = reference_passages(document_split(DataConfig(source="text"))[1], 400)
    return passages[:10] + [passages[10][:5], "", "end <|eos|> of text"]


# ------------------------------------------------------------------------------- the scoring rule


@pytest.mark.parametrize("n_ids,n", [(0, 8), (1, 8), (6, 8), (7, 8), (8, 8), (30, 8), (100, 31), (5, 2)])
def test_scoring_windows_score_every_token_once(n_ids, n):
    ids = list(range(100, 100 + n_ids))
    windows = scoring_windows(ids, prefix=-1, n=n)
    scored = []
    for w, c in windows:
        assert 1 <= c < len(w) <= n
        scored += w[c:]
        if len(scored) > n - 1:  # after the first window: the tokens right before, n - new of them
            assert len(w) == n and len(w) - c <= max(1, n // 2)
    assert scored == ids
    seq = [-1, *ids]
    for w, c in windows:  # a window is a contiguous piece of [prefix, ids]
        start = next(i for i in range(len(seq)) if seq[i : i + len(w)] == w)
        assert seq[start : start + len(w)] == w


def test_unigram_entropy():
    assert unigram_entropy([]) == 0.0 and unigram_entropy([5, 5, 5]) == 0.0
    assert unigram_entropy([1, 2, 3, 4]) == pytest.approx(math.log(4))
    ids = [1, 1, 2, 3, 3, 3]
    p = [2 / 6, 1 / 6, 3 / 6]
    assert unigram_entropy(ids) == pytest.approx(-sum(q * math.log(q) for q in p))


def test_scorer_config_from_metadata():
    cfg = ScorerConfig.from_metadata({"scorer": "vllm", "scorer_model": "m", "scorer_port": 8001, "pretrained": "x"})
    assert (cfg.backend, cfg.model, cfg.port) == ("vllm", "m", 8001)
    with pytest.raises(ValueError, match=r"scorer_modle.*valid: \['scorer', 'scorer_batch_size'"):
        ScorerConfig.from_metadata({"scorer_modle": "m"})
    with pytest.raises(ValueError, match="choose one of"):
        ScorerConfig.from_metadata({"scorer": "openai"})


def test_transformers_scorer_batches_like_single_passes(scorer_dir, texts):
    from transformers import GPT2LMHeadModel

    scorer = TransformersScorer(ScorerConfig(model=str(scorer_dir), batch_size=4))
    assert scorer.prefix_id == scorer.tokenizer.eos_token_id  # GPT-2 style: BOS == EOS
    model = GPT2LMHeadModel.from_pretrained(scorer_dir).eval()
    scores = score_texts(scorer, texts, progress=False)
    for text, score in zip(texts, scores):
        ids = scorer.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert score.tokens == len(ids) and score.entropy == pytest.approx(unigram_entropy(ids))
        total = 0.0
        for w, c in scoring_windows(ids, scorer.prefix_id, scorer.max_length):
            with torch.no_grad():
                lp = model(torch.tensor([w])).logits[0].log_softmax(-1)
            total += sum(lp[t - 1, w[t]].item() for t in range(c, len(w)))
        assert score.logprob == pytest.approx(total, rel=1e-5, abs=1e-5)
    assert scores[-2] == (0.0, 0, 0.0)  # the empty text
    last = scorer.tokenizer(texts[-1], add_special_tokens=False)["input_ids"]
    assert last.count(scorer.tokenizer.eos_token_id) == 1 and scores[-1].tokens == len(last)  # one token, not its characters
    assert gen_ppl(scores) == pytest.approx(math.exp(-sum(s.logprob for s in scores) / sum(s.tokens for s in scores)))


def test_missing_scorer_model_is_a_clear_error(tmp_path):
    for backend in ("transformers", "vllm"):
        with pytest.raises(ScorerError, match=r"no such directory[\s\S]*blockgen train-scorer"):
            open_scorer(ScorerConfig(backend=backend, model=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ScorerError, match="without config.json"):
        open_scorer(ScorerConfig(model=str(tmp_path / "empty")))


# ------------------------------------------------------------------------------- server lifecycle (stand-in)

FAKE_SERVER = textwrap.dedent('''
    """A stand-in for `python -m vllm.entrypoints.openai.api_server`: /health, /v1/models and
    /v1/completions (every prompt token gets log-probability -1), plus a child process, like vLLM's
    engine. FAKE_VLLM=fail: exits at start; die: exits at the first completion request."""
    import json, os, signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    mode = os.environ.get("FAKE_VLLM", "")
    print("fake vllm starting", args, flush=True)
    if mode == "fail":
        print("RuntimeError: fake engine failed to start", flush=True)
        sys.exit(3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    def stop(*_):
        child.kill()
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    time.sleep(float(os.environ.get("FAKE_VLLM_START", "0.5")))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            self._send({"data": [{"id": "scorer", "max_model_len": 16}]} if self.path == "/v1/models" else {})
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if mode == "die":
                os._exit(1)
            self._send({"choices": [{"index": i, "logprobs": {"token_logprobs": [None] + [-1.0] * (len(p) - 1)}}
                                    for i, p in enumerate(body["prompt"])]})
    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


@pytest.fixture()
def fake_vllm(tmp_path, monkeypatch) -> Path:
    """An 'interpreter' that passes the vLLM import probe and runs the stand-in server."""
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then exit 0; fi\nshift 2\n'
                      f'exec {sys.executable} {tmp_path / "fake_server.py"} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv("BLOCKGEN_VLLM_PYTHON", str(python))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # server logs kept after failures land here
    return python


def test_server_lifecycle_stops_the_whole_group(scorer_dir, texts, fake_vllm):
    with open_scorer(ScorerConfig(backend="vllm", model=str(scorer_dir))) as scorer:
        proc = scorer.server.process
        assert scorer.url.startswith("http://127.0.0.1:") and scorer.context == 16
        assert len(group_processes(proc.pid)) >= 2  # the server and its child
        scores = score_texts(scorer, texts[:3], progress=False)
        assert [s.logprob for s in scores] == [-float(s.tokens) for s in scores]
        log_path = scorer.server.log_path
    assert wait_gone(proc.pid) == []
    assert not log_path.exists()  # a clean stop leaves no log behind


def test_ctrl_c_stops_the_server(scorer_dir, fake_vllm):
    with pytest.raises(KeyboardInterrupt):
        with open_scorer(ScorerConfig(backend="vllm", model=str(scorer_dir))) as scorer:
            pgid = scorer.server.process.pid
            raise KeyboardInterrupt
    assert wait_gone(pgid) == []


def test_server_dies_when_its_parent_is_killed(scorer_dir, fake_vllm, tmp_path):
    script = (f"from blockgen.harness.evaluation.scorer_config import ScorerConfig\n"
              f"from blockgen.harness.evaluation.scorers import open_scorer\n"
              f"s = open_scorer(ScorerConfig(backend='vllm', model={str(scorer_dir)!r}))\n"
              f"print(s.server.process.pid, flush=True)\nimport time; time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(tmp_path)})
    server_pid = int(parent.stdout.readline())
    assert psutil.pid_exists(server_pid)
    parent.kill()  # SIGKILL: no atexit, no finally; the server gets SIGTERM from the kernel
    parent.wait()
    assert wait_gone(server_pid) == []


def test_server_that_dies_mid_run_is_a_clear_error(scorer_dir, texts, fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM", "die")
    scorer = open_scorer(ScorerConfig(backend="vllm", model=str(scorer_dir)))
    pgid = scorer.server.process.pid
    with pytest.raises(ScorerError, match=r"stopped answering[\s\S]*has exited \(code 1\)[\s\S]*server log"):
        score_texts(scorer, texts[:3], progress=False)
    assert wait_gone(pgid) == []
    scorer.close()


def test_a_scorer_given_the_url_of_a_server_this_process_started_shows_its_log(scorer_dir, texts, fake_vllm, monkeypatch):
    """A sweep starts one server and hands each setting its URL: when it fails, the error still names that server's
    state and log, and the log is kept after the sweep stops the server (it was deleted, leaving a path to nothing)."""
    from blockgen.harness.evaluation.vllm_server import VLLMServer

    monkeypatch.setenv("FAKE_VLLM", "die")
    server = VLLMServer(ScorerConfig(backend="vllm", model=str(scorer_dir)))
    url = server.start()
    try:
        scorer = open_scorer(ScorerConfig(backend="vllm", model=str(scorer_dir), url=url))
        with pytest.raises(ScorerError, match=r"stopped answering[\s\S]*has exited \(code 1\)[\s\S]*server log") as err:
            score_texts(scorer, texts[:3], progress=False)
        assert str(server.log_path) in str(err.value)
    finally:
        server.stop()
    assert server.log_path.is_file()
    server.log_path.unlink()


def test_failed_start_shows_the_server_log(scorer_dir, fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM", "fail")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ScorerError, match=r"exited with code 3 while starting[\s\S]*fake engine failed to start"):
        open_scorer(ScorerConfig(backend="vllm", model=str(scorer_dir)))
    assert {p.pid for p in psutil.Process().children(recursive=True)} - before == set()


def test_start_timeout_kills_the_server(scorer_dir, fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_START", "60")
    seen = []
    monkeypatch.setattr(vllm_server.VLLMServer, "log_tail", lambda self, lines=30: seen.append(self.process.pid) or "tail")
    with pytest.raises(ScorerError, match="did not become healthy within 2 s"):
        open_scorer(ScorerConfig(backend="vllm", model=str(scorer_dir), start_timeout=2))
    assert wait_gone(seen[0]) == []


def test_busy_port_is_a_clear_error(scorer_dir, fake_vllm):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        with pytest.raises(ScorerError, match=f"port {port} on 127.0.0.1 is in use"):
            open_scorer(ScorerConfig(backend="vllm", model=str(scorer_dir), port=port))
        assert {p.pid for p in psutil.Process().children(recursive=True)} - before == set()


def test_no_vllm_installed_is_a_clear_error(scorer_dir, monkeypatch):
    monkeypatch.setenv("BLOCKGEN_VLLM_PYTHON", sys.executable)  # the main environment has no vLLM
    with pytest.raises(ScorerError, match=r"vLLM is not installed for .*make vllm-env"):
        open_scorer(ScorerConfig(backend="vllm", model=str(scorer_dir)))
    monkeypatch.setenv("BLOCKGEN_VLLM_PYTHON", "/no/such/python")
    with pytest.raises(ScorerError, match="does not exist"):
        open_scorer(ScorerConfig(backend="vllm", model=str(scorer_dir)))


# ------------------------------------------------------------------------------- a real vLLM server


def test_real_vllm_agrees_with_transformers_then_dies_cleanly(scorer_dir, texts, monkeypatch):
    """The real vLLM server's scores equal the in-process transformers scorer's, and its process group is gone
    after. Over 30 s (about 30 s idle): a real vLLM engine starting on the CPU."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    config = ScorerConfig(backend="vllm", model=str(scorer_dir), vllm_python=vllm_python())
    want = score_texts(TransformersScorer(ScorerConfig(model=str(scorer_dir))), texts, progress=False)
    scorer = open_scorer(config)
    try:
        assert scorer.context == 64
        got = score_texts(scorer, texts, progress=False)
        assert [g.tokens for g in got] == [w.tokens for w in want]
        for g, w in zip(got, want):
            assert g.logprob == pytest.approx(w.logprob, rel=1e-3, abs=1e-4)
        assert gen_ppl(got) == pytest.approx(gen_ppl(want), rel=1e-3)
        # now the server dies mid-run: its main process is killed outright
        pgid = scorer.server.process.pid
        os.kill(pgid, signal.SIGKILL)
        with pytest.raises(ScorerError, match=r"(stopped answering|answered 5\d\d)[\s\S]*server log"):
            score_texts(scorer, texts, progress=False)
        assert wait_gone(pgid) == []
    finally:
        scorer.close()

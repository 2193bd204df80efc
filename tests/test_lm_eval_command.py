"""The real commands on the lm-eval model type `blockgen`: the unmodified `lm_eval` command (found via the
start-up hook) on four task types, `torchrun -m lm_eval` (two CPU ranks over gloo) agreeing with one
process, `python -m blockgen.lm_eval` without the hook, early failures, truncation reports, lm-eval's
`hf` model beside the hook, and the hook's cost. Checkpoints (`ckpts`): tests/lm_eval_checkpoints.py.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockgen.harness.checkpoints.checkpoint import checkpoint_hash
from limits import HANG_S
from lm_eval_checkpoints import one_thread  # noqa: F401 (autouse: one torch thread a test)


BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "OMP_NUM_THREADS": "1"}
TASKS = "blockgen_toy_cloze,blockgen_toy_ppl,blockgen_toy_gen,blockgen_toy_mc"


# ------------------------------------------------------------------------------ the real commands


def _run(cmd: list[str], timeout: int = HANG_S, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or ENV, cwd="/")
    return proc


def _results(out_dir: Path) -> dict:
    (path,) = out_dir.rglob("results_*.json")
    return json.loads(path.read_text())


def _eval_args(ckpt: Path, out: Path, limit: int = 4, batch: int = 3, tasks: str = TASKS) -> list[str]:
    return ["--model", "blockgen", "--model_args", f"pretrained={ckpt},k_mc=2,steps=4,seed=3",
            "--tasks", tasks, "--limit", str(limit), "--batch_size", str(batch),
            "--output_path", str(out), "--log_samples"]


@pytest.fixture(scope="session")
def single_process(ckpts, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("single")
    proc = _run([str(BIN / "lm_eval"), *_eval_args(ckpts["mixture"], out)])  # device: lm-eval's cuda:0 default
    assert proc.returncode == 0, proc.stderr[-3000:]
    if not torch.cuda.is_available():
        assert "CUDA is not available; using the CPU" in proc.stderr
    return {"results": _results(out), "out": out}


METRICS = {"blockgen_toy_cloze": ["perplexity,none", "acc,none"],
           "blockgen_toy_ppl": ["word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"],
           "blockgen_toy_gen": ["exact_match,none"],
           "blockgen_toy_mc": ["acc,none"]}


def test_lm_eval_command_runs_three_task_types(ckpts, single_process):
    results = single_process["results"]
    for task, metrics in METRICS.items():
        for metric in metrics:
            assert math.isfinite(results["results"][task][metric]), (task, metric)
    assert results["results"]["blockgen_toy_ppl"]["word_perplexity,none"] > 1
    info = results["config"]
    assert info["model_sha"] == checkpoint_hash(ckpts["mixture"])
    assert info["blockgen"]["block_sizes"] == [1, 8] and info["blockgen"]["block_weights"] == [0.2, 0.8]
    assert info["blockgen"]["k_mc"] == 2 and info["blockgen"]["seed"] == 3
    assert info["blockgen"]["sampler"]["name"] == "ancestral" and info["blockgen"]["sampler"]["steps"] == 4
    # recorded once, as run: no sampler default of the seed or the token budget beside the real ones
    assert "seed" not in info["blockgen"]["sampler"] and "max_new_tokens" not in info["blockgen"]["sampler"]
    # what each task really ran with (docs/lm_eval.md: "What the results JSON records")
    tasks = info["blockgen"]["tasks"]
    gen = tasks["blockgen_toy_gen"]["generate_until"]
    (row,) = gen["settings"]
    assert (row["sampler"], row["steps"], row["layout"], row["max_gen_toks"], row["block_size"]) == ("ancestral", 4, "grid", 8, 8)
    assert row["paper_nfe_per_block"] == row["model_calls_per_block"] == 4
    assert gen["model_calls"] == row["model_calls"] > 0 and gen["requests"] == row["requests"] == 4
    assert gen["truncated_requests"] == 0 and gen["generated_tokens"] > 0
    cloze = tasks["blockgen_toy_cloze"]["loglikelihood"]
    assert cloze["requests"] == 4 and cloze["k_mc"] == 2 and cloze["choice_docs"] == 0
    assert sorted(cloze["mc_stderr_by_doc"]) == ["0", "1", "2", "3"] and cloze["mc_stderr_mean"] >= 0
    mc = tasks["blockgen_toy_mc"]["loglikelihood"]
    assert mc["requests"] == 36 and mc["choice_docs"] == 4 and 0 <= mc["expected_seed_disagreement"] <= 0.5
    assert all(len(v) == 9 for v in mc["mc_stderr_by_doc"].values())
    assert tasks["blockgen_toy_ppl"]["loglikelihood_rolling"]["requests"] == 4
    (samples,) = single_process["out"].rglob("samples_blockgen_toy_gen_*.jsonl")
    for line in samples.read_text().splitlines():
        text = json.loads(line)["resps"][0][0]
        assert "\n" not in text and "." not in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_ranks_agree_with_one_process(ckpts, single_process, tmp_path):
    env = {**ENV, "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
           "-m", "lm_eval", *_eval_args(ckpts["mixture"], tmp_path, batch=2), "--device", "cpu"]
    proc = _run(cmd, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Building contexts for blockgen_toy_ppl on rank 1" in proc.stderr  # the work really was split
    dp, single = _results(tmp_path)["results"], single_process["results"]["results"]
    for task, metrics in METRICS.items():
        for metric in metrics:
            # equal up to float32 rounding: the two runs batch different windows together
            assert dp[task][metric] == pytest.approx(single[task][metric], rel=1e-6), (task, metric)
    assert _generated(tmp_path) == _generated(single_process["out"])  # the same texts, whatever the rank
    dp_tasks = _results(tmp_path)["config"]["blockgen"]["tasks"]  # rank 0 reports both ranks' work
    single_tasks = single_process["results"]["config"]["blockgen"]["tasks"]
    for task, kind in (("blockgen_toy_gen", "generate_until"), ("blockgen_toy_mc", "loglikelihood")):
        assert dp_tasks[task][kind]["requests"] == single_tasks[task][kind]["requests"]
    assert dp_tasks["blockgen_toy_gen"]["generate_until"]["generated_tokens"] == \
        single_tasks["blockgen_toy_gen"]["generate_until"]["generated_tokens"]
    dp_se, single_se = (t["blockgen_toy_mc"]["loglikelihood"]["mc_stderr_by_doc"] for t in (dp_tasks, single_tasks))
    assert sorted(dp_se) == sorted(single_se)
    for doc in single_se:
        assert dp_se[doc] == pytest.approx(single_se[doc], rel=1e-4, abs=1e-6)


def _generated(out: Path) -> dict[int, str]:
    (samples,) = out.rglob("samples_blockgen_toy_gen_*.jsonl")
    return {(row := json.loads(line))["doc_id"]: row["resps"][0][0] for line in samples.read_text().splitlines()}


def test_python_m_blockgen_lm_eval_without_the_hook(ckpts, single_process, tmp_path):
    """The fallback works with the start-up hook off; batch size 1 gives the numbers of batch size 3."""
    env = {**ENV, "BLOCKGEN_LM_EVAL_HOOK": "0"}
    proc = _run([sys.executable, "-m", "blockgen.lm_eval",
                 *_eval_args(ckpts["mixture"], tmp_path, batch=1, tasks="blockgen_toy_cloze"), "--device", "cpu"],
                env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = _results(tmp_path)["results"], single_process["results"]["results"]
    for metric in METRICS["blockgen_toy_cloze"]:
        assert got["blockgen_toy_cloze"][metric] == pytest.approx(want["blockgen_toy_cloze"][metric], rel=1e-6)
    probe = "from lm_eval.api.registry import get_model\ntry:\n get_model('blockgen')\nexcept ValueError:\n print('absent')"
    assert _run([sys.executable, "-c", probe], env=env).stdout.strip() == "absent"


def test_lm_eval_checks_gen_kwargs_and_chat_template_before_any_request(ckpts):
    """A bad gen_kwargs of a generation task listed after a log-likelihood task fails before any request
    runs; --apply_chat_template on a checkpoint without a chat template says so."""
    base = [str(BIN / "lm_eval"), "--model", "blockgen", "--model_args", f"pretrained={ckpts['mixture']}",
            "--tasks", "blockgen_toy_cloze,blockgen_toy_gen", "--limit", "1", "--device", "cpu"]
    proc = _run([*base, "--gen_kwargs", "steps=0"])
    assert proc.returncode != 0
    assert "blockgen, task blockgen_toy_gen: gen_kwargs" in proc.stderr and "steps=0; must be an integer >= 1" in proc.stderr
    assert "Running loglikelihood requests" not in proc.stderr and "Building contexts" not in proc.stderr
    proc = _run([*base, "--apply_chat_template"])
    assert proc.returncode != 0
    assert "has no chat template (BlockGen models are trained on plain text); run without --apply_chat_template" in proc.stderr


def test_lm_eval_truncation_is_reported(ckpts, tmp_path):
    """Prompts that do not fit (here: --num_fewshot 12 examples in a 64-token window) are cut with a
    warning that counts requests and tokens and names --num_fewshot; the results JSON counts them too."""
    proc = _run([str(BIN / "lm_eval"), "--model", "blockgen", "--model_args", f"pretrained={ckpts['mixture']},k_mc=2,steps=4",
                 "--tasks", "blockgen_toy_cloze,blockgen_toy_gen", "--limit", "2", "--device", "cpu",
                 "--num_fewshot", "12", "--output_path", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for kind, task in (("loglikelihood", "blockgen_toy_cloze"), ("generate_until", "blockgen_toy_gen")):
        assert f"blockgen {kind}, task {task}: 2 of 2 requests'" in proc.stderr
        counts = _results(tmp_path)["config"]["blockgen"]["tasks"][task][kind]
        assert counts["truncated_requests"] == 2 and counts["truncated_tokens"] > 0
    assert "the prompts carry --num_fewshot 12 examples: lower --num_fewshot" in proc.stderr


def test_lm_eval_bad_model_args_fail_early(ckpts, tmp_path):
    proc = _run([str(BIN / "lm_eval"), "--model", "blockgen", "--model_args",
                 f"pretrained={ckpts['mixture']},sampler=nope", "--tasks", "blockgen_toy_cloze", "--limit", "1"])
    assert proc.returncode != 0
    assert "unknown sampler 'nope'; choose one of ['ancestral', 'eipc', 'arpc', 'confidence_threshold', 'entropy_bounded', 'low_confidence', 'ar_greedy', 'ar_sample']" in proc.stderr


def test_hook_leaves_hf_model_working(ckpts, tmp_path):
    pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate (lm-eval[hf])")
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(ckpts["mixture"]))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    proc = _run([str(BIN / "lm_eval"), "--model", "hf", "--model_args", f"pretrained={tmp_path / 'gpt2'}",
                 "--tasks", "blockgen_toy_cloze", "--limit", "2", "--device", "cpu", "--output_path", str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert math.isfinite(_results(tmp_path / "out")["results"]["blockgen_toy_cloze"]["acc,none"])


def test_start_up_hook_is_cheap():
    """Python start-up imports only the hook (no torch, no lm-eval); lm-eval's own models stay registered."""
    proc = _run([sys.executable, "-X", "importtime", "-c", "pass"])
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "blockgen._lm_eval_hook" in imported
    assert not {m for m in imported if m.split(".")[0] in ("torch", "lm_eval", "numpy", "transformers")}
    probe = ("from lm_eval.api.registry import model_registry, get_model\n"
             "print(sorted(n for n in ('hf', 'vllm', 'dummy', 'blockgen') if n in model_registry))\n"
             "import sys; print('torch' in sys.modules)")
    assert _run([sys.executable, "-c", probe]).stdout.split() == ["['blockgen',", "'dummy',", "'hf',", "'vllm']", "False"]


def test_the_environment_report_is_made_once_per_process_and_folder(monkeypatch, tmp_path):
    """lm-eval's `add_env_info` (torch's collect_env, `pip list`) runs once per working directory of a process; every
    later result gets the same report, as lm-eval itself would have written it."""
    import lm_eval.evaluator
    import lm_eval.loggers.utils
    import torch.utils.collect_env

    import blockgen.lm_eval

    assert getattr(lm_eval.evaluator.add_env_info, "_blockgen_memo", False)  # installed by the start-up hook
    calls = []
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: calls.append(1) or f"report {len(calls)}")
    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lm_eval.loggers.utils.add_env_info)
    blockgen.lm_eval.remember_env_info(lm_eval.evaluator)
    expected: dict = {}
    lm_eval.loggers.utils.add_env_info(expected)  # lm-eval's own, unmemoised: "report 1"
    first, second, elsewhere = {}, {"kept": 1}, {}
    lm_eval.evaluator.add_env_info(first)
    lm_eval.evaluator.add_env_info(second)
    assert first == {**expected, "pretty_env_info": "report 2"} and second == {**first, "kept": 1} and len(calls) == 2
    monkeypatch.chdir(tmp_path)
    lm_eval.evaluator.add_env_info(elsewhere)
    assert elsewhere["pretty_env_info"] == "report 3" and len(calls) == 3


def test_hook_failures_are_warnings(monkeypatch):
    import blockgen.lm_eval
    from blockgen import _lm_eval_hook as hook

    def broken(module):
        raise RuntimeError("boom")

    monkeypatch.setattr(blockgen.lm_eval, "register_model", broken)
    with pytest.warns(RuntimeWarning, match="could not hook into lm_eval.api.registry .*boom"):
        hook._run("lm_eval.api.registry", object())


def test_bad_input_is_one_message_and_the_traceback_is_on_request(tmp_path):
    """A bad input through the real `lm_eval` command: the project's message as one block at the end of
    stderr, no traceback (BLOCKGEN_TRACEBACK=1 brings it back); a near-miss argument name gets a suggestion.
    lm-eval's own errors for another model type keep their traceback. Three real `lm_eval` processes (the command
    line is the point): 19 s in CI's run at 3805f29, with lm-eval's task index cached (blockgen/lm_eval/task_index.py),
    35-47 s before."""
    cmd = [str(BIN / "lm_eval"), "--model", "blockgen", "--tasks", "blockgen_toy_cloze", "--device", "cpu", "--model_args"]
    missing = _run([*cmd, f"pretrained={tmp_path / 'nope'}"])
    assert missing.returncode == 1 and "Traceback" not in missing.stderr, missing.stderr[-2000:]
    tail = missing.stderr.strip().splitlines()[-2:]
    assert tail == [f"lm_eval --model blockgen: error: pretrained={tmp_path / 'nope'}: checkpoint directory does not exist",
                    "(the traceback: rerun with BLOCKGEN_TRACEBACK=1)"]
    from blockgen.harness.evaluation.lm_eval_model.arguments import BlockGenLMArgs

    with pytest.raises(ValueError, match="'samplr': did you mean 'sampler'"):
        BlockGenLMArgs.parse({"pretrained": str(tmp_path), "samplr": "eipc"})
    again = _run([*cmd, f"pretrained={tmp_path / 'nope'}"], env={**ENV, "BLOCKGEN_TRACEBACK": "1"})
    assert again.returncode == 1 and "Traceback (most recent call last)" in again.stderr
    other = _run([str(BIN / "lm_eval"), "--model", "hf", "--model_args", f"pretrained={tmp_path / 'nope'}",
                  "--tasks", "blockgen_toy_cloze", "--device", "cpu"])
    assert other.returncode == 1 and "Traceback (most recent call last)" in other.stderr


def test_every_model_argument_is_in_the_docs_table():
    """docs/lm_eval.md's table lists every argument the unknown-argument error lists (release-only ones marked)."""
    from blockgen.harness.evaluation.lm_eval_model.arguments import BlockGenLMArgs

    doc = (Path(__file__).resolve().parents[1] / "docs" / "lm_eval.md").read_text()
    names = {name.strip() for line in doc.splitlines() if line.startswith("| ")
             for name in line.split("|")[1].split("/")}
    assert set(BlockGenLMArgs.user_args()) <= names, set(BlockGenLMArgs.user_args()) - names

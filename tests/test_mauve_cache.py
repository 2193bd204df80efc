"""MAUVE's inputs computed once and kept by reference (`blockgen.harness.evaluation.mauve_cache`, tasks/owt.py).

- The reference passages and their features are built once per process across a sweep's settings,
  and once across processes through the disk cache; another reference set or scorer rebuilds them.
- Samples files carry where the features are (file, row), never the vectors; MAUVE read back from the
  side files equals MAUVE of the inline vectors the task logged before.
- Hub loads are retried with backoff, then fail with one clear error naming the offline twin.

A 1-layer GPT-2 with a small BPE (seconds to build) is the scorer and, for the lm-eval run, the model.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from blockgen.harness.data import sources as data
from blockgen.harness.checkpoints import hub
from blockgen.harness.evaluation import mauve_cache, scorers
from blockgen.harness.data.sources import DataConfig
from blockgen.harness.evaluation.scorer_config import ScorerConfig, ScorerError
from blockgen.harness.evaluation.scorers import TransformersScorer, shared_scorers
from blockgen.tasks import owt

N = 12  # reference passages (= samples) per setting
CHARS = 300  # reference_chars


def _gpt2(out: Path, seed: int = 0) -> Path:
    """A 1-layer GPT-2 (context 64) with a byte-level BPE of 300 tokens, BOS = EOS as GPT-2's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(data.document_split(DataConfig(source="text"))[0][:100]), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(fast), n_positions=64, n_embd=32, n_layer=1, n_head=2,
                        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(out)
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def scorer_dir(tmp_path_factory) -> Path:
    return _gpt2(tmp_path_factory.mktemp("scorer"))


@pytest.fixture
def calls(monkeypatch):
    """A fresh process (nothing in memory) that counts reference builds and featurizer calls."""
    seen = SimpleNamespace(passages=0, featurized=[])
    split, featurize = data.document_split, TransformersScorer.features

    def walk(*args, **kwargs):  # what building reference passages costs: reading the held-out documents
        seen.passages += 1
        return split(*args, **kwargs)

    def features(self, texts, progress=True):
        seen.featurized.append(list(texts))
        return featurize(self, texts, progress=False)

    monkeypatch.setattr(data, "document_split", walk)
    monkeypatch.setattr(TransformersScorer, "features", features)
    monkeypatch.setattr(mauve_cache, "_MEMORY", {})
    return seen


def run_settings(cache: Path, config: ScorerConfig, settings: int = 1, **references) -> tuple[list[str], list[list[dict]]]:
    """What each owt_genppl setting of one sweep process does: build the task's documents, then score
    its own samples (here: distinct texts per setting) with the sweep's shared scorer."""
    options = {"source": "text", "num_samples": N, "reference_chars": CHARS, **references}
    records = []
    with shared_scorers():
        for k in range(settings):
            docs = owt.genppl_references(mauve_cache=str(cache), **options)
            texts = [d["reference"] for d in docs["test"]]
            samples = [f"setting {k}: {t[::-1][: 40 + 7 * i]}" for i, t in enumerate(texts)]
            records.append(owt.score_samples(samples, texts, config, cache))
    return texts, records


def reference_calls(seen, texts: list[str]) -> int:
    return sum(batch == texts for batch in seen.featurized)


# ------------------------------------------------------------------------------- computed once


def test_references_once_per_process_and_once_across_processes(tmp_path, scorer_dir, calls, monkeypatch):
    config = ScorerConfig(model=str(scorer_dir), batch_size=4)
    texts, records = run_settings(tmp_path / "cache", config, settings=3)
    assert len(texts) == N
    assert calls.passages == 1  # the held-out documents walked once for three settings
    assert reference_calls(calls, texts) == 1 and len(calls.featurized) == 1 + 3  # + each setting's samples
    files = {r["reference_features"].file for rs in records for r in rs}
    assert len(files) == 1 and Path(files.pop()).parent == (tmp_path / "cache" / mauve_cache.REFERENCES).resolve()

    monkeypatch.setattr(mauve_cache, "_MEMORY", {})  # another process: only the disk cache is left
    calls.featurized.clear()
    again, _ = run_settings(tmp_path / "cache", config, settings=2)
    assert again == texts and calls.passages == 1  # no new build
    assert calls.featurized == []  # no reference featurized; nor these samples, equal to the first run's (keyed by content)


def test_cache_follows_the_reference_set_and_the_scorer(tmp_path, scorer_dir, calls, monkeypatch):
    cache = tmp_path / "cache"
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"{i:02d}.txt").write_text(f"Document {i}.\n\n" + f"Paragraph of document {i}, words and more words. " * 6)
    config = ScorerConfig(model=str(scorer_dir), batch_size=4)

    def passages_and_reference_calls(config=config, **references) -> tuple[int, int]:
        monkeypatch.setattr(mauve_cache, "_MEMORY", {})  # each run: another process
        before, featurized = calls.passages, len(calls.featurized)
        texts, _ = run_settings(cache, config, **references)
        return calls.passages - before, sum(b == texts for b in calls.featurized[featurized:])

    local = {"data_path": str(docs / "*.txt")}
    assert passages_and_reference_calls() == (1, 1)
    assert passages_and_reference_calls() == (0, 0)
    assert passages_and_reference_calls(reference_chars=CHARS + 50) == (1, 1)
    assert passages_and_reference_calls(num_samples=N - 2) == (1, 1)
    assert passages_and_reference_calls(**local) == (1, 1)
    assert passages_and_reference_calls(**local) == (0, 0)
    (docs / "07.txt").write_text("Document 7, rewritten.\n\nOther words entirely. " * 5)  # the data changed
    assert passages_and_reference_calls(**local) == (1, 1)
    # another scorer (other weights in another folder), or other feature settings: features again, not passages
    other = _gpt2(tmp_path / "other-scorer", seed=1)
    assert passages_and_reference_calls(config=ScorerConfig(model=str(other), batch_size=4)) == (0, 1)
    assert passages_and_reference_calls(config=ScorerConfig(model=str(scorer_dir), batch_size=3)) == (0, 1)
    assert passages_and_reference_calls() == (0, 0)
    # the scorer retrained in place (its files rewritten)
    _gpt2(other, seed=2)
    assert passages_and_reference_calls(config=ScorerConfig(model=str(other), batch_size=4)) == (0, 1)


# ------------------------------------------------------------------------------- stored by reference


def inline_mauve(samples: list[str], references: list[str], config: ScorerConfig) -> float:
    """MAUVE as the task computed it before: per sample, the feature vectors inline as float lists."""
    import mauve

    scorer = TransformersScorer(config)
    items = [(f.tolist(), r.tolist()) for f, r in zip(scorer.features(samples, progress=False),
                                                       scorer.features(references, progress=False))]
    q = np.array([s for s, _ in items], dtype=np.float32)
    p = np.array([r for _, r in items], dtype=np.float32)
    return float(mauve.compute_mauve(p_features=p, q_features=q, device_id=-1, verbose=False).mauve)


def test_mauve_from_side_files_equals_mauve_of_inline_vectors(tmp_path, scorer_dir, monkeypatch):
    monkeypatch.setattr(mauve_cache, "_MEMORY", {})
    config = ScorerConfig(model=str(scorer_dir), batch_size=4)
    references = [d["reference"] for d in owt.genppl_references(source="text", num_samples=16, reference_chars=CHARS,
                                                                mauve_cache=str(tmp_path))["test"]]
    samples = [t[::-1][: 50 + 10 * i] for i, t in enumerate(references)]  # far from the references: MAUVE < 1
    records = owt.score_samples(samples, references, config, tmp_path)
    items = [owt.genppl_results({}, [r])["mauve"] for r in records]
    assert all(isinstance(v, (str, int, float)) for item in json.loads(json.dumps(items)) for row in item for v in row)
    side = owt.mauve_score(items)
    assert 0.0 < side < 1.0
    assert side == inline_mauve(samples, references, config)
    monkeypatch.setattr(mauve_cache, "_MEMORY", {})  # read back from disk alone (what rank 0 does)
    assert owt.mauve_score(json.loads(json.dumps(items))) == side  # also from the logged JSON form


# Three or more numbers in a row, as a logged vector reads (JSON list, or the str() lm-eval writes of a response).
VECTOR = re.compile(r"(-?\d+\.\d+(e[-+]?\d+)?,\s*){2,}-?\d+\.\d+")


def test_lm_eval_samples_file_points_to_side_files(tmp_path, scorer_dir, calls):
    """owt_genppl_embedded through lm-eval (`hf` model, --log_samples) twice in one process, as a sweep's
    settings: one reference build and one reference featurization; the samples file names rows of
    feature files, and MAUVE recomputed from the logged texts the old way equals the reported one."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    from blockgen.lm_eval import tasks_dir

    cache = tmp_path / "cache"
    metadata = {"pretrained": str(scorer_dir), "scorer_model": str(scorer_dir), "scorer_batch_size": 4, "num_samples": 6,
                "reference_chars": CHARS, "mauve_cache": str(cache)}
    logged = {}
    for temperature in (1.0, 0.7):
        out = tmp_path / f"T{temperature}"
        tracker = EvaluationTracker(output_path=str(out))
        results = lm_eval.simple_evaluate(
            model="hf", model_args={"pretrained": str(scorer_dir)}, tasks=["owt_genppl_embedded"], device="cpu",
            batch_size=6, gen_kwargs={"temperature": temperature, "do_sample": True}, log_samples=True,
            evaluation_tracker=tracker, bootstrap_iters=0,
            task_manager=TaskManager(include_path=str(tasks_dir()), include_defaults=False, metadata=metadata))
        samples = results.pop("samples")
        tracker.save_results_aggregated(results=results, samples=samples)
        tracker.save_results_samples(task_name="owt_genppl_embedded", samples=samples["owt_genppl_embedded"])
        (path,) = out.rglob("samples_owt_genppl_embedded_*.jsonl")
        lines = path.read_text().split("\n")  # JSON lines: generated text may hold other line breaks (U+2028, ...)
        rows = sorted((json.loads(line) for line in lines if line), key=lambda s: s["doc_id"])
        logged[temperature] = (results["results"]["owt_genppl_embedded"]["mauve,none"], rows)

    references = [s["doc"]["reference"] for s in logged[1.0][1]]
    assert calls.passages == 1 and reference_calls(calls, references) == 1
    config = ScorerConfig(model=str(scorer_dir), batch_size=4)
    for mauve, samples in logged.values():
        assert len(samples) == 6
        for i, s in enumerate(samples):
            for field in ("filtered_resps", "gen_ppl", "unigram_entropy", "mauve"):  # the doc's text may hold numbers
                assert not VECTOR.search(json.dumps(s[field])), (field, s[field])
            (file, row), (reference_file, reference_row) = s["mauve"]
            assert Path(file).parent == (cache / mauve_cache.SAMPLES).resolve() and Path(file).is_file()
            assert Path(reference_file).parent == (cache / mauve_cache.REFERENCES).resolve() and (row, reference_row) == (i, i)
            assert f"FeatureRow(file='{file}', row={row})" in s["filtered_resps"][0]  # lm-eval logs str(record)
        texts = [s["resps"][0][0] for s in samples]
        assert math.isfinite(mauve) and mauve == inline_mauve(texts, references, config)


def test_sweep_keeps_the_cache_under_its_results_root(tmp_path, scorer_dir, monkeypatch):
    """`blockgen sweep`: <results root>/mauve-cache unless $BLOCKGEN_MAUVE_CACHE or the metadata names one."""
    from blockgen.harness.evaluation import sweep

    monkeypatch.delenv(mauve_cache.CACHE_ENV, raising=False)
    metadata = {"scorer": "transformers", "scorer_model": str(scorer_dir), "num_samples": 2}
    pool = sweep._Scorers(metadata, "cpu", tmp_path / "results")
    try:
        given = pool.metadata_for("owt_genppl_embedded", metadata)
        assert given[mauve_cache.METADATA_KEY] == str(tmp_path / "results" / "mauve-cache")
        assert list((tmp_path / "results" / "mauve-cache" / mauve_cache.REFERENCES).glob("*.json"))  # the task was built there
        mine = {**metadata, mauve_cache.METADATA_KEY: str(tmp_path / "mine")}
        assert pool.metadata_for("owt_genppl_embedded", mine)[mauve_cache.METADATA_KEY] == str(tmp_path / "mine")
    finally:
        pool.close()
    monkeypatch.setenv(mauve_cache.CACHE_ENV, str(tmp_path / "env"))
    pool = sweep._Scorers(metadata, "cpu", tmp_path / "results")
    pool.close()
    assert pool.mauve_cache == str(tmp_path / "env")


# ------------------------------------------------------------------------------- the hub


@pytest.fixture
def online(monkeypatch):
    """As on a machine with the hub configured (no offline mode), with the backoff's waits recorded."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub, "_endpoint_resolves", lambda: True)  # this machine resolves no hub name
    waits = []
    monkeypatch.setattr(hub, "time", SimpleNamespace(sleep=waits.append))
    return waits


def raises(err: Exception, tries: list | None = None):
    """A loader that counts its calls in `tries` and raises `err`."""
    def load(*args, **kwargs):
        if tries is not None:
            tries.append(1)
        raise err
    return load


def test_hub_call_retries_with_backoff_then_fails_clearly(online):
    tries = []
    with pytest.raises(hub.HubUnavailableError) as err:
        hub.hub_call(raises(ConnectionError("Couldn't reach 'openwebtext' on the Hub"), tries), "dataset openwebtext",
                     hint="Offline: the embedded twin.")
    assert len(tries) == hub.HUB_TRIES == 3 and online == [hub.HUB_BACKOFF_S, 2 * hub.HUB_BACKOFF_S]
    assert f"did not answer in {hub.HUB_TRIES} tries" in str(err.value) and "Offline: the embedded twin." in str(err.value)

    flaky = iter([ConnectionError("reset"), TimeoutError("slow")])

    def recovers():
        for e in flaky:
            raise e
        return "rows"

    assert hub.hub_call(recovers, "dataset") == "rows"
    online.clear()
    for answer in (ValueError("Repo id must be in the form 'repo_name'"), OSError("not a model folder")):
        tries.clear()
        with pytest.raises(hub.HubUnavailableError):
            hub.hub_call(raises(answer, tries), "model x")
        assert len(tries) == 1 and online == []  # an answer, not an unreachable hub: no retry


def test_no_retry_where_the_hub_name_does_not_resolve_and_owt_ppl_names_its_twin(tmp_path, online, monkeypatch):
    """No network (the hub's host name does not resolve, as on this machine): one try, no waits; owt_ppl's
    error names `--tasks owt_ppl_embedded`, as owt_genppl's names its twin."""
    import datasets

    monkeypatch.undo()  # the real check first: the loopback resolves, a reserved .invalid name never does
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert hub._endpoint_resolves()
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")
    assert not hub._endpoint_resolves()
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub, "time", SimpleNamespace(sleep=online.append))
    monkeypatch.setattr(hub, "_endpoint_resolves", lambda: False)
    tries = []
    with pytest.raises(hub.HubUnavailableError):
        hub.hub_call(raises(ConnectionError("Couldn't reach 'openwebtext' on the Hub"), tries), "dataset openwebtext")
    assert len(tries) == 1 and online == []
    monkeypatch.setattr(datasets, "load_dataset", raises(ConnectionError("no route")))
    data._hub_rows.cache_clear()
    try:
        with pytest.raises(hub.HubUnavailableError, match=r"(?s)unreachable.*owt_ppl: the offline twin owt_ppl_embedded "
                                                         r"\(--tasks owt_ppl_embedded\)"):
            owt._held_out("owt", None, "owt_ppl")
    finally:
        data._hub_rows.cache_clear()
    assert online == []


def test_owt_references_and_scorer_from_an_unreachable_hub(tmp_path, online, monkeypatch):
    """The hub's OWT and GPT-2 Large: retried, then an error that points at owt_genppl_embedded; a hub
    load that succeeded is not repeated in the process."""
    import datasets
    import transformers

    monkeypatch.setattr(mauve_cache, "_MEMORY", {})
    monkeypatch.setattr(datasets, "load_dataset", raises(ConnectionError("no route")))
    data._hub_rows.cache_clear()
    with pytest.raises(hub.HubUnavailableError, match=r"(?s)did not answer in 3 tries.*unreachable.*owt_genppl_embedded"):
        owt.genppl_references(source="owt", num_samples=4, mauve_cache=str(tmp_path))
    assert not list(tmp_path.rglob("*.json"))  # nothing cached for a failed build

    answers = iter([ConnectionError("no route"), ConnectionError("no route"), "config", "never asked"])

    def from_pretrained(name, *args, **kwargs):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    scorers._hub_config.cache_clear()
    try:
        scorers.check_model("gpt2-large")  # the third try answers
        scorers.check_model("gpt2-large")  # once per process
        assert next(answers) == "never asked"
        monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", raises(OSError("We couldn't connect")))
        monkeypatch.setattr(hub, "_transient", lambda err: True)  # as huggingface_hub's LocalEntryNotFoundError
        with pytest.raises(ScorerError, match=r"(?s)did not answer in 3 tries.*unreachable.*owt_genppl_embedded"):
            scorers.check_model("other/scorer")
    finally:
        scorers._hub_config.cache_clear()
        data._hub_rows.cache_clear()

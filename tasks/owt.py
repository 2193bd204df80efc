"""lm-eval tasks ``owt_ppl`` and ``owt_genppl``, and their offline twins ``*_embedded``.

``owt_ppl`` (the paper's table 1): the held-out documents of the data source (`document_split`,
the split training validates on) are tokenized with the checkpoint's own tokenizer, joined with EOS
and cut into chunks of the checkpoint's length (`chunk_documents`, as training does); each chunk is
one document of the task and one request of type ``loglikelihood_windows`` with arguments
(text, token ids): the token ids are scored whole from position 0 with the log-sum-exp bound over
the checkpoint's block sizes, and the Jensen bound beside it; the decoded text is there for logs and
lm-eval's sample hashes only. No text is decoded and re-encoded, so the chunks are training's own, and
``--limit N`` scores the first N of them, the ones `blockgen train` validates on when N = n_val.
Metrics: ``perplexity`` = exp(total NLL / tokens) under the LSE bound, ``perplexity_jensen``, and
``nll`` / ``nll_jensen`` per token (what `blockgen train` logs as val_nll_lse / val_nll_jensen).
Needs ``--model blockgen`` (the checkpoint directory comes from ``pretrained=``).

``owt_genppl``: unconditional samples (the context is the model's BOS token) from any model type
(`OwtGenPPLTask`: a budget that fits the model, sampling by default), any sampler, NFE and
temperature (``--model_args`` or ``--gen_kwargs``), then, over all samples at once (a task
filter, so each torchrun rank scores its own share), under a scorer language model
(`blockgen.harness.evaluation.scorers`): ``gen_ppl`` (token-weighted; how tokens are counted is documented
there), ``unigram_entropy`` (mean per sample, nats), and ``mauve`` against as many held-out reference
passages, with features from the scorer model (its last hidden state, as MAUVE's own featurizer).

MAUVE is scored once per input (`blockgen.harness.evaluation.mauve_cache`): the reference passages are built
once per reference set (source and its files, ``num_samples``, ``reference_chars``) and their features
once per scorer, both cached on disk and, within a process (a sweep), in memory; each sample's
features go to a side file (``samples/<key>.npy`` in the cache folder), and a document's per-sample
results (``filtered_resps``, the ``mauve`` item; so the samples file of ``--log_samples`` and what
torchrun ranks gather) carry only the file and row (`FeatureRow`). The aggregation reads the rows back:
the same float32 vectors, so the same MAUVE as when the vectors travelled inline.

The scorer and the sample count come from the task's metadata, overridable with lm-eval's
``--metadata`` (JSON): ``scorer`` (transformers | vllm), ``scorer_model`` (directory or hub name),
``scorer_url``, ``scorer_device``, ``scorer_batch_size``, ``scorer_vllm_python``, ... (see
`scorer_config.ScorerConfig`), ``num_samples``, ``data_path`` (local files instead of the source's default text),
``mauve_cache`` (the cache folder; else $BLOCKGEN_MAUVE_CACHE, else ~/.cache/blockgen/mauve; `blockgen
sweep` names <results root>/mauve-cache). Hub loads (OWT, a hub scorer) are retried with backoff
(`harness.hub.hub_call`), then fail naming the offline twin.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_eval.api.instance import Instance
from lm_eval.api.task import ConfigurableTask

if TYPE_CHECKING:
    from blockgen.harness.evaluation.mauve_cache import MauvePair, ReferenceSet

log = logging.getLogger(__name__)

# The adapter method (and lm-eval request type) that scores exact token windows with both bounds.
WINDOW_REQUEST = "loglikelihood_windows"


def _dataset(rows: list[dict]):
    from datasets import Dataset, DatasetDict

    return DatasetDict({"test": Dataset.from_list(rows)})


def _data_config(source: str, data_path: str | None):
    from blockgen.harness.data.sources import DataConfig

    return DataConfig(source=source, path=data_path)


def _held_out(source: str, data_path: str | None, task: str) -> list[str]:
    """The source's held-out documents; where the hub cannot be reached, the error names the task's offline twin."""
    from blockgen.harness.checkpoints.hub import HubUnavailableError
    from blockgen.harness.data.sources import document_split

    try:
        return document_split(_data_config(source, data_path))[1]
    except HubUnavailableError as err:
        raise HubUnavailableError(f"{err}\n{task}: the offline twin {task}_embedded (--tasks {task}_embedded) reads the "
                                  f"embedded text (or --metadata '{{\"data_path\": FILES}}' local documents).") from err


# ------------------------------------------------------------------------------------ owt_ppl


def ppl_chunks(pretrained: str | None = None, source: str = "owt", data_path: str | None = None, **_metadata):
    """The checkpoint's held-out chunks: one document {"chunk": i, "text": decoded, "tokens": [...]} per chunk."""
    from blockgen.harness.checkpoints.checkpoint import CheckpointError, read_config
    from blockgen.harness.data.sources import chunk_documents
    from blockgen.harness.checkpoints.tokenizer import SpecialTokens, load_tokenizer, special_tokens

    need = ("owt_ppl scores a BlockGen checkpoint on its own token chunks with both bounds: "
            "run it with --model blockgen --model_args pretrained=<checkpoint directory>")
    if not pretrained:
        raise ValueError(need)
    try:
        config = read_config(pretrained)
    except CheckpointError as err:
        raise ValueError(f"{need} ({err})") from None
    tokenizer = load_tokenizer(pretrained)
    special = SpecialTokens.from_dict(config.special_tokens) if config.special_tokens else special_tokens(tokenizer)
    held_out = _held_out(source, data_path, "owt_ppl")
    chunks = chunk_documents(held_out, tokenizer, special, config.seq_len).tokens.tolist()
    return _dataset([{"chunk": i, "text": tokenizer.decode(c), "tokens": c} for i, c in enumerate(chunks)])


class YamlClassTask(ConfigurableTask):
    """A ConfigurableTask built from a YAML that names it with `class:` (a key TaskConfig rejects)."""

    def __init__(self, config: dict | None = None, **kwargs) -> None:
        super().__init__(config={k: v for k, v in (config or {}).items() if k != "class"}, **kwargs)


class OwtPPLTask(YamlClassTask):
    """One ``loglikelihood_windows`` request per chunk: (decoded text, token ids); the ids are scored."""

    def __init__(self, config: dict | None = None, **kwargs) -> None:
        super().__init__(config=config, **kwargs)
        self.OUTPUT_TYPE = WINDOW_REQUEST  # the evaluator groups (and pads, for torchrun) requests by it

    def construct_requests(self, doc: dict, ctx: str, **kwargs) -> Instance:
        kwargs.pop("apply_chat_template", None)
        kwargs.pop("chat_template", None)
        return Instance(request_type=WINDOW_REQUEST, doc=doc, arguments=(doc["text"], tuple(doc["tokens"])), idx=0, **kwargs)


def ppl_results(doc: dict, results: list) -> dict:
    """(log-likelihood, tokens) pairs: lm-eval's weighted_perplexity gives exp(total NLL / tokens)."""
    (lse_logprob, jensen_logprob), = results
    n = len(doc["tokens"])
    return {"perplexity": (lse_logprob, n), "perplexity_jensen": (jensen_logprob, n),
            "nll": (lse_logprob, n), "nll_jensen": (jensen_logprob, n)}


def nll_per_token(items: list[tuple[float, int]]) -> float:
    """-total log-likelihood / total tokens."""
    return -sum(ll for ll, _ in items) / sum(n for _, n in items)


# ------------------------------------------------------------------------------------ owt_genppl


def reference_passages(documents: list[str], max_chars: int) -> list[str]:
    """Held-out documents cut at blank lines into passages of at most max_chars characters
    (paragraphs packed in order; a longer paragraph is a passage of its own)."""
    passages = []
    for doc in documents:
        current = ""
        for paragraph in (p.strip() for p in doc.split("\n\n")):
            if not paragraph:
                continue
            if current and len(current) + 2 + len(paragraph) > max_chars:
                passages.append(current)
                current = ""
            current = f"{current}\n\n{paragraph}" if current else paragraph
        if current:
            passages.append(current)
    return passages


PASSAGE_RULE = 1  # bump when `reference_passages` cuts passages another way: cached passages are then ignored


def held_out_passages(references: ReferenceSet) -> list[str]:
    """The first `num_samples` passages of a reference set's held-out documents (`ReferenceSet`); walks
    every held-out document: 25.6 s per process at OWT's size, hence the cache in `genppl_references`."""
    held_out = _held_out(references.source, references.data_path, "owt_genppl")
    return reference_passages(held_out, references.reference_chars)[: references.num_samples]


def genppl_references(source: str = "owt", data_path: str | None = None, num_samples: int = 1024,
                      reference_chars: int = 4000, mauve_cache: str | None = None, **_metadata):
    """One document per sample, each carrying one held-out reference passage (for MAUVE). The passages
    are built once per reference set (`harness.mauve_cache.ReferenceSet`) and cached: in memory for the
    process, on disk under ``mauve_cache`` (else $BLOCKGEN_MAUVE_CACHE, else ~/.cache/blockgen/mauve)."""
    from blockgen.harness.evaluation.mauve_cache import REFERENCES, ReferenceSet, cache_dir, cached_texts

    references = ReferenceSet.of(source, data_path, num_samples, reference_chars, PASSAGE_RULE)
    passages = cached_texts(cache_dir(mauve_cache) / REFERENCES, references, lambda: held_out_passages(references))
    if len(passages) < references.num_samples:
        log.warning("owt_genppl: %d held-out reference passages, fewer than num_samples=%d; drawing %d samples",
                    len(passages), references.num_samples, len(passages))
    return _dataset([{"reference": p} for p in passages])


SAMPLE_LENGTHS = ("fixed", "eos")


def sample_length(metadata: dict) -> str:
    """How long an unconditional sample is: 'fixed', the paper's N sequences of length L (the whole
    budget, EOS kept as a token: a document boundary inside a sample, as in training's packed rows), or
    'eos', stopped at its first EOS. Default: 'fixed' for a BlockGen checkpoint; 'eos' for other model
    types, because lm-eval's hf backend always stops at EOS (it adds EOS to the stop strings)."""
    from blockgen.harness.checkpoints.checkpoint import CheckpointError, read_config
    from blockgen.tasks.model_info import model_path

    path = model_path(metadata)
    try:
        blockgen = path is not None and read_config(path) is not None
    except CheckpointError:
        blockgen = False
    value = metadata.get("sample_length") or ("fixed" if blockgen else "eos")
    if value not in SAMPLE_LENGTHS:
        raise ValueError(f"sample_length={value!r} in --metadata; choose from {list(SAMPLE_LENGTHS)}")
    if value == "fixed" and not blockgen:
        raise ValueError(f"sample_length='fixed' needs a BlockGen checkpoint ({path} is not one): lm-eval's other "
                         "model types stop at EOS; use sample_length='eos'")
    return value


class OwtGenPPLTask(YamlClassTask):
    """Unconditional generation (the context is the model's BOS: `unconditional_context`); all samples
    are scored at once after generation.

    For any model type: the budget is at most the model's length less that one token, and unless
    ``--model_args`` name a blockgen ``sampler`` (whose settings then rule) the requests ask to sample
    (``do_sample``) at the model argument ``temperature`` or 1.0, as the paper samples its AR
    baselines; ``--gen_kwargs`` still override both."""

    def __init__(self, config: dict | None = None, **kwargs) -> None:
        super().__init__(config=config, **kwargs)
        from blockgen.harness.evaluation.scorer_config import ScorerConfig
        from blockgen.harness.evaluation.scorers import check_before_start

        # Fail before any sample is drawn: a bad setting, a missing scorer model, no vLLM, a busy port.
        metadata = self.config.metadata or {}
        self.scorer_config = ScorerConfig.from_metadata(metadata)
        check_before_start(self.scorer_config)
        from blockgen.tasks.model_info import model_max_length, unconditional_context

        self._context = unconditional_context(metadata)
        self._max_length = model_max_length(metadata)
        # Into the task's generation_kwargs, so the results' configs record them; --gen_kwargs are
        # merged over them later by lm-eval and win.
        gen_kwargs = dict(self.config.generation_kwargs or {})
        if self._max_length is not None:
            gen_kwargs["max_gen_toks"] = self._budget(gen_kwargs)
        if "sampler" not in metadata and not {"do_sample", "temperature"} & set(gen_kwargs):
            gen_kwargs.update(do_sample=True, temperature=float(metadata.get("temperature") or 1.0))
        self.sample_length = sample_length(metadata)
        self.config.metadata = {**metadata, "sample_length": self.sample_length}  # the results record it
        if self.sample_length == "fixed":
            gen_kwargs["ignore_eos"] = True
        self.config.generation_kwargs = gen_kwargs

    def _budget(self, gen_kwargs: dict) -> int:
        """At most the model's length less the BOS context."""
        return min(int(gen_kwargs.get("max_gen_toks", self._max_length)), self._max_length - 1)

    def construct_requests(self, doc: dict, ctx: str, **kwargs):
        request = super().construct_requests(doc, ctx, **kwargs)
        for inst in request if isinstance(request, list) else [request]:
            context, gen_kwargs = inst.arguments
            if self._max_length is not None:  # a --gen_kwargs max_gen_toks must fit too
                gen_kwargs = {**gen_kwargs, "max_gen_toks": self._budget(gen_kwargs)}
            inst.arguments = (context or self._context, gen_kwargs)
        return request

    def apply_filters(self):
        super().apply_filters()
        from blockgen.harness.evaluation.mauve_cache import cache_dir

        config = self.scorer_config
        cache = cache_dir((self.config.metadata or {}).get("mauve_cache"))
        instances = self._instances or []
        for name in sorted({key for inst in instances for key in inst.filtered_resps}):
            samples = [_as_text(inst.filtered_resps[name]) for inst in instances]
            references = [inst.doc["reference"] for inst in instances]
            for inst, record in zip(instances, score_samples(samples, references, config, cache)):
                inst.filtered_resps[name] = record
        return instances


def _as_text(response: Any) -> str:
    return response[0] if isinstance(response, list) else response


def score_samples(samples: list[str], references: list[str], config, cache: Path | None = None) -> list[dict]:
    """Per sample: Gen PPL terms and unigram entropy under the scorer, and where its MAUVE features and
    its reference's are (`FeatureRow`s into files under `cache`, `harness.mauve_cache`; the reference
    features are computed once per reference set and scorer, and kept in memory for the sweep).
    Features come from the scorer model in process (vLLM serves no hidden states); it is freed before a
    vLLM server starts, except inside a sweep (`blockgen sweep`), whose settings share one copy
    (`scorers.borrow_featurizer`) and one server (``scorer_url``)."""
    from blockgen.harness.evaluation.mauve_cache import REFERENCES, SAMPLES, FeatureRow, cache_dir, features_file
    from blockgen.harness.evaluation.scorers import borrow_featurizer, open_scorer, score_texts

    cache = cache or cache_dir()
    with borrow_featurizer(config) as featurizer:
        identity = featurizer.feature_identity()
        sample_file = str(features_file(cache / SAMPLES, identity, samples, featurizer.features))
        reference_file = str(features_file(cache / REFERENCES, identity, references, featurizer.features, keep=True))
        if config.backend == "transformers":
            scores = score_texts(featurizer, samples)
    if config.backend != "transformers":
        with open_scorer(config) as scorer:
            scores = score_texts(scorer, samples)
    return [{"logprob": s.logprob, "tokens": s.tokens, "entropy": s.entropy,
             "features": FeatureRow(sample_file, i), "reference_features": FeatureRow(reference_file, i)}
            for i, s in enumerate(scores)]


def genppl_results(doc: dict, results: list) -> dict:
    """Gen PPL terms, entropy, and for MAUVE only where the features are (a `MauvePair` of file and row:
    the logged samples and the items gathered over ranks carry no vectors)."""
    from blockgen.harness.evaluation.mauve_cache import MauvePair

    record, = results
    return {"gen_ppl": (record["logprob"], record["tokens"]), "unigram_entropy": record["entropy"],
            "mauve": MauvePair(record["features"], record["reference_features"])}


def mauve_score(items: list[MauvePair]) -> float:
    """MAUVE (mauve-text) of the samples against the reference passages, on the scorer's features,
    read from the files the items name (`harness.mauve_cache.mauve_of`)."""
    from blockgen.harness.evaluation.mauve_cache import mauve_of

    return mauve_of(items)

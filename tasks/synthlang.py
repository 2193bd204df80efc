"""lm-eval tasks ``synthlang_gen`` and ``synthlang_nll``: the synthetic language with exact probabilities.

The language (`blockgen.harness.data.language`, ``--metadata '{"language": NAME or FILE}'``, default
"default") is a sparse Markov chain over word-like symbols, so every score is exact rather than
judged by another model. Both tasks read its fixed held-out documents (seed `language.TEST_SEED`, the
documents training validates on) and run on any model type whose tokenizer can spell its words.

- ``synthlang_gen`` (generate_until): the first ``prompt_symbols`` (15: with BOS, one block of 16) words of each of ``prompts``
  (128) documents; the model continues them by ``continuation_symbols`` (32) words. Scores:
  ``invalid_pairs``, the share of a continuation's word pairs the true process never produces (an
  unknown word, or two words the chain never joins; the first pair counts from the prompt's last word;
  a missing word counts as broken), averaged over prompts; ``invalid``, the share of continuations
  with any broken pair (the true process gives them probability 0); ``true_nll``, nats per word of the
  valid pairs under the true process (a sampler that matches the process scores the entropy rate,
  printed as ``entropy_rate``; lower means the samples collapse onto likely strings, higher means noise); ``unigram_tv`` and ``bigram_tv``, the total
  variation distance between the samples' word and word-pair frequencies and the process's exact
  marginals (unknown words count as mass outside them), beside ``*_tv_true``: what samples of the same
  size drawn from the true process itself score from the same prompts (the floor that finite samples
  leave); ``words``, the mean number of words per continuation. Sampling: unless ``--model_args``
  name a blockgen ``sampler``, requests sample at temperature 1.0 (``temperature`` model arg), as the
  scores compare the model's distribution with the process's.
- ``synthlang_nll`` (loglikelihood_rolling): ``documents`` (128) held-out documents scored whole
  (a BlockGen model: the log-sum-exp bound). Scores per word: ``nll`` (the model), ``true_nll``
  (the exact NLL of the same documents), ``nll_gap`` = nll - true_nll (an estimate of the KL divergence
  per word, >= 0 up to sampling noise), and ``entropy_rate``.

Before any request, the tasks check that the model's tokenizer (``pretrained=`` in ``--model_args``,
which lm-eval passes to tasks as metadata) spells every word: a word that does not come back from
encode-then-decode is refused by name.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import Counter
from typing import Any

import numpy as np

from blockgen.tasks.owt import YamlClassTask

log = logging.getLogger(__name__)
REFERENCE_SEED = 7  # the true process's own samples, for the *_tv_true floor


def _language(metadata: dict):
    return _load(str(metadata.get("language") or "default"))


@functools.lru_cache(maxsize=4)
def _load(name: str):
    """Loaded once per process: every document's score and every aggregation reads it."""
    from blockgen.harness.data.language import load_language

    return load_language(name)


def _held_out(metadata: dict, n: int) -> list[list[int]]:
    from blockgen.harness.data.language import document_rows

    return document_rows(_language(metadata), n).tolist()


def check_spelling(language, tokenizer) -> int:
    """The most tokens one word takes; refuses a tokenizer that does not spell a word, naming the first."""
    most = 0
    for word in language.words:
        ids = tokenizer.encode(" " + word, add_special_tokens=False)
        back = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if back.strip() != word:
            raise ValueError(f"the model's tokenizer cannot spell the language's word {word!r} (encodes to {ids}, "
                             f"decodes to {back!r}); train the model with the language's own tokenizer "
                             "(blockgen train --data.source language)")
        most = max(most, len(ids))
    return most


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive integer")
    return value


def _dataset(rows: list[dict]):
    from datasets import Dataset, DatasetDict

    return DatasetDict({"test": Dataset.from_list(rows)})


def load_prompts(prompts: int = 128, prompt_symbols: int = 15, continuation_symbols: int = 32, **metadata):
    from blockgen.harness.data.language import DOC_SYMBOLS

    for name, value in (("prompts", prompts), ("prompt_symbols", prompt_symbols), ("continuation_symbols", continuation_symbols)):
        _positive_int(name, value)
    if prompt_symbols > DOC_SYMBOLS:
        raise ValueError(f"prompt_symbols={prompt_symbols}: a held-out document has {DOC_SYMBOLS} words")
    language = _language(metadata)
    name = str(metadata.get("language") or "default")
    return _dataset([{"prompt": language.text(row[:prompt_symbols]), "before": row[prompt_symbols - 1],
                      "continuation_symbols": continuation_symbols, "language": name} for row in _held_out(metadata, prompts)])


def load_documents(documents: int = 128, **metadata):
    language = _language(metadata)
    rows = _held_out(metadata, _positive_int("documents", documents))
    name = str(metadata.get("language") or "default")
    return _dataset([{"text": language.text(row), "true_logprob": language.log_prob(row), "symbols": len(row), "language": name}
                     for row in rows])


class SynthLangTask(YamlClassTask):
    """Checks the model's tokenizer before any request. Generation: a budget of the continuation's
    words at the most tokens a word takes, within the model's length, sampling at temperature 1.0
    unless a blockgen sampler is named (``--gen_kwargs`` override both)."""

    def __init__(self, config: dict | None = None, **kwargs) -> None:
        super().__init__(config=config, **kwargs)
        metadata = self.config.metadata or {}
        self.language = _language(metadata)
        from blockgen.tasks.model_info import checkpoint_tokenizer, model_max_length, model_path

        path = model_path(metadata)
        if path is None:
            log.warning("%s: no pretrained= in the metadata; the model's tokenizer is not checked", self.config.task)
            return
        tokenizer, _ = checkpoint_tokenizer(path)
        tokens_per_word = check_spelling(self.language, tokenizer)
        if self.config.output_type != "generate_until":
            return
        gen_kwargs = dict(self.config.generation_kwargs or {})
        budget = tokens_per_word * int(metadata.get("continuation_symbols", 32))
        max_length = model_max_length(metadata, tokenizer)
        prompt_tokens = (tokens_per_word + 1) * int(metadata.get("prompt_symbols", 15))
        gen_kwargs.setdefault("max_gen_toks", budget if max_length is None else max(1, min(budget, max_length - prompt_tokens)))
        if "sampler" not in metadata and not {"do_sample", "temperature"} & set(gen_kwargs):
            gen_kwargs.update(do_sample=True, temperature=float(metadata.get("temperature") or 1.0))
        self.config.generation_kwargs = gen_kwargs


# ------------------------------------------------------------------------------------ scoring


def gen_results(doc: dict, results: list) -> dict:
    """A continuation's words (the first `continuation_symbols`) scored pair by pair under the true process,
    the first pair from the prompt's last word: a pair with an unknown word or probability 0 is broken, and so
    is each missing word of a short continuation."""
    language = _language(doc)
    n = doc["continuation_symbols"]
    words = results[0].split()[:n]
    ids = [language.index.get(w) for w in words]
    nll, valid = 0.0, 0
    for a, b in zip([doc["before"], *ids], ids):
        p = 0.0 if a is None or b is None else language.transitions[a, b]
        if p > 0:
            nll, valid = nll - math.log(p), valid + 1
    broken = n - valid
    item = {"language": doc["language"], "before": doc["before"], "ids": ids, "n": n}  # unknown words: None
    return {"invalid": float(broken > 0), "invalid_pairs": broken / n, "true_nll": (nll, valid), "unigram_tv": item,
            "unigram_tv_true": item, "bigram_tv": item, "bigram_tv_true": item, "words": len(words),
            "entropy_rate": language.entropy_rate}


def mean_nll(items: list[tuple[float, int]]) -> float:
    """NLL per word of the valid pairs, over all continuations."""
    valid = sum(n for _, n in items)
    return sum(nll for nll, _ in items) / valid if valid else math.nan


def _tv(counts: Counter, unknown: int, marginals: np.ndarray) -> float:
    total = sum(counts.values()) + unknown
    if not total:
        return math.nan
    seen = sum(abs(c / total - marginals[k]) for k, c in counts.items())
    unseen = float(marginals.sum()) - sum(marginals[k] for k in counts)
    return 0.5 * (seen + unseen + unknown / total)


def _grams(items: list[dict], n: int) -> tuple[Counter, int]:
    """n-gram counts of the continuations (pairs from the prompt's last word on), and the n-grams holding an
    unknown word (mass outside the marginals)."""
    counts: Counter = Counter()
    unknown = 0
    for item in items:
        ids = item["ids"] if n == 1 else [item["before"], *item["ids"]]
        for gram in (tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)):
            if None in gram:
                unknown += 1
            else:
                counts[gram if n > 1 else gram[0]] += 1
    return counts, unknown


def _true_items(items: list[dict]) -> list[dict]:
    language = _language(items[0])
    rng = np.random.default_rng(REFERENCE_SEED)
    n = max(item["n"] for item in items)
    rows = language.sample(len(items), n, rng, before=[item["before"] for item in items])
    return [{**item, "ids": row[: item["n"]].tolist()} for item, row in zip(items, rows)]


def _ngram_tv(items: list[dict], n: int) -> float:
    counts, unknown = _grams(items, n)
    marginals = _language(items[0]).ngram_marginals(n)
    return _tv(counts, unknown, marginals)


def unigram_tv(items: list[dict]) -> float:
    return _ngram_tv(items, 1)


def bigram_tv(items: list[dict]) -> float:
    return _ngram_tv(items, 2)


def unigram_tv_true(items: list[dict]) -> float:
    return _ngram_tv(_true_items(items), 1)


def bigram_tv_true(items: list[dict]) -> float:
    return _ngram_tv(_true_items(items), 2)


def constant(items: list[float]) -> float:
    return items[0] if items else math.nan


def nll_results(doc: dict, results: list) -> dict:
    (logprob,) = results
    item = (float(logprob), doc["true_logprob"], doc["symbols"])
    return {"nll": item, "true_nll": item, "nll_gap": item, "entropy_rate": _language(doc).entropy_rate}


def model_nll(items: list[tuple[float, float, int]]) -> float:
    return -sum(m for m, _, _ in items) / sum(n for _, _, n in items)


def true_nll(items: list[tuple[float, float, int]]) -> float:
    return -sum(t for _, t, _ in items) / sum(n for _, _, n in items)


def nll_gap(items: list[tuple[float, float, int]]) -> float:
    return model_nll(items) - true_nll(items)

"""A synthetic language whose probabilities are known exactly: the testbed with known answers.

The language is a stationary first-order Markov chain over word-like symbols ("kalo", "mibu", ...):
each symbol allows only a few successors (every other pair has probability 0, so a sample can be
*invalid*), with weights drawn from a Dirichlet. A sequence starts from the chain's stationary
distribution pi, so every position's marginal is pi and the n-gram marginals are
pi(a) P(a, b) P(b, c) ... exactly. From the parameters alone:

- `log_prob`: the exact log-probability of any sequence (optionally given the symbol before it);
- `entropy_rate`: h = -sum_a pi(a) sum_b P(a, b) log P(a, b), nats per symbol; a sequence of n symbols
  has expected NLL H(pi) + (n - 1) h;
- `ngram_marginals(n)`: the exact probability of every n-gram at any position;
- `dependence`: I(X_t; X_t+1) = H(pi) - h, how much one symbol constrains the next. `successors`
  bounds h by log(successors) while H(pi) stays near log(symbols): fewer successors, stronger
  dependence, and a sampler that draws a block's positions independently from their marginals
  breaks more pairs.

Training data are unlimited (`sample`, any seed); the tasks' test set is a fixed seeded draw.
A language is a registered `LanguageConfig` (`LANGUAGES`, by name) or a JSON file
{"words": [...], "transitions": [[...], ...]}; `MarkovLanguage` refuses a matrix that is not a
process (a row that does not sum to 1, a negative or non-finite entry), naming the row.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
ROW_TOLERANCE = 1e-9  # a row of the transition matrix must sum to 1 within this


@dataclass(frozen=True)
class LanguageConfig:
    """A generated language: `symbols` words, each with `successors` allowed next words whose
    probabilities are Dirichlet(`concentration`) (lower: more peaked, stronger dependence)."""

    symbols: int = 128
    successors: int = 4
    concentration: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 2 <= self.symbols <= (len(CONSONANTS) * len(VOWELS)) ** 2:
            raise ValueError(f"symbols={self.symbols}: need 2..{(len(CONSONANTS) * len(VOWELS)) ** 2}")
        if not 1 <= self.successors <= self.symbols:
            raise ValueError(f"successors={self.successors}: need 1..symbols ({self.symbols})")
        if not self.concentration > 0:
            raise ValueError(f"concentration={self.concentration}: need > 0")


# The registered languages. "default" was chosen by the positive control alone (docs/results.md,
# "A language with known answers"): ancestral sampling at NFE 1 per block resolved worse than at NFE 16.
LANGUAGES = {
    "default": LanguageConfig(),
    "tiny": LanguageConfig(symbols=5, successors=2, seed=1),  # small enough to enumerate (tests)
}


class LanguageError(ValueError):
    """Parameters that do not make a valid process, or text the language cannot read."""


@dataclass(frozen=True, eq=False)
class MarkovLanguage:
    words: tuple[str, ...]
    transitions: np.ndarray  # (V, V), row a: P(next = b | a)

    def __post_init__(self) -> None:
        p = np.asarray(self.transitions, dtype=np.float64)
        v = len(self.words)
        if p.shape != (v, v):
            raise LanguageError(f"transitions have shape {p.shape}; {v} words need ({v}, {v})")
        if len(set(self.words)) != v or any(not w or any(c.isspace() for c in w) for w in self.words):
            raise LanguageError("words must be distinct, non-empty and without whitespace")
        for a, row in enumerate(p):
            if not np.isfinite(row).all() or (row < 0).any():
                raise LanguageError(f"row {a} ({self.words[a]!r}) has a negative or non-finite probability")
            if abs(row.sum() - 1) > ROW_TOLERANCE:
                raise LanguageError(f"row {a} ({self.words[a]!r}) sums to {row.sum():.12g}, not 1"
                                    + (": no valid continuation from it" if row.sum() == 0 else ""))
        p.setflags(write=False)
        object.__setattr__(self, "transitions", p)
        object.__setattr__(self, "index", {w: i for i, w in enumerate(self.words)})

    # ------------------------------------------------------------------ exact quantities

    @functools.cached_property
    def stationary(self) -> np.ndarray:
        """pi with pi P = pi, sum 1; refused when it is not unique (a chain that is not irreducible)."""
        v = len(self.words)
        a = np.vstack([self.transitions.T - np.eye(v), np.ones(v)])
        b = np.zeros(v + 1)
        b[-1] = 1.0
        pi, *_ = np.linalg.lstsq(a, b, rcond=None)
        if np.linalg.matrix_rank(self.transitions.T - np.eye(v)) != v - 1:
            raise LanguageError("the chain has no unique stationary distribution (some words cannot reach others)")
        return np.clip(pi, 0, None) / np.clip(pi, 0, None).sum()

    @functools.cached_property
    def entropy_rate(self) -> float:
        p = self.transitions
        logs = np.log(np.where(p > 0, p, 1.0))
        return float(-(self.stationary * (p * logs).sum(1)).sum())

    @functools.cached_property
    def marginal_entropy(self) -> float:
        pi = self.stationary
        return float(-(pi[pi > 0] * np.log(pi[pi > 0])).sum())

    @property
    def dependence(self) -> float:
        """Mutual information of adjacent symbols, nats: H(pi) - h."""
        return self.marginal_entropy - self.entropy_rate

    def ngram_marginals(self, n: int) -> np.ndarray:
        """P(X_t..X_t+n-1 = a_1..a_n) at any t, as an array of n axes of size V."""
        out = self.stationary
        for _ in range(n - 1):
            out = out[..., None] * self.transitions.reshape((1,) * (out.ndim - 1) + self.transitions.shape)
        return out

    def log_prob(self, seq: Sequence[int], before: int | None = None) -> float:
        """log P(seq), or log P(seq | the symbol `before` it); -inf for an impossible sequence."""
        if not len(seq):
            return 0.0
        seq = np.asarray(seq)
        first = self.stationary[seq[0]] if before is None else self.transitions[before, seq[0]]
        probs = np.concatenate([[first], self.transitions[seq[:-1], seq[1:]]])
        with np.errstate(divide="ignore"):
            return float(np.log(probs).sum())

    # ------------------------------------------------------------------ samples and text

    def sample(self, n: int, length: int, rng: np.random.Generator, before: Sequence[int] | None = None) -> np.ndarray:
        """(n, length) symbol ids: from pi, or each row continuing from its symbol in `before`."""
        out = np.empty((n, length), dtype=np.int64)
        cumulative = np.cumsum(self.transitions, axis=1)
        state = rng.choice(len(self.words), size=n, p=self.stationary) if before is None else np.asarray(before)
        for t in range(length):
            if t or before is not None:  # inverse CDF of each row's next-word distribution
                u = rng.random(n) * cumulative[state, -1]
                state = np.minimum((cumulative[state] <= u[:, None]).sum(1), len(self.words) - 1)
            out[:, t] = state
        return out

    def text(self, seq: Sequence[int]) -> str:
        return " ".join(self.words[i] for i in seq)

    def parse(self, text: str) -> list[int]:
        """Symbol ids of a text of words; a word the language does not have raises `LanguageError`."""
        ids = []
        for word in text.split():
            if word not in self.index:
                raise LanguageError(f"{word!r} is not a word of the language")
            ids.append(self.index[word])
        return ids


def words_for(n: int, rng: np.random.Generator) -> tuple[str, ...]:
    """n distinct two-syllable words (consonant-vowel pairs), in a seeded order."""
    syllables = [c + v for c in CONSONANTS for v in VOWELS]
    pairs = rng.choice(len(syllables) ** 2, size=n, replace=False)
    return tuple(syllables[i // len(syllables)] + syllables[i % len(syllables)] for i in pairs)


def generate_language(config: LanguageConfig) -> MarkovLanguage:
    """A language from its config: each word's successors are the next word on a seeded cycle through
    all words (so every word reaches every other: one stationary distribution) and `successors - 1`
    others drawn at random, with Dirichlet(concentration) weights."""
    rng = np.random.default_rng(config.seed)
    v, k = config.symbols, config.successors
    words = words_for(v, rng)
    cycle = rng.permutation(v)
    p = np.zeros((v, v))
    for pos, a in enumerate(cycle):
        nxt = cycle[(pos + 1) % v]
        others = rng.choice(np.setdiff1d(np.arange(v), [nxt]), size=k - 1, replace=False)
        p[a, np.concatenate([[nxt], others])] = rng.dirichlet(np.full(k, config.concentration))
    p /= p.sum(1, keepdims=True)  # exact row sums after float rounding
    return MarkovLanguage(words, p)


def load_language(name: str) -> MarkovLanguage:
    """A registered language (`LANGUAGES`) or a JSON file {"words": [...], "transitions": [[...]]}."""
    if name in LANGUAGES:
        return _registered(name)
    path = Path(name)
    if not path.is_file():
        raise LanguageError(f"unknown language {name!r}: choose one of {sorted(LANGUAGES)} or a JSON file with "
                            '{"words": [...], "transitions": [[...], ...]}')
    spec = json.loads(path.read_text())
    return MarkovLanguage(tuple(spec["words"]), np.asarray(spec["transitions"], dtype=np.float64))


@functools.lru_cache(maxsize=None)
def _registered(name: str) -> MarkovLanguage:
    return generate_language(LANGUAGES[name])


def language_identity(name: str) -> str:
    """What a language's data depend on (cache keys): a registered config, or a file's content."""
    if name in LANGUAGES:
        return repr(LANGUAGES[name])
    import hashlib

    return hashlib.sha256(Path(name).read_bytes()).hexdigest()


# Documents of DOC_SYMBOLS symbols: with BOS and EOS, one framed example of 64 tokens when a word is one
# token (the local tokenizer). Training documents are drawn with the data seed; the held-out
# documents (validation, the tasks' test set) with TEST_SEED, the same for every training run.
DOC_SYMBOLS = 61
TEST_SEED = 1_000_003


def document_rows(language: MarkovLanguage, n: int, seed: int = TEST_SEED) -> np.ndarray:
    """(n, DOC_SYMBOLS) word ids of n documents drawn with `seed` (default: the held-out set's)."""
    return language.sample(n, DOC_SYMBOLS, np.random.default_rng(seed))


def documents(language: MarkovLanguage, n: int, seed: int) -> list[str]:
    return [language.text(row) for row in document_rows(language, n, seed)]


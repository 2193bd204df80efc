"""Scorer language models for generative perplexity: one small interface, two backends.

    with open_scorer(ScorerConfig(backend="vllm", model="runs/scorer-text")) as scorer:
        scores = score_texts(scorer, samples)          # Gen PPL terms and unigram entropy per text

- ``transformers``: the model in this process (``AutoModelForCausalLM``), batched.
- ``vllm``: an OpenAI-compatible vLLM server, started and stopped by the harness (`vllm_server`: its
  lifecycle, the vLLM build and its flags on a GPU), or with ``url=...`` one that is already running.
  Prompt log-probabilities come from ``/v1/completions`` with ``echo=true, max_tokens=0, logprobs=0``
  (vLLM >= 0.6).

The settings, the error and the count of starts are in `scorer_config`.

A sweep (`blockgen sweep`) scores all its settings with one model: inside `shared_scorers()`,
`borrow_featurizer` hands out one in-process copy per scorer config instead of loading one per call.

How a text is scored (`score_texts`), identical for both backends:
- the text is re-tokenized with the scorer's tokenizer, special-token strings in it read as plain
  text (a sample never carries an EOS: generation stops before it and decoding drops special tokens);
- the first token is conditioned on the scorer's BOS token (GPT-2: ``<|endoftext|>``, its document
  separator), so every token of the text is scored and nothing else is;
- a text is scored in windows of at most w = n - 1 tokens, n the scorer's context (vLLM keeps one
  position for the token it must generate when it echoes a prompt; the transformers scorer uses the
  same windows, so both give the same numbers): the first window is BOS and w - 1 tokens, each later
  one scores at most w // 2 new tokens behind the tokens just before them;
- Gen PPL over a set of texts is exp(-sum of log-probabilities / sum of tokens) (token-weighted);
  the unigram entropy of a text is that of its scorer tokens' empirical distribution, in nats.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import math
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

from tqdm.auto import tqdm

from blockgen.harness.evaluation.scorer_config import STARTS, ScorerConfig, ScorerError
from blockgen.harness.evaluation.vllm_server import (
    SERVED_NAME,
    VLLMServer,
    check_port_free,
    check_vllm_installed,
    started_here,
    vllm_python,
)

FEATURE_RULE = 1  # bump when `TransformersScorer.features` computes features another way: cached ones are then ignored


class TextScore(NamedTuple):
    logprob: float  # sum of log p(token | tokens before it) over the text's scorer tokens
    tokens: int  # how many tokens were scored
    entropy: float  # unigram entropy of the text's scorer tokens (nats); 0 for an empty text


# ------------------------------------------------------------------------------- the interface


class Scorer:
    """A causal language model that returns log-probabilities of given token sequences."""

    config: ScorerConfig
    tokenizer: Any
    context: int  # the model's context length n

    @property
    def max_length(self) -> int:
        """The longest window scored (n - 1: see the module docstring)."""
        return self.context - 1

    @property
    def prefix_id(self) -> int:
        """The token the first token of a text is conditioned on: BOS, else EOS (GPT-2: the same)."""
        tok = self.tokenizer
        return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id

    def sequence_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """For each sequence x, [log p(x_t | x_<t) for t = 1 .. len(x) - 1]."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> "Scorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_scorer(config: ScorerConfig) -> Scorer:
    """The scorer a config names; fails before any server starts when its model cannot be found."""
    check_before_start(config)
    if config.backend == "transformers":
        return TransformersScorer(config)
    return VLLMScorer(config)


_shared: dict[ScorerConfig, "TransformersScorer"] | None = None  # the pool while `shared_scorers` is open


def _featurizer_config(config: ScorerConfig) -> ScorerConfig:
    """The in-process model a config's features (and transformers scores) come from; fields that only
    concern a vLLM server do not tell two of them apart."""
    return replace(config, backend="transformers", url=None, port=0, vllm_python=None, vllm_args="",
                   vllm_dtype="auto", start_timeout=0.0)


@contextlib.contextmanager
def shared_scorers() -> Iterator[None]:
    """Within: `borrow_featurizer` keeps one in-process scorer per config for every caller, freed at exit."""
    global _shared
    outer, _shared = _shared, ({} if _shared is None else _shared)
    try:
        yield
    finally:
        if outer is None:
            _shared = None


@contextlib.contextmanager
def borrow_featurizer(config: ScorerConfig) -> Iterator["TransformersScorer"]:
    """The scorer model in this process (MAUVE's features; the scores too for the transformers
    backend): the shared copy inside `shared_scorers`, else a fresh one freed when the block ends."""
    key = _featurizer_config(config)
    if _shared is not None:
        if key not in _shared:
            _shared[key] = TransformersScorer(key)
        yield _shared[key]
        return
    scorer = TransformersScorer(key)
    try:
        yield scorer
    finally:
        del scorer


def check_before_start(config: ScorerConfig) -> None:
    """What can be checked in a second: the model exists; for vLLM, that it is installed and the port is free."""
    check_model(config.model)
    if config.backend == "vllm" and not config.url:
        check_vllm_installed(vllm_python(config.vllm_python))
        if config.port:
            check_port_free(config.port)


SCORER_OFFLINE_HINT = ("The Hugging Face hub is unreachable from this machine (or the name is wrong). Without the hub, "
                       "the offline twin owt_genppl_embedded scores with the small scorer of `blockgen train-scorer`; "
                       "or name a local copy with --metadata '{\"scorer_model\": DIR}'.")


def from_folder_or_hub(load: Callable[[], Any], model: str) -> Any:
    """A scorer model's part (config, tokenizer, weights): a local folder as is; a hub name retried
    while the hub does not answer (`hub.hub_call`), ending in a ScorerError that names the offline twin."""
    from blockgen.harness.checkpoints.hub import HubUnavailableError, hub_call

    if Path(model).is_dir():
        return load()
    try:
        return hub_call(load, f"scorer model {model!r} from the Hugging Face hub", hint=SCORER_OFFLINE_HINT)
    except HubUnavailableError as err:
        raise ScorerError(str(err)) from None


def check_model(model: str) -> None:
    """A scorer model is a local Hugging Face directory, or a hub name that resolves."""
    if Path(model).is_dir():
        if not (Path(model) / "config.json").is_file():
            raise ScorerError(f"scorer model {model!r} is a directory without config.json (not a Hugging Face model)")
        return
    if model.startswith(("/", ".", "~")) or model.count("/") > 1 or ("/" in model and Path(model).parent.is_dir()):
        raise ScorerError(f"scorer model {model!r}: no such directory. Train the small offline scorer there with "
                          f"`blockgen train-scorer --out-dir {model}`, or name an existing directory with "
                          f"--metadata '{{\"scorer_model\": DIR}}'.")
    _hub_config(model)


@functools.lru_cache(maxsize=None)
def _hub_config(model: str):
    """A hub scorer's config, fetched once per process (every setting of a sweep checks its scorer)."""
    from transformers import AutoConfig

    return from_folder_or_hub(lambda: AutoConfig.from_pretrained(model), model)


def scorer_tokenizer(model: str):
    """The scorer's tokenizer: a local folder's as it is now, a hub scorer's fetched once per process
    (each setting of a sweep opens its scorer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model) if Path(model).is_dir() else _hub_tokenizer(model)


@functools.lru_cache(maxsize=None)
def _hub_tokenizer(model: str):
    from transformers import AutoTokenizer

    return from_folder_or_hub(lambda: AutoTokenizer.from_pretrained(model), model)


def model_identity(model: str) -> list:
    """A scorer model's files by `data.file_id` (path, size, modification time): a local folder, or the
    hub snapshot it loads from (its path names the commit); a hub name never downloaded: the name."""
    from blockgen.harness.checkpoints.hub import file_id

    folder = Path(model)
    if not folder.is_dir():
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json")
        if not isinstance(found, str):
            return [model]
        folder = Path(found).parent
    return [file_id(f) for f in sorted(folder.rglob("*")) if f.is_file()]


def scoring_windows(ids: Sequence[int], prefix: int, n: int) -> list[tuple[list[int], int]]:
    """(window, n_context) pairs of at most n tokens that score each of `ids` exactly once.

    The first window is [prefix, ids[0..n-2]] (scores from position 1); each later one ends at most
    n // 2 tokens further and scores only its new tokens, behind the n - new tokens before them.
    """
    seq = [prefix, *ids]
    if not ids:
        return []
    out = [(seq[:n], 1)]
    end, stride = min(n, len(seq)), max(1, n // 2)
    while end < len(seq):
        new_end = min(end + stride, len(seq))
        start = new_end - n
        out.append((seq[start:new_end], end - start))
        end = new_end
    return out


def unigram_entropy(ids: Sequence[int]) -> float:
    """Entropy (nats) of the empirical token distribution of one sequence (the paper's H_1)."""
    if not ids:
        return 0.0
    n = len(ids)
    return -sum(c / n * math.log(c / n) for c in collections.Counter(ids).values())


def tokenize_texts(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Scorer tokens of texts. A special-token string inside a text is that special token, as when the
    paper's pipeline retokenizes decoded samples: the EOS a length-L sample keeps (owt_genppl's
    sample_length='fixed') is the scorer's EOS, one token."""
    if not texts:
        return []
    return tokenizer(list(texts), add_special_tokens=False, split_special_tokens=False)["input_ids"]


def score_texts(scorer: Scorer, texts: Sequence[str], progress: bool = True, batch_size: int | None = None) -> list[TextScore]:
    """Gen PPL terms (sum of log-probabilities, token count) and unigram entropy of each text;
    `batch_size` windows per call (default: the scorer's config)."""
    ids = tokenize_texts(scorer.tokenizer, texts)
    items = [(i, w, c) for i, x in enumerate(ids) for w, c in scoring_windows(x, scorer.prefix_id, scorer.max_length)]
    totals = [0.0] * len(texts)
    bar = tqdm(total=len(items), desc=f"scoring ({type(scorer).__name__})", disable=not progress)
    step = batch_size or scorer.config.batch_size
    for k in range(0, len(items), step):
        batch = items[k : k + step]
        for (i, _, c), lp in zip(batch, scorer.sequence_logprobs([w for _, w, _ in batch])):
            totals[i] += sum(lp[c - 1 :])  # lp[t - 1] is the log-probability of token t
        bar.update(len(batch))
    bar.close()
    return [TextScore(t, len(x), unigram_entropy(x)) for t, x in zip(totals, ids)]


def gen_ppl(scores: Sequence[TextScore]) -> float:
    """Token-weighted generative perplexity of a set of scored texts."""
    tokens = sum(s.tokens for s in scores)
    return math.exp(-sum(s.logprob for s in scores) / tokens) if tokens else float("nan")


# ------------------------------------------------------------------------------- transformers


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


class TransformersScorer(Scorer):
    """The scorer model in this process, batched (right padding, float32 by default)."""

    def __init__(self, config: ScorerConfig) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        check_model(config.model)
        self.config = config
        self.device = _device(config.device)
        self.tokenizer = scorer_tokenizer(config.model)
        self.model = from_folder_or_hub(
            lambda: AutoModelForCausalLM.from_pretrained(config.model, dtype=getattr(torch, config.dtype)), config.model)
        self.model.to(self.device).eval()
        STARTS["transformers"] += 1
        self.context = _context_length(self.model.config)

    def _batch(self, sequences: Sequence[Sequence[int]]):
        import torch

        width = max(len(s) for s in sequences)
        x = torch.zeros(len(sequences), width, dtype=torch.long)
        mask = torch.zeros_like(x)
        for j, s in enumerate(sequences):
            x[j, : len(s)] = torch.tensor(list(s))
            mask[j, : len(s)] = 1
        return x.to(self.device), mask.to(self.device)

    def sequence_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        import torch

        x, mask = self._batch(sequences)
        with torch.no_grad():
            logits = self.model(input_ids=x, attention_mask=mask).logits.float()
        lp = logits[:, :-1].log_softmax(-1).gather(-1, x[:, 1:, None])[..., 0]
        return [lp[j, : len(s) - 1].tolist() for j, s in enumerate(sequences)]

    def feature_identity(self) -> "FeatureIdentity":
        """What `features` returns depends on: MAUVE's feature files are keyed by it."""
        return FeatureIdentity(model_identity(self.config.model), self.device, self.config.dtype, self.config.batch_size)

    def features(self, texts: Sequence[str], progress: bool = True):
        """MAUVE features: the last layer's hidden state at the last of a text's first n tokens
        (no BOS), as MAUVE's own featurizer computes them; an empty text uses the prefix token."""
        import numpy as np
        import torch

        ids = [x[: self.context] or [self.prefix_id] for x in tokenize_texts(self.tokenizer, texts)]
        out = []
        for k in tqdm(range(0, len(ids), self.config.batch_size), desc="MAUVE features", disable=not progress):
            batch = ids[k : k + self.config.batch_size]
            x, mask = self._batch(batch)
            with torch.no_grad():
                hidden = self.model(input_ids=x, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
            last = torch.tensor([len(s) - 1 for s in batch], device=hidden.device)
            out.append(hidden[torch.arange(len(batch), device=hidden.device), last].float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, self.model.config.hidden_size), dtype=np.float32)


@dataclass(frozen=True)
class FeatureIdentity:
    """Everything `TransformersScorer.features` depends on (the key of MAUVE's feature files). The batch
    size is in it because padding changes a batch's shapes and so the last bits of its float results."""

    model: list  # `model_identity`: the model's files
    device: str
    dtype: str
    batch_size: int
    rule: int = FEATURE_RULE


def _context_length(config) -> int:
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    raise ScorerError(f"cannot tell the context length of the scorer model ({type(config).__name__})")


# ------------------------------------------------------------------------------- vLLM


class VLLMScorer(Scorer):
    """Prompt log-probabilities from a vLLM server (started here, or `config.url`)."""

    def __init__(self, config: ScorerConfig) -> None:
        from transformers import AutoConfig

        check_model(config.model)
        self.config = config
        self.tokenizer = scorer_tokenizer(config.model)
        self.server: VLLMServer | None = None
        if config.url:
            self.url = config.url.rstrip("/")
            served = self._get("/v1/models")["data"]
            self.served_name = served[0]["id"]
            self.context = int(served[0].get("max_model_len") or _context_length(AutoConfig.from_pretrained(config.model)))
        else:
            self.server = VLLMServer(config)
            self.url = self.server.start()
            self.served_name = SERVED_NAME
            try:
                self.context = int(self._get("/v1/models")["data"][0]["max_model_len"])
            except BaseException:
                self.close()
                raise

    def _request(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:2000]
            raise ScorerError(f"the vLLM server answered {err.code} to {path}: {detail}\n{self._server_state()}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            raise ScorerError(f"the vLLM server at {self.url} stopped answering ({err}).\n{self._server_state()}") from None

    def _get(self, path: str) -> dict:
        return self._request(path)

    def _server_state(self) -> str:
        server = self.server or started_here(self.config.url)
        if server is None:
            return f"(a server given by url={self.config.url}; its log is wherever it was started)"
        server.keep_log = True  # the message below points to it
        proc = server.process
        if proc is not None:
            try:  # a server that just dropped the connection may take a moment to exit
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                pass
        state = "is still running" if proc and proc.poll() is None else f"has exited (code {proc.returncode if proc else '?'})"
        return f"The server this harness started {state}.\n{server.log_tail()}"

    def sequence_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        body = {"model": self.served_name, "prompt": [list(s) for s in sequences], "echo": True,
                "max_tokens": 0, "logprobs": 0, "temperature": 0.0}
        try:
            choices = sorted(self._request("/v1/completions", body)["choices"], key=lambda c: c["index"])
        except ScorerError:
            if self.server is not None:
                self.server.stop(keep_log=True)  # a dead or broken server leaves no process behind
            raise
        return [c["logprobs"]["token_logprobs"][1 : len(s)] for c, s in zip(choices, sequences)]

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()

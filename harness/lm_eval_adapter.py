"""lm-evaluation-harness model type ``blockgen``: the only module that knows lm-eval's request types.

    lm_eval --model blockgen --model_args pretrained=DIR,k_mc=8,sampler=arpc,steps=8 --tasks ...

- ``loglikelihood`` / ``loglikelihood_rolling``: the log-sum-exp bound over the checkpoint's block
  sizes (paper appendix C), per scored window: the window's prefix stays clean in the noisy stream
  (``condition_mask``), positions start at 0 and blocks sit at multiples of L' as in training, and
  only the scored tokens carry loss. A window is at most ``seq_len`` tokens; longer inputs are
  left-truncated (loglikelihood) or cut into lm-eval's disjoint rolling windows (each token scored
  once). ``is_greedy`` comes from the AR pass (block size 1); without block size 1 in the mixture
  it is always False.
- ``generate_until``: any sampler of `blockgen.models.sampling`, chosen by model arguments and
  overridable per task through ``gen_kwargs``.

Reproducibility: every scored window and every generation request draws from its own
``torch.Generator``, seeded from the ``seed`` argument and the request's own tokens, so a result
does not depend on the batch it was computed in, nor on how torchrun split the work. This is why
generation runs one request per sampler call: the sampler draws a whole batch from one generator.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Callable, NamedTuple

import torch
from tqdm import tqdm

import lm_eval.models  # noqa: F401  lm-eval's own models first: get_model adds them only to an empty registry
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from blockgen.harness.checkpoint import (
    CheckpointError,
    checkpoint_hash,
    checkpoint_special_tokens,
    load_checkpoint,
    read_config,
)
from blockgen.models.model import BlockGen, BlockGenConfig
from blockgen.models.objectives import jensen_bound, lse_bound, noisy_forward
from blockgen.models.sampling import (
    SamplerConfig,
    check_config,
    generate,
    max_prompt_len,
    paper_nfe_per_block,
    resolve_block_size,
)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ model arguments


@dataclass(frozen=True)
class BlockGenLMArgs:
    """``--model_args`` (typed by lm-eval's parser) plus ``batch_size``/``device``, parsed once."""

    pretrained: str  # checkpoint directory (config.json, model.safetensors, tokenizer files)
    k_mc: int = 8  # Monte Carlo draws per block size for the likelihood bound
    seed: int = 0
    add_bos: bool = True  # start every context and prompt with BOS, as training examples do
    sampler: str | None = None  # None: 'ancestral' (diffusion checkpoints) or 'ar_greedy' (block_sizes == (1,))
    steps: int | None = None  # reverse steps per block (NFE of ancestral/eipc); None: the block size
    ge: int = 1
    warmup: int = 0
    temperature: float = 1.0
    block_size: int | None = None  # None: the checkpoint's largest block size
    max_gen_toks: int | None = None  # None: min(256, seq_len // 2)
    batch_size: int = 1
    device: str | None = None
    max_batch_size: int | None = None  # lm-eval passes it for batch_size=auto; unused

    @classmethod
    def parse(cls, kwargs: dict[str, Any]) -> "BlockGenLMArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown blockgen model argument(s) {unknown}; valid: {sorted(known)}")
        if kwargs.get("pretrained") in (None, ""):
            raise ValueError("blockgen needs pretrained=<checkpoint directory> in --model_args")
        values = {k: v for k, v in kwargs.items() if v is not None}
        if "batch_size" in values:
            values["batch_size"] = _batch_size(values["batch_size"])
        args = cls(**values)
        for name, low in (("k_mc", 1), ("ge", 1), ("warmup", 0), ("batch_size", 1)):
            _check_int(name, getattr(args, name), low)
        _check_int("seed", args.seed, None)
        for name in ("steps", "block_size", "max_gen_toks"):
            if getattr(args, name) is not None:
                _check_int(name, getattr(args, name), 1)
        if not isinstance(args.temperature, (int, float)) or isinstance(args.temperature, bool):
            raise ValueError(f"temperature={args.temperature!r}; must be a number")
        if not isinstance(args.add_bos, bool):
            raise ValueError(f"add_bos={args.add_bos!r}; must be true or false")
        return replace(args, pretrained=str(args.pretrained), temperature=float(args.temperature))


def _check_int(name: str, value: Any, low: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
        raise ValueError(f"{name}={value!r}; must be an integer" + (f" >= {low}" if low is not None else ""))


def _batch_size(value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"batch_size={value!r}; blockgen needs a positive integer ('auto' is not supported)")


# Generation settings a task's gen_kwargs may override, and the SamplerConfig field each one sets.
GEN_KWARGS = {"sampler": "name", "steps": "steps", "ge": "ge", "warmup": "warmup",
              "temperature": "temperature", "block_size": "block_size", "max_gen_toks": "max_new_tokens"}
# lm-eval's generic keys: `until` is honoured; `do_sample: false` (or temperature 0) asks for greedy.
GENERIC_GEN_KWARGS = {"until", "do_sample"}


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from the run's seed and a request's content (JSON-serialisable parts)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1


# ---------------------------------------------------------------------------------- scoring


class Window(NamedTuple):
    """One scored sequence: `tokens[:n_context]` stay clean, `tokens[n_context:]` are scored."""

    tokens: tuple[int, ...]
    n_context: int


class WindowScore(NamedTuple):
    lse: float  # log-sum-exp NLL bound (the reported one)
    jensen: float  # the looser mixture bound sum_i gamma_i NLL_i
    greedy: bool  # every scored token is the AR argmax (False without block size 1)


def windows(context: list[int], target: list[int], seq_len: int) -> list[Window]:
    """Windows of at most seq_len tokens that score every target token exactly once.

    A target shorter than seq_len is scored in one window behind as much context as fits (at least
    one token); a longer one in lm-eval's disjoint rolling windows, each conditioned on the tokens
    before it in the window.
    """
    if not target:
        return []
    if len(target) < seq_len:
        tokens = (context + target)[-seq_len:]
        return [Window(tuple(tokens), len(tokens) - len(target))]
    rolling = get_rolling_token_windows(target, prefix_token=context[-1], max_seq_len=seq_len - 1, context_len=1)
    return [Window(tuple(ctx + pred), len(ctx)) for ctx, pred in map(make_disjoint_window, rolling)]


class _RowNoise:
    """The model's prior, but each batch row is noised from its own generator and only over its own length.

    So a row's draws (and its bound) are exactly those of the row scored alone, whatever else is
    in the batch. Positions past a row's length (batch padding: whole blocks after the row's own
    blocks, which no earlier block can see) stay as they are.
    """

    def __init__(self, prior, generators: list[torch.Generator], lengths: list[int]) -> None:
        self._prior = prior
        self._generators = generators
        self._lengths = lengths

    def noise(self, x: torch.Tensor, alpha: torch.Tensor, generator=None) -> torch.Tensor:
        z = x.clone()
        alpha = alpha.expand(x.shape[0], *alpha.shape[1:])
        for j, (g, n) in enumerate(zip(self._generators, self._lengths)):
            z[j : j + 1, :n] = self._prior.noise(x[j : j + 1, :n], alpha[j : j + 1], generator=g)
        return z

    def __getattr__(self, name: str):
        return getattr(self._prior, name)


class _KeepARLogits:
    """The denoiser, remembering the logits of its last block-size-1 (AR) call, for is_greedy."""

    def __init__(self, dit) -> None:
        self._dit = dit
        self.ar_logits: torch.Tensor | None = None

    def forward_train(self, x0: torch.Tensor, xt: torch.Tensor, block_size: int) -> torch.Tensor:
        logits = self._dit.forward_train(x0, xt, block_size)
        if block_size == 1:
            self.ar_logits = logits
        return logits


@torch.no_grad()
def score_windows(model: BlockGen, batch: list[Window], seeds: list[int], k_mc: int, pad_id: int) -> list[WindowScore]:
    """The bounds of a batch of windows; each window's result is that of the window scored alone.

    Mirrors `BlockGen.nll_bounds` (`sequence_nll` per block size, then `lse_bound`/`jensen_bound`),
    with one generator per window: at batch size 1 the two give the same numbers from the same seed.
    """
    device = next(model.parameters()).device
    sizes, weights = model.mixture.sizes, model.mixture.weights
    unit = math.lcm(*sizes)  # each row is padded to whole blocks of every size (unit divides seq_len)
    lengths = [-(-len(w.tokens) // unit) * unit for w in batch]
    width = max(lengths)
    x = torch.full((len(batch), width), pad_id, dtype=torch.long)
    condition = torch.zeros_like(x, dtype=torch.bool)
    scored = torch.zeros_like(x, dtype=torch.bool)
    for j, w in enumerate(batch):
        x[j, : len(w.tokens)] = torch.tensor(w.tokens)
        condition[j, : w.n_context] = True
        scored[j, w.n_context : len(w.tokens)] = True
    x, condition, scored = x.to(device), condition.to(device), scored.to(device)
    generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
    prior = _RowNoise(model.prior, generators, lengths)
    dit = _KeepARLogits(model.dit)

    per_size = []
    for size in sizes:
        draws = 1 if size == 1 else k_mc  # block size 1 is exact
        u = torch.cat([torch.rand(1, generator=g, device=device) for g in generators])
        total = torch.zeros(len(batch), dtype=torch.float64, device=device)
        for k in range(draws):  # K_MC times stratified over [t_min, 1], as sequence_nll does
            t = model.schedule.t_from_uniform((u + k / draws) % 1.0)
            loss = noisy_forward(dit, prior, x, size, t, model.schedule, condition, objective="nelbo")
            total += (loss.double() * scored).sum(-1)
        per_size.append(total / draws)
    nll = torch.stack(per_size)
    lse, jensen = lse_bound(nll, weights), jensen_bound(nll, weights)
    if dit.ar_logits is not None:
        argmax = dit.ar_logits[..., : model.prior.vocab_size].argmax(-1)  # real vocabulary only
        greedy = ((argmax == x) | ~scored).all(-1).tolist()
    else:
        greedy = [False] * len(batch)
    return [WindowScore(a, b, g) for a, b, g in zip(lse.tolist(), jensen.tolist(), greedy)]


# ---------------------------------------------------------------------------------- the model


@register_model("blockgen")
class BlockGenLM(TemplateLM):
    """A BlockGen checkpoint behind lm-eval's LM interface (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.args = args = BlockGenLMArgs.parse(kwargs)
        # Everything checkable from config.json is checked before any weights load or ranks connect.
        if not os.path.isdir(args.pretrained):
            raise CheckpointError(f"pretrained={args.pretrained}: checkpoint directory does not exist")
        config = read_config(args.pretrained)
        self.sampler = self._default_sampler(config)

        self._device, self._world_size, self._rank = _setup_device_and_ranks(args.device)
        self.model, self.tokenizer = load_checkpoint(args.pretrained, self._device)
        self.special = checkpoint_special_tokens(self.model, self.tokenizer)
        self.checkpoint_hash = checkpoint_hash(args.pretrained)
        if 1 not in config.block_sizes:
            log.warning("blockgen: block sizes %s have no AR component (1): loglikelihood's is_greedy is always False",
                        list(config.block_sizes))

    def _default_sampler(self, config: BlockGenConfig) -> SamplerConfig:
        a = self.args
        name = a.sampler or ("ar_greedy" if config.block_sizes == (1,) else "ancestral")
        try:
            # steps defaults to the block size: one token per reverse step on average
            steps = a.steps or resolve_block_size(config, SamplerConfig(name=name, block_size=a.block_size))
            sampler = SamplerConfig(name=name, steps=steps, ge=a.ge, warmup=a.warmup, temperature=a.temperature,
                                    block_size=a.block_size, seed=a.seed,
                                    max_new_tokens=a.max_gen_toks or min(256, config.seq_len // 2))
        except ValueError as err:
            raise ValueError(f"blockgen --model_args: {err}") from None
        return self._checked(config, sampler, "--model_args")

    @staticmethod
    def _checked(config: BlockGenConfig, sampler: SamplerConfig, where: str) -> SamplerConfig:
        try:
            check_config(config, sampler)
        except ValueError as err:
            raise ValueError(f"blockgen {where}: {err}") from None
        if max_prompt_len(config, sampler) < 1:
            raise ValueError(f"blockgen {where}: max_gen_toks={sampler.max_new_tokens} leaves no room for a prompt "
                             f"in seq_len={config.seq_len}; choose max_gen_toks <= {_max_new_tokens(config, sampler)}")
        return sampler

    # -------------------------------------------------------------- lm-eval's interface: basics

    @property
    def config(self) -> BlockGenConfig:
        return self.model.config

    @property
    def eot_token_id(self) -> int:
        return self.special.eos

    @property
    def prefix_token_id(self) -> int:
        return self.special.bos

    @property
    def max_length(self) -> int:
        return self.config.seq_len

    @property
    def batch_size(self) -> int:
        return self.args.batch_size

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=False)

    @property
    def fingerprint(self) -> str:
        """Checkpoint and every setting that changes an answer (not batch size or device)."""
        a = self.args
        return derive_seed(self.checkpoint_hash, a.k_mc, a.seed, a.add_bos, asdict(self.sampler)).to_bytes(8, "little").hex()

    @property
    def tokenizer_name(self) -> str:
        return f"blockgen-{self.fingerprint}"

    def set_cache_hook(self, cache_hook) -> None:
        # lm-eval's --use_cache (CachingLM) keys answers by request arguments only and hands its
        # SqliteDict over here. Reopening that dict on a table named after our fingerprint keeps
        # other checkpoints' and settings' answers (same file, other tables) out of reach.
        db = getattr(cache_hook, "dbdict", None)
        if db is not None and db.tablename != self.tokenizer_name:
            autocommit = db.autocommit
            db.close()
            db.__init__(db.filename, tablename=self.tokenizer_name, autocommit=autocommit)
        super().set_cache_hook(cache_hook)

    def get_model_info(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "model_checkpoint": os.path.abspath(self.args.pretrained),
            "model_sha": self.checkpoint_hash,
            "model_num_parameters": self.model.dit.n_params(),
            "blockgen": {
                "prior": cfg.prior,
                "block_sizes": list(cfg.block_sizes),
                "block_weights": list(cfg.block_weights),
                "seq_len": cfg.seq_len,
                "k_mc": self.args.k_mc,
                "seed": self.args.seed,
                "add_bos": self.args.add_bos,
                "sampler": {**asdict(self.sampler), "paper_nfe_per_block": paper_nfe_per_block(self.sampler)},
                "fingerprint": self.fingerprint,
            },
        }

    # -------------------------------------------------------------- likelihoods

    def _with_bos(self, context: list[int]) -> list[int]:
        if self.args.add_bos and context[:1] != [self.special.bos]:
            return [self.special.bos, *context]
        return context

    def _score(self, items: list[Window], what: str, disable_tqdm: bool) -> list[WindowScore]:
        """Score windows in batches of batch_size, longest first (lm-eval's Collator)."""
        seeds = [derive_seed(self.args.seed, what, list(w.tokens), w.n_context) for w in items]
        collator = Collator(list(zip(items, seeds)), sort_fn=lambda item: (-len(item[0].tokens), item[0].tokens))
        out: list[WindowScore] = []
        bar = tqdm(total=len(items), desc=f"blockgen {what}", disable=disable_tqdm or self.rank != 0)
        for batch in collator.get_batched(n=self.batch_size):
            ws, ss = zip(*batch)
            out.extend(score_windows(self.model, list(ws), list(ss), self.args.k_mc, self.special.pad))
            bar.update(len(batch))
        bar.close()
        return collator.get_original(out)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        owners, items = [], []
        for i, (_, context, continuation) in enumerate(requests):
            for w in windows(self._with_bos(list(context)), list(continuation), self.max_length):
                owners.append(i)
                items.append(w)
        scores = self._score(items, "loglikelihood", disable_tqdm)
        totals = [[0.0, True] for _ in requests]
        for i, s in zip(owners, scores):
            totals[i][0] -= s.lse
            totals[i][1] &= s.greedy
        results = [(logp, greedy) for logp, greedy in totals]
        for (strings, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", strings, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        owners, items = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for w in windows([self.prefix_token_id], self.tok_encode(text), self.max_length):
                owners.append(i)
                items.append(w)
        scores = self._score(items, "loglikelihood_rolling", disable_tqdm)
        totals = [0.0] * len(requests)
        for i, s in zip(owners, scores):
            totals[i] -= s.lse
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -------------------------------------------------------------- generation

    def _plan(self, context: str, gen_kwargs: dict) -> tuple[list[int], SamplerConfig, list[str]]:
        """(prompt ids, sampler, stop strings) of one request; raises on a bad override."""
        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        greedy = gen_kwargs.pop("do_sample", True) is False or gen_kwargs.get("temperature") == 0
        if gen_kwargs.get("temperature") == 0:
            del gen_kwargs["temperature"]
        ignored = sorted(set(gen_kwargs) - set(GEN_KWARGS))
        if ignored:
            _warn_once(f"blockgen ignores gen_kwargs {ignored}; it reads {sorted(GEN_KWARGS) + sorted(GENERIC_GEN_KWARGS)}")
        overrides = {GEN_KWARGS[k]: v for k, v in gen_kwargs.items() if k in GEN_KWARGS}
        sampler = self.sampler
        if greedy and "name" not in overrides:
            if sampler.name == "ar_sample":
                overrides["name"] = "ar_greedy"
            elif sampler.name != "ar_greedy":
                _warn_once(f"task asks for greedy decoding; sampler {sampler.name!r} has no greedy mode and samples "
                           f"at temperature {sampler.temperature}")
        if overrides:
            try:
                sampler = replace(sampler, **overrides)
            except ValueError as err:
                raise ValueError(f"blockgen gen_kwargs {gen_kwargs}: {err}") from None
            if sampler.max_new_tokens > (room := _max_new_tokens(self.config, sampler)):
                _warn_once(f"max_gen_toks={sampler.max_new_tokens} does not fit seq_len={self.config.seq_len}; using {room}")
                sampler = replace(sampler, max_new_tokens=room)
            sampler = self._checked(self.config, sampler, f"gen_kwargs {gen_kwargs}")
        prompt = self._with_bos(self.tok_encode(context))[-max_prompt_len(self.config, sampler) :]
        seed = derive_seed(self.args.seed, "generate_until", prompt, asdict(replace(sampler, seed=0)))
        return prompt, replace(sampler, seed=seed), until

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _stop(self, until: list[str]) -> Callable[[list[int]], bool] | None:
        if not until:
            return None
        return lambda ids: any(s in self._decode(ids) for s in until)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        plans = [self._plan(context, gen_kwargs) for context, gen_kwargs in (r.args for r in requests)]
        out = []
        for req, (prompt, sampler, until) in tqdm(list(zip(requests, plans)), desc="blockgen generate_until",
                                                  disable=disable_tqdm or self.rank != 0):
            result = generate(self.model, [prompt], sampler, self.special.eos, self.special.pad, stop=self._stop(until))
            text = self._decode(result.tokens[0])
            for s in until:  # the sampler stops after a block; cut at the first stop string
                text = text.split(s)[0]
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out

    # -------------------------------------------------------------- data parallel (torchrun)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        flat = tensor.reshape(-1)
        parts = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(parts, flat)
        return torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()


def _max_new_tokens(config: BlockGenConfig, sampler: SamplerConfig) -> int:
    """The most tokens a sampler can add while leaving one block for the prompt."""
    return config.seq_len - resolve_block_size(config, sampler)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def _setup_device_and_ranks(requested: str | None) -> tuple[torch.device, int, int]:
    """(device, world size, rank). Under torchrun: joins (or starts) the process group, one device per rank.

    lm-eval's default device is cuda:0 even without a GPU: fall back to the CPU with a warning.
    """
    device = torch.device(requested or "cuda:0")
    if device.type == "cuda" and not torch.cuda.is_available():
        log.warning("blockgen: device %s requested but CUDA is not available; using the CPU", device)
        device = torch.device("cpu")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        log.warning("blockgen: device mps requested but not available; using the CPU")
        device = torch.device("cpu")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            log.warning("blockgen: %s does not exist; using cuda:0", device)
            device = torch.device("cuda:0")
        return device, 1, 0
    import torch.distributed as dist

    if device.type == "cuda":  # one GPU per rank, whatever index was asked for
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return device, dist.get_world_size(), dist.get_rank()

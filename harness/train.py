"""The training loop: one process, or torchrun / torch.distributed (gloo on CPU, NCCL on CUDA).

Per optimizer step the global batch is split into D = world_size x grad_accum micro-batch slots.
Each slot gets one block size by the stratified selection of Algorithm 1 (the same draw on every
rank, from the step's seed) and its slice of stratified diffusion times. AdamW with linear warm-up,
gradient clipping, an EMA of the weights (used for validation and saved in model.safetensors),
periodic validation with the log-sum-exp bound, and atomic checkpoints a restarted run resumes from.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from blockgen.harness.checkpoint import TRAINING_STATE, save_checkpoint
from blockgen.harness.data import DataConfig, Examples, get_tokenizer, load_examples
from blockgen.harness.tokenizer import special_tokens
from blockgen.models.model import BlockGen, BlockGenConfig
from blockgen.models.objectives import stratified_indices, stratified_times


@dataclass(frozen=True)
class ModelSize:
    n_layers: int
    d_model: int
    n_heads: int
    cond_dim: int
    dropout: float


SIZES = {
    "micro": ModelSize(n_layers=2, d_model=64, n_heads=4, cond_dim=32, dropout=0.0),  # tests and CI
    "tiny": ModelSize(n_layers=4, d_model=192, n_heads=4, cond_dim=64, dropout=0.0),  # ~2M params
    "paper": ModelSize(n_layers=12, d_model=768, n_heads=12, cond_dim=128, dropout=0.1),  # ~170M with 50k vocab
}


@dataclass(frozen=True)
class TrainConfig:
    out_dir: str = "runs/model"
    data: DataConfig = field(default_factory=DataConfig)
    prior: Literal["masked", "uniform"] = "masked"
    block_sizes: tuple[int, ...] = (16,)
    block_weights: tuple[float, ...] = (1.0,)
    causal_clean: bool = True
    size: Literal["micro", "tiny", "paper"] = "tiny"
    seq_len: int = 128
    batch_size: int = 32  # global batch (sequences per optimizer step)
    grad_accum: int = 1
    lr: float = 1e-3
    warmup_steps: int = 50
    max_steps: int = 1000
    grad_clip: float = 1.0
    ema_decay: float = 0.999
    eval_every: int = 250
    k_mc: int = 8
    save_every: int = 250
    seed: int = 0
    device: str = "auto"  # auto: cuda if available, else cpu
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16 autocast (CUDA)
    attention: Literal["auto", "sdpa", "flex"] = "auto"  # auto: flex on CUDA, SDPA masks on CPU

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"unknown size {self.size!r}; choose one of {sorted(SIZES)}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision={self.precision!r}; choose 'fp32' or 'bf16'")
        if self.attention not in ("auto", "sdpa", "flex"):
            raise ValueError(f"attention={self.attention!r}; choose 'auto', 'sdpa' or 'flex'")

    def model_config(self, vocab_size: int, special: dict, device: str) -> BlockGenConfig:
        attention = self.attention if self.attention != "auto" else ("flex" if device.startswith("cuda") else "sdpa")
        return BlockGenConfig(
            vocab_size=vocab_size,
            seq_len=self.seq_len,
            prior=self.prior,
            block_sizes=tuple(self.block_sizes),
            block_weights=tuple(self.block_weights),
            causal_clean=self.causal_clean,
            attention=attention,
            special_tokens=special,
            **asdict(SIZES[self.size]),
        )

    def to_dict(self) -> dict:
        return asdict(self)


# Settings a resumed run may change (e.g. extending the step budget); anything else must match.
RESUMABLE_CHANGES = frozenset({"max_steps", "eval_every", "save_every", "device", "out_dir"})


def _mixture(sizes: tuple[int, ...], weights: tuple[float, ...]) -> dict:
    return {"block_sizes": sizes, "block_weights": weights}


# The embedded default's models (paper: gamma_1 = 0.05, gamma_16 = 0.95 for the ARPC mixtures).
# Step counts fit the five demo models into about 40 CPU minutes on 2 cores (see README); validation
# runs once, at the end, on 128 held-out problems with K_MC = 8.
_DEMO = dict(eval_every=10**9, save_every=100, data=DataConfig(n_val=128))
PRESETS: dict[str, TrainConfig] = {
    "gsm-ar": TrainConfig(**_mixture((1,), (1.0,)), max_steps=500, **_DEMO),
    "gsm-masked": TrainConfig(prior="masked", **_mixture((16,), (1.0,)), max_steps=650, **_DEMO),
    "gsm-uniform": TrainConfig(prior="uniform", **_mixture((16,), (1.0,)), max_steps=650, **_DEMO),
    "gsm-masked-mix": TrainConfig(prior="masked", **_mixture((1, 16), (0.05, 0.95)), max_steps=650, **_DEMO),
    "gsm-uniform-mix": TrainConfig(prior="uniform", **_mixture((1, 16), (0.05, 0.95)), max_steps=650, **_DEMO),
    # The paper's scale (GPU machines with the hub): TinyGSM with the SmolLM tokenizer, and OWT.
    "tinygsm-paper": TrainConfig(
        prior="masked", **_mixture((1, 16), (0.05, 0.95)), size="paper", seq_len=512, batch_size=512, lr=3e-4,
        warmup_steps=2500, max_steps=250_000, ema_decay=0.9999, precision="bf16", eval_every=10_000, save_every=5_000,
        data=DataConfig(source="tinygsm", tokenizer="HuggingFaceTB/SmolLM-135M", n_val=1000),
    ),
    "owt-paper": TrainConfig(
        prior="masked", **_mixture((1, 4, 16), (0.05, 0.25, 0.7)), size="paper", seq_len=1024, batch_size=512, lr=3e-4,
        warmup_steps=2500, max_steps=1_000_000, ema_decay=0.9999, precision="bf16", eval_every=10_000, save_every=5_000,
        data=DataConfig(source="owt", tokenizer="gpt2", n_val=1000),
    ),
    # CI: seconds, not minutes.
    "ci": TrainConfig(
        prior="masked", **_mixture((1, 4), (0.5, 0.5)), size="micro", batch_size=16, max_steps=40, warmup_steps=5,
        eval_every=20, save_every=20, k_mc=2, data=DataConfig(n_train=2000, n_val=32, vocab_size=512),
    ),
}
DEMO_PRESETS = ("gsm-ar", "gsm-masked", "gsm-uniform", "gsm-masked-mix", "gsm-uniform-mix")


def preset(name: str, **overrides) -> TrainConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


# ---------------------------------------------------------------------------------------------
# distributed plumbing


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    device: str = "cpu"

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str) -> Dist:
    """Join the torchrun process group if launched by torchrun; otherwise a single process."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(0, 1, device)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return Dist(rank, world, device)


def all_reduce_sum(x: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


# ---------------------------------------------------------------------------------------------
# training


class EMA:
    """Exponential moving average of the weights, with the usual warm-up (decay grows with steps)."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone().float() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module, step: int) -> None:
        decay = min(self.decay, (1 + step) / (10 + step))
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                self.shadow[k].mul_(decay).add_(v.float(), alpha=1 - decay)
            else:
                self.shadow[k].copy_(v)

    def copy_to(self, model: torch.nn.Module) -> None:
        model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in self.shadow.items()})


@torch.no_grad()
def validate(model: BlockGen, val: Examples, k_mc: int, batch_size: int, d: Dist, seed: int) -> dict:
    """Token-level NLL (log-sum-exp and Jensen bounds) of the validation set; sharded over ranks."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    gen = torch.Generator(device=d.device).manual_seed(seed)
    shard = val[d.rank :: d.world]
    for i in range(0, len(shard), batch_size):
        b = shard[i : i + batch_size]
        x, lm, cm = (t.to(d.device) for t in (b.tokens, b.loss_mask, b.condition_mask))
        lse, jensen = model.nll_bounds(x, lm.float(), k_mc, cm, gen)
        totals += torch.stack([lse.sum().cpu(), jensen.sum().cpu(), lm.sum().double().cpu()])
    totals = all_reduce_sum(totals.to(d.device), d).cpu()
    model.train()
    lse, jensen, tokens = totals.tolist()
    return {"val_nll_lse": lse / tokens, "val_nll_jensen": jensen / tokens, "val_ppl_lse": math.exp(lse / tokens), "val_tokens": int(tokens)}


def _slot_batches(n_examples: int, step: int, batch: int, seed: int) -> torch.Tensor:
    """Global batch indices for a step: a fresh permutation per epoch (same on every rank)."""
    per_epoch = max(n_examples // batch, 1)
    epoch, offset = divmod(step, per_epoch)
    perm = torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return perm[offset * batch : (offset + 1) * batch]


def train(config: TrainConfig, progress: bool = True) -> Path:
    """Train (or resume) a model; returns the checkpoint directory."""
    d = setup_distributed(config.device)
    torch.manual_seed(config.seed + d.rank)
    out = Path(config.out_dir)
    ckpt_dir = out / "checkpoint"
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
    tokenizer = get_tokenizer(config.data) if d.main else None
    if d.world > 1:
        dist.barrier()  # rank 0 trains/caches the embedded tokenizer first
        tokenizer = tokenizer or get_tokenizer(config.data)
    train_data, val_data, data_info = load_examples(config.data, tokenizer, config.seq_len)
    special = special_tokens(tokenizer).to_dict()
    model_config = config.model_config(len(tokenizer), special, d.device)
    model = BlockGen(model_config).to(d.device)
    ema = EMA(model, config.ema_decay)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.999), weight_decay=0.0)
    step = 0
    if (ckpt_dir / TRAINING_STATE).is_file():
        state = torch.load(ckpt_dir / TRAINING_STATE, map_location=d.device, weights_only=False)
        changed = sorted(k for k, v in config.to_dict().items() if state["config"].get(k) != v and k not in RESUMABLE_CHANGES)
        if changed:
            raise ValueError(f"{ckpt_dir} was written with different {changed}; use another out_dir")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        ema.shadow = {k: v.to(d.device) for k, v in state["ema"].items()}
        step = state["step"]
        if d.world == 1:
            torch.set_rng_state(state["rng"])
        else:  # rank 0's state alone was saved: give every rank its own stream again
            torch.manual_seed(config.seed + d.rank + 7919 * step)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if d.world > 1 else None

    slots = d.world * config.grad_accum
    if config.batch_size % slots:
        raise ValueError(f"batch_size={config.batch_size} must be divisible by world_size x grad_accum = {slots}")
    micro = config.batch_size // slots
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if config.precision == "bf16" and d.device.startswith("cuda") else contextlib.nullcontext()
    )
    log_path = out / "metrics.jsonl"
    if d.main:
        (out / "train_config.json").write_text(json.dumps({**config.to_dict(), "data_info": data_info}, indent=2))
    bar = tqdm(total=config.max_steps, initial=step, disable=not (progress and d.main), desc=out.name, dynamic_ncols=True)
    tokens_seen, t0 = 0, time.perf_counter()

    def ema_model() -> BlockGen:
        """A copy of the model holding the EMA weights (what validation and checkpoints use)."""
        copied = copy.deepcopy(model)
        ema.copy_to(copied)
        return copied

    def checkpoint(final: bool) -> None:
        if not d.main:
            return
        state = {
            "config": config.to_dict(),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "ema": ema.shadow,
            "step": step,
            "rng": torch.get_rng_state(),  # noise draws use the global generator: resume exactly
        }
        save_checkpoint(ckpt_dir, ema_model(), tokenizer, state, extra={"step": step, "final": final, "data": data_info})

    model.train()
    while step < config.max_steps:
        lr = config.lr * min(1.0, (step + 1) / max(config.warmup_steps, 1))
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        u_block, u_time = torch.rand(2, generator=step_gen).tolist()
        block_idx = stratified_indices(model_config.block_weights, slots, u_block)
        times = stratified_times(config.batch_size, u_time, model.schedule)
        batch_idx = _slot_batches(len(train_data), step, config.batch_size, config.seed)
        loss_sum = torch.zeros((), device=d.device)
        for a in range(config.grad_accum):
            slot = d.rank * config.grad_accum + a
            sl = slice(slot * micro, (slot + 1) * micro)
            b = train_data[batch_idx[sl]]
            x, lm, cm = (t.to(d.device) for t in (b.tokens, b.loss_mask, b.condition_mask))
            block_size = model_config.block_sizes[block_idx[slot]]
            sync = contextlib.nullcontext() if ddp is None or a == config.grad_accum - 1 else ddp.no_sync()
            with sync, autocast:
                # through DDP's __call__ (when distributed), so that backward all-reduces gradients
                net = ddp if ddp is not None else model
                total, count = net(x, lm.float(), block_size, times[sl].to(d.device), cm)
                loss = total / count.clamp_min(1)
                (loss / config.grad_accum).backward()
            loss_sum += loss.detach() / config.grad_accum
            tokens_seen += x.numel() * d.world
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(model, step)
        step += 1
        loss_val = all_reduce_sum(loss_sum, d).item() / d.world
        record = {"step": step, "loss": loss_val, "lr": lr, "grad_norm": float(grad_norm), "block_sizes": [model_config.block_sizes[i] for i in block_idx]}
        bar.update(1)
        bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{tokens_seen / (time.perf_counter() - t0):.0f}")
        if step % config.eval_every == 0 or step == config.max_steps:
            record.update(validate(ema_model(), val_data, config.k_mc, max(micro, 8), d, config.seed))
            if d.main:
                bar.write(f"step {step}: val NLL/token {record['val_nll_lse']:.4f} (LSE) {record['val_nll_jensen']:.4f} (Jensen)")
        if d.main:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if step % config.save_every == 0 or step == config.max_steps:
            checkpoint(final=step == config.max_steps)
    bar.close()
    if d.world > 1:
        dist.barrier()
    return ckpt_dir

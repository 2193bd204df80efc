"""Tiny random BlockGen models (CPU) for the sampling tests (tests/test_sampling_*.py, tests/test_samplers.py,
tests/test_generation_speed.py): `tiny_model`, and the module fixtures `masked` and `uniform` (registered in
tests/conftest.py: one model of each per test module that asks)."""

from __future__ import annotations

import pytest
import torch

from blockgen.models.backbone import ModelShape
from blockgen.models.model import BlockGen, BlockGenConfig


V = 40


def tiny_model(prior: str = "masked", causal: bool = True, sizes=(1, 4, 8), seed: int = 0, std: float = 0.2) -> BlockGen:
    weights = tuple(1 / len(sizes) for _ in sizes)
    config = BlockGenConfig(
        vocab_size=V, seq_len=64, prior=prior, block_sizes=sizes, block_weights=weights, causal_clean=causal,
        shape=ModelShape(n_layers=2, d_model=32, n_heads=4, cond_dim=16, dropout=0.0),
    )
    torch.manual_seed(seed)
    model = BlockGen(config).eval()
    with torch.no_grad():  # adaLN and the output layer start at zero: scale everything up
        for p in model.parameters():
            p.normal_(0, std)
    return model


@pytest.fixture(scope="module")
def masked():
    return tiny_model("masked")


@pytest.fixture(scope="module")
def uniform():
    return tiny_model("uniform")

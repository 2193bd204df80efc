"""The compiled training step (issue 32, item 4): no graph breaks, alone or inside DDP, and the same
numbers as the eager step.

Dynamo's capture is what breaks graphs, so the model is compiled with the "eager" backend here (no
inductor code generation: seconds, not minutes), through the same `training_net` that `blockgen
train --compile` uses. DDP runs in a one-process gloo group. Before `training_net` compiled the model
inside DDP, dynamo traced DDP's own forward: 3 breaks per process (its logger, `_inside_ddp_forward`).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.backends.distributed import DDPOptimizer
from torch._dynamo.utils import counters

from blockgen.harness.training.train import training_net
from blockgen.models.backbone import ModelShape
from blockgen.models.model import BlockGen, BlockGenConfig

L, BATCH, VOCAB = 16, 2, 24


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def tiny(prior: str, sizes: tuple[int, ...]) -> BlockGen:
    config = BlockGenConfig(vocab_size=VOCAB, seq_len=L, prior=prior, block_sizes=sizes,
                            block_weights=tuple(1 / len(sizes) for _ in sizes),
                            shape=ModelShape(n_layers=1, d_model=16, n_heads=2, cond_dim=8, dropout=0.0))
    torch.manual_seed(0)
    model = BlockGen(config)
    with torch.no_grad():  # adaLN and the output layer start at zero: give every weight a gradient
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def step(net, sizes: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The loss of one micro-batch per block size (a prompt, as in word problems), and the gradients."""
    model = net.module if isinstance(net, torch.nn.parallel.DistributedDataParallel) else net
    model = getattr(model, "_orig_mod", model)
    model.zero_grad(set_to_none=True)
    losses = []
    for i, size in enumerate(sizes):
        gen = torch.Generator().manual_seed(i)
        x = torch.randint(0, VOCAB, (BATCH, L), generator=gen)
        condition = torch.arange(L)[None].expand(BATCH, L) < 3
        torch.manual_seed(100 + i)  # the noise draws, as the training loop seeds them
        total, count = net(x, (~condition).float(), size, torch.rand(BATCH, generator=gen), condition)
        loss = total / count.clamp_min(1)
        loss.backward()
        losses.append(loss.detach())
    return losses, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("prior, sizes", [("masked", (1, 16)), ("uniform", (1, 2, 4, 8, 16))])
@pytest.mark.parametrize("distributed", [False, True], ids=["one-process", "ddp"])
def test_compiled_training_step_has_no_graph_breaks(process_group, monkeypatch, prior, sizes, distributed):
    """One graph per block size and no break (forward and backward), inside DDP too, where DDP's
    bucket splitting (DDPOptimizer) still compiles them; losses and gradients equal the eager step's."""
    split = []
    real = DDPOptimizer.compile_fn
    monkeypatch.setattr(DDPOptimizer, "compile_fn", lambda self, gm, inputs: split.append(1) or real(self, gm, inputs))
    eager, _ = training_net(tiny(prior, sizes), distributed, compile=False)
    want_losses, want_grads = step(eager, sizes)
    torch._dynamo.reset()
    counters.clear()
    compiled, ddp = training_net(tiny(prior, sizes), distributed, compile=True, backend="eager")
    assert (ddp is not None) == distributed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, grads = step(compiled, sizes)
    # The attention mask is a constant of each graph (`attention.training_mask`), not dynamo tracing through its
    # cache ("Dynamo detected a call to a functools.lru_cache-wrapped function", which every --compile run printed).
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message) for w in caught]
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == len(sizes)
    assert len(split) == (len(sizes) if distributed else 0)
    assert all(torch.equal(a, b) for a, b in zip(losses, want_losses)), (losses, want_losses)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))


def test_importing_training_and_evaluation_leaves_dynamo_unimported():
    """`torch.compiler` imports dynamo: about 1 s and 800 modules in every process that imports it. Marking the mask
    constant at import (`torch.compiler.assume_constant_result` on `attention.training_mask`) once cost every eager
    training and evaluation process that second, about 170 s of a CI run; only compiling may import it."""
    import subprocess
    import sys

    from limits import HANG_S

    modules = ["blockgen.harness.training.train", "blockgen.harness.evaluation.lm_eval_model.model", "blockgen.harness.demo",
               "blockgen.harness.evaluation.sweep", "blockgen.harness.gpu_check.check"]
    probe = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint('torch._dynamo' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0 and r.stdout.split() == ["False"], (r.stdout, r.stderr[-2000:])

"""Monte Carlo noise of multiple-choice answers: seed-to-seed agreement with and without common random numbers.

    .venv/bin/python bench/bench_mc_noise.py                      # trains a micro mixture (~2 min), then measures
    .venv/bin/python bench/bench_mc_noise.py --checkpoint DIR     # an existing mixture checkpoint

Task: ``blockgen_toy_mc`` (25 questions "a plus b is", nine choices each), scored through the
adapter's ``loglikelihood`` as lm-eval would. For K_MC in {4, 32} and seeds 0, 1, 2 it scores every
choice with common random numbers (the default: draws seeded by the context) and with independent
draws per choice (seeded by the whole request, the adapter's earlier behaviour), and prints the
accuracy per seed, the share of questions whose chosen answer is the same for each pair of seeds,
and the disagreement the adapter predicts from its MC standard errors (``expected_seed_disagreement``).
The trained checkpoint is kept in runs/bench-mc-noise/ (git-ignored) and reused.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch


def train_micro(out: Path, minutes: float, seed: int = 0) -> Path:
    """A micro masked mixture, block sizes (1, 8), trained on the toy text (documents packed from position 0)."""
    from blockgen.harness.checkpoints.checkpoint import save_checkpoint
    from blockgen.harness.checkpoints.tokenizer import special_tokens, train_bpe
    from blockgen.models.backbone import SIZES
    from blockgen.models.model import BlockGen, BlockGenConfig
    from blockgen.tasks.blockgen_toy import training_text

    torch.manual_seed(seed)
    tok = train_bpe(training_text(2000), vocab_size=400)
    special = special_tokens(tok)
    seq_len, sizes, weights = 64, (1, 8), (0.5, 0.5)
    config = BlockGenConfig(vocab_size=len(tok), seq_len=seq_len, prior="masked", block_sizes=sizes, block_weights=weights,
                            shape=SIZES["micro"], special_tokens=special.to_dict())
    model = BlockGen(config)
    rows, row = [], []
    for line in training_text(20000, seed=seed):
        ids = [special.bos, *tok.encode(line, add_special_tokens=False), special.eos]
        if len(row) + len(ids) > seq_len:
            rows.append(row + [special.pad] * (seq_len - len(row)))
            row = []
        row += ids
    data = torch.tensor(rows)
    mask = (data != special.pad).float()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    deadline, step = time.monotonic() + 60 * minutes, 0
    while time.monotonic() < deadline:
        pick = torch.randint(0, len(rows), (32,), generator=gen)
        size = sizes[step % len(sizes)]  # alternate: each size gets half the steps, as the weights say
        t = model.schedule.t_from_uniform(torch.rand(32, generator=gen))
        total, count = model.loss(data[pick], mask[pick], size, t, generator=gen)
        opt.zero_grad()
        (total / count).backward()
        opt.step()
        step += 1
    print(f"trained {step} steps in {minutes} min")
    model.eval()
    return save_checkpoint(out, model, tok)


def choices_per_seed(checkpoint: Path, k_mc: int, seeds: list[int], crn: bool) -> tuple[list[list[int]], list[float], list[float]]:
    """(chosen answer per question for each seed, accuracy per seed, predicted seed disagreement per seed)."""
    from lm_eval.api.instance import Instance

    from blockgen.harness.evaluation.lm_eval_model.model import BlockGenLM
    from blockgen.tasks.blockgen_toy import load_mc

    docs = list(load_mc()["test"])
    requests = [Instance("loglikelihood", doc, (doc["question"], choice), idx, ("blockgen_toy_mc", d, 1))
                for d, doc in enumerate(docs) for idx, choice in enumerate(doc["choices"])]
    chosen, accuracy, predicted = [], [], []
    for seed in seeds:
        lm = BlockGenLM(pretrained=str(checkpoint), k_mc=k_mc, seed=seed, device="cpu", batch_size=16)
        lm.common_random_numbers = crn
        lls = [ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)]
        picks = [max(range(9), key=lambda i: lls[9 * d + i]) for d in range(len(docs))]
        chosen.append(picks)
        accuracy.append(statistics.fmean(p == doc["label"] for p, doc in zip(picks, docs)))
        predicted.append(lm.usage.report()["blockgen_toy_mc"]["loglikelihood"]["expected_seed_disagreement"])
    return chosen, accuracy, predicted


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="a mixture checkpoint; default: train one into runs/bench-mc-noise")
    parser.add_argument("--minutes", type=float, default=2.0, help="training time of the default checkpoint")
    parser.add_argument("--k-mc", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = Path("runs/bench-mc-noise/checkpoint")
        if not (checkpoint / "config.json").is_file():
            train_micro(checkpoint, args.minutes)
    print(f"checkpoint {checkpoint}; load: {os.getloadavg()}; {subprocess.run(['date', '-u'], capture_output=True, text=True).stdout.strip()}")
    print("| K_MC | draws | accuracy per seed | same answer, pairs of seeds | predicted disagreement (mean over seeds) |")
    print("|---|---|---|---|---|")
    for k_mc, crn in itertools.product(args.k_mc, (False, True)):
        chosen, accuracy, predicted = choices_per_seed(checkpoint, k_mc, args.seeds, crn)
        agree = [statistics.fmean(x == y for x, y in zip(a, b)) for a, b in itertools.combinations(chosen, 2)]
        print(f"| {k_mc} | {'common (per context)' if crn else 'independent (per request)'} | "
              f"{', '.join(f'{a:.2f}' for a in accuracy)} | {', '.join(f'{a:.2f}' for a in agree)} | "
              f"{statistics.fmean(predicted):.2f} |", flush=True)


if __name__ == "__main__":
    main()

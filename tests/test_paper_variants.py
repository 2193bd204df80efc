"""The paper's sampler grid (`blockgen.harness.evaluation.paper_variants`): every variant's NFE label by appendix
D's formula, `nfe=N` in the adapter, and the Makefile and the demo reading the grid (no copy)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from blockgen.harness import cli
from blockgen.harness.evaluation.paper_variants import GRID, pick
from blockgen.models.sampler_config import SamplerConfig, paper_nfe_per_block

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))


def test_every_variant_has_the_nfe_it_is_listed_under():
    for sampler, by_nfe in GRID.items():
        for nfe, variants in by_nfe.items():
            assert len(set(variants)) == len(variants)
            for v in variants:
                assert v.name == sampler and v.temperature == 1.0 and paper_nfe_per_block(v) == nfe, v
                if sampler == "arpc":  # appendix D, written out
                    assert v.steps + (v.steps - 1 - v.warmup) // v.ge + 1 == nfe
    # tables 5-6: 25 ARPC and 13 EIPC variants
    assert sum(map(len, GRID["arpc"].values())) == 25 and sum(map(len, GRID["eipc"].values())) == 13


def test_pick_narrows_by_the_settings_given():
    assert pick("arpc", 4) == SamplerConfig("arpc", 3, 2, 1)
    assert pick("arpc", 4, ge=1) == SamplerConfig("arpc", 2, 1, 0)
    assert pick("arpc", 8, ge=2, warmup=5) == SamplerConfig("arpc", 7, 2, 5)
    assert pick("eipc", 16) == SamplerConfig("eipc", 16, 4, 0) and pick("ancestral", 32) == SamplerConfig("ancestral", 32, 1, 0)
    with pytest.raises(ValueError, match="no arpc variant at NFE 8 with ge=4; the paper's are: steps=6,ge=3"):
        pick("arpc", 8, ge=4)
    with pytest.raises(ValueError, match=r"choose nfe from \[4, 8, 16, 32, 64\]"):
        pick("eipc", 6)
    with pytest.raises(ValueError, match="AR samplers"):
        pick("ar_greedy", 4)


def test_adapter_nfe_picks_and_records_the_variant(tmp_path):
    from lm_eval.api.registry import get_model

    import blockgen.lm_eval
    from test_gsm8k_code import _bpe_without_sep, _checkpoint

    blockgen.lm_eval.register()
    ckpt = str(_checkpoint(tmp_path / "ckpt", _bpe_without_sep()))
    cls = get_model("blockgen")
    lm = cls.create_from_arg_string(f"pretrained={ckpt},sampler=arpc,nfe=4", {"device": "cpu"})
    assert (lm.sampler.steps, lm.sampler.ge, lm.sampler.warmup) == (3, 2, 1)
    info = lm.get_model_info()["blockgen"]
    assert info["nfe"] == 4 and info["sampler"]["paper_nfe_per_block"] == 4 and info["batch_size"] == 1
    lm = cls.create_from_arg_string(f"pretrained={ckpt},sampler=arpc,nfe=8,ge=2,warmup=0", {"device": "cpu"})
    assert (lm.sampler.steps, lm.sampler.ge, lm.sampler.warmup) == (5, 2, 0)
    lm = cls.create_from_arg_string(f"pretrained={ckpt},nfe=16", {"device": "cpu"})  # default sampler: ancestral
    assert (lm.sampler.name, lm.sampler.steps) == ("ancestral", 16)
    with pytest.raises(ValueError, match="blockgen --model_args: no eipc variant at NFE 4 with steps=3"):
        cls.create_from_arg_string(f"pretrained={ckpt},sampler=eipc,nfe=4,steps=3", {"device": "cpu"})
    with pytest.raises(ValueError, match="nfe=0; must be an integer >= 1"):
        cls.create_from_arg_string(f"pretrained={ckpt},nfe=0", {"device": "cpu"})


def test_makefile_and_demo_read_the_grid(capsys):
    """No copy of the grid elsewhere: the Makefile lists no variant (its sweeps read this module through
    harness/evaluation/sweep.py), and the demo runs each NFE's default variant."""
    from blockgen.harness.demo import DIFFUSION_VARIANTS

    makefile = (REPO / "Makefile").read_text()
    assert "3:2:1" not in makefile and "62:4:56" not in makefile and "4:3:1" not in makefile
    for nfe, variants in DIFFUSION_VARIANTS.items():
        assert variants == tuple(pick(s, nfe) for s in ("ancestral", "eipc", "arpc"))
    # what the Makefile reads: steps:ge:warmup, the default of each NFE
    assert cli.main(["variants", "arpc", "--nfe", "4", "8"]) == 0 and capsys.readouterr().out == "NFE 4: 3:2:1\nNFE 8: 6:3:0\n"
    assert cli.main(["variants", "eipc", "--nfe", "4", "--all", "--steps-only"]) == 0 and capsys.readouterr().out == "NFE 4: 4 4\n"

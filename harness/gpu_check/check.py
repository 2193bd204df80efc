"""`run_gpu_check`: the stages of `blockgen gpu-check` in the order of `STAGES`, each by its deadline
(`GpuCheckConfig.shares`); each stage's failure is recorded in the summary and the others still run. The
stages: train (train_stage.py), generate (generate_stage.py), ddp, lm_eval and scorers
(command_stages.py); the summary's verdict, its table and the rates file: summary.py.
"""

from __future__ import annotations

import json
import os
import platform
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from blockgen.harness.costs.rates import RATES_FILE, write_rates
from blockgen.harness.gpu_check.command_stages import stage_ddp, stage_lm_eval, stage_scorers
from blockgen.harness.gpu_check.config import Budget, GpuCheckConfig
from blockgen.harness.gpu_check.generate_stage import stage_generate
from blockgen.harness.gpu_check.summary import measured_rates, stage_status
from blockgen.harness.gpu_check.timing import free_memory
from blockgen.harness.gpu_check.train_stage import stage_train

STAGE_FUNCTIONS: dict[str, Callable[..., dict]] = {  # (config, device, scale, out, budget) -> the stage's result
    "train": stage_train, "ddp": stage_ddp, "generate": stage_generate, "lm_eval": stage_lm_eval, "scorers": stage_scorers,
}


def _device_info(device: str) -> dict:
    info = {"device": device, "torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(name=props.name, memory_gb=props.total_memory / 1e9, cuda=torch.version.cuda,
                    visible_gpus=torch.cuda.device_count())
    else:
        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


def run_gpu_check(config: GpuCheckConfig) -> dict:
    """Run the stages in `STAGES` order, each by its deadline (`GpuCheckConfig.shares`); each stage's result
    or error goes into the summary (written as JSON)."""
    device = config.resolved_device()
    scale = config.scale()
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shares = config.shares()
    summary: dict = {"mode": "gpu" if device.startswith("cuda") else "cpu", **_device_info(device),
                     "config": asdict(config), "scale": asdict(scale), "stages": {}}
    begin = time.monotonic()
    end_of_share = begin
    for name, share in shares.items():
        end_of_share += share * config.budget_s  # this share, plus what the stages before left unused
        start = time.monotonic()
        try:
            result = STAGE_FUNCTIONS[name](config, device, scale, out, Budget(end_of_share))
        except Exception as err:  # noqa: BLE001 - one failing stage must not lose the others
            result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        result.update(stage_seconds=time.monotonic() - start, share=share, share_s=share * config.budget_s)
        summary["stages"][name] = result
        free_memory(device)
    summary["total_seconds"] = time.monotonic() - begin
    summary["budget"] = {"budget_s": config.budget_s, "shares": shares,
                         "used_s": {name: r["stage_seconds"] for name, r in summary["stages"].items()}}
    cuda = device.startswith("cuda")
    summary["status"] = {name: stage_status(r, cuda) for name, r in summary["stages"].items()}
    summary["failed"] = [name for name, status in summary["status"].items() if status == "failed"]
    summary["ok"] = not summary["failed"]
    rates = measured_rates(summary, out)
    summary["rates"] = str(write_rates(rates, out / RATES_FILE)) if rates else None
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out / "summary.json")
    return summary

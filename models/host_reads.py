"""Counting what makes the host wait for the device, on any device (a CPU shows what a GPU would pay).

On a GPU, an operation whose result the host needs (a Python number from a tensor, a shape that
depends on values, a copy to host memory) waits until every queued kernel has run: the device idles
while Python catches up. `HostReads` counts those operations as they are dispatched, so a test on a
CPU can hold the samplers to a budget of host reads per denoising step and per block:

- `aten._local_scalar_dense`: `.item()`, `int(t)`, `bool(t)`, `if t.any():`;
- value-dependent shapes: `nonzero`, `masked_select`, `unique`, indexing or assigning with a boolean mask;
- a forced copy to host memory: `t.to("cpu", copy=True)`, the form `to_host` uses (on a CPU,
  `.cpu()` and `.tolist()` of a CPU tensor dispatch nothing, so code that reads a result back goes
  through `to_host`, which both devices see).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Under inference_mode `item` and `is_nonzero` arrive whole; elsewhere as `_local_scalar_dense`.
_ALWAYS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default, aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
           aten.unique_dim.default, aten.unique_consecutive.default}
_BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def to_host(t: torch.Tensor) -> list:
    """The tensor's values as Python lists: one transfer (the one host read a sampler makes per block)."""
    return t.to("cpu", copy=True).tolist()


def _is_host_read(func, args, kwargs) -> bool:
    if func in _ALWAYS:
        return True
    if func in _BOOL_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    device = kwargs.get("device")
    to_cpu = device is not None and torch.device(device).type == "cpu"
    if func is aten._to_copy.default:  # a copy by definition
        return to_cpu
    if func in (aten.to.dtype_layout, aten.to.device):  # `to` arrives whole under inference_mode
        # Only a forced copy counts: `.to(device)` of a CPU tensor (an upload on a GPU machine) looks the
        # same on a CPU but copies nothing.
        return to_cpu and bool(kwargs.get("copy"))
    return False


class HostReads(TorchDispatchMode):
    """`with HostReads() as reads: ...`; `reads.count` is the number of host reads, `reads.ops` by op."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_host_read(func, args, kwargs):
            self.count += 1
            self.ops[str(func)] += 1
        return func(*args, **kwargs)

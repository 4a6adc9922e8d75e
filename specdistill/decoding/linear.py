"""How the static forwards multiply by a weight: on the CPU in fp32, by oneDNN with the weight packed once.

Behind `nn.Linear` an fp32 product of 2 or more rows goes to MKL's sgemm, which lays the weight out afresh on every
call, so a K+1-token verify cost up to twice plain decoding's 1-token step (`make bench ARGS=runtime`) and fp32
speculative decoding could run slower than plain. oneDNN with the weight packed once (what inductor's CPU freezing
does) reads each weight once per call whatever the row count, and gives a row the same bits however many rows
share the call (the whole forward is checked row by row, tests/test_runtime.py, tests/test_exactness.py). Packed
for PACK_ROWS rows it serves every M; packed for 1 row, oneDNN picks a matrix-vector layout, slow for 2+ rows.
"""
from __future__ import annotations

import torch

PACK_ROWS = 16


def packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a forward in `dtype` on `device` multiplies through packed weights (bf16 already runs on oneDNN)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def plain(module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


class PackedLinears:
    """Called as linear(module, x): `module`'s product through its weight packed at construction. The packed copy
    does not follow later changes to the module's weight: build it after the weights are final (a runtime is)."""

    def __init__(self, modules):
        with torch.no_grad():
            self.weights = {m: torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACK_ROWS) for m in modules}

    def __call__(self, module, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weights[module], module.bias, "none", [], "")

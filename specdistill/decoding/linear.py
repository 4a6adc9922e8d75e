"""How the static forwards multiply by a weight: on the CPU in fp32, by oneDNN with the weight packed once.

Behind `nn.Linear` an fp32 product of 2 or more rows goes to MKL's sgemm, which lays the weight out afresh on every
call, so a K+1-token verify cost up to twice plain decoding's 1-token step (`make bench ARGS=runtime`) and fp32
speculative decoding could run slower than plain. oneDNN with the weight packed once (what inductor's CPU freezing
does) reads each weight once per call whatever the row count, and gives a row the same bits however many rows
share the call (the whole forward is checked row by row, tests/test_runtime.py, tests/test_exactness.py). Packed
for PACK_ROWS rows it serves every M; packed for 1 row, oneDNN picks a matrix-vector layout, slow for 2+ rows.

Products that read the same input (a layer's q, k and v; its gate and up) are packed as one weight and run as one
call, as vLLM's fused QKV and gate-up linears do: fewer calls a forward, each wide enough to keep both cores
streaming weights (`make bench ARGS=runtime`, "static-fp32 unfused"), and the same bits as the separate products.
"""
from __future__ import annotations

import torch

PACK_ROWS = 16


def packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a forward in `dtype` on `device` multiplies through packed weights (bf16 already runs on oneDNN)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PlainLinears:
    """Called as linear(module, x): `module`'s own product. `many(modules, x)`: each module's product of x."""

    def __call__(self, module, x: torch.Tensor) -> torch.Tensor:
        return module(x)

    def many(self, modules: tuple, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(module(x) for module in modules)


plain = PlainLinears()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def _product(x: torch.Tensor, packed: torch.Tensor, bias) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinears:
    """As PlainLinears, through weights packed at construction. Each tuple in `groups` (modules of one input size)
    is packed as one weight, and `many(group, x)` is one call split into the modules' outputs (fuse=False: each
    apart). The packed copies do not follow later changes to the modules' weights: build them after the weights
    are final (a runtime is)."""

    def __init__(self, modules, groups=(), fuse: bool = True):
        groups = [tuple(group) for group in groups] if fuse else []
        grouped = {module for group in groups for module in group}
        with torch.no_grad():
            self.weights = {m: _pack(m.weight) for m in modules if m not in grouped}
            self.groups = {group: (_pack(torch.cat([m.weight for m in group])), _joint_bias(group),
                                   [m.out_features for m in group]) for group in groups}

    def __call__(self, module, x: torch.Tensor) -> torch.Tensor:
        return _product(x, self.weights[module], module.bias)

    def many(self, modules: tuple, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        group = self.groups.get(modules)
        if group is None:
            return tuple(self(module, x) for module in modules)
        packed, bias, sizes = group
        return _product(x, packed, bias).split(sizes, dim=-1)


def _joint_bias(group) -> torch.Tensor | None:
    """The group's biases end to end (zeros for a module without one); None where none has one."""
    if all(m.bias is None for m in group):
        return None
    return torch.cat([m.weight.new_zeros(m.out_features) if m.bias is None else m.bias.detach() for m in group])

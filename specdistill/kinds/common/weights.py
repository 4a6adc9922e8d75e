"""A head's tensors checked against the names and shapes a loader builds (a released head read back, an export
vLLM will load): every kind's export and warm start ask the same question."""
from __future__ import annotations

from pathlib import Path

from specdistill.errors import SpecdistillError


def check_head_weights(path: Path, state: dict, expected: dict, what: str = "an EAGLE head of this target") -> None:
    """`state`'s tensors must be exactly the `expected` names (name -> shape), each of its shape; `what` names
    the layout they are checked against."""
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise SpecdistillError(f"{path}: tensors do not match {what}: missing {missing}, unexpected {extra}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise SpecdistillError(f"{path}: tensor {name} has shape {list(state[name].shape)}, {what} has "
                                   f"{list(shape)} (hidden/vocab of the head and target differ)")

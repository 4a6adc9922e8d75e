"""The strict-device mode asked for by the environment, for every entry point: `specdistill <stage>` and each
launcher rank of training and of the cache pass.
"""
from __future__ import annotations

import contextlib
import os


def strict_device_from_env():
    """SPECDISTILL_STRICT_DEVICE=1 (make gpu-check): the stage runs under device.strict_device(), where a tensor
    made without device= stops it, naming file:line. torch is imported only then: `config` and `report` run
    without it."""
    if os.environ.get("SPECDISTILL_STRICT_DEVICE", "") in ("", "0"):
        return contextlib.nullcontext()
    from specdistill import device

    return device.strict_device()

"""The DeepSpeed config, written from the recipe's `train` section (one place, so a dry run can show it).

The LR schedule (linear warmup, then cosine down to min_lr_ratio) is `lr_factor` below, handed to
DeepSpeed as the client scheduler: DeepSpeed's WarmupCosineLR spends its first steps at lr 0.
"""
from __future__ import annotations

import math


def build_ds_config(train, world_size: int) -> dict:
    """ZeRO stage, precision, batch sizes, clipping, AdamW or Muon + AdamW (the LR schedule: `lr_scheduler`)."""
    cfg = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "train_batch_size": train.micro_batch_size * train.gradient_accumulation_steps * world_size,
        "gradient_clipping": train.grad_clip,
        "optimizer": {"type": "AdamW", "params": {
            "lr": train.lr, "betas": list(train.betas), "eps": 1e-8, "weight_decay": train.weight_decay,
            "torch_adam": True}},  # torch's AdamW: runs on CPU too, no fused-kernel build
        "zero_optimization": {"stage": train.zero_stage},
        "steps_per_print": 10**9,  # our own logging (tqdm, TensorBoard) instead of DeepSpeed's
        "wall_clock_breakdown": False,
    }
    if train.optimizer == "muon":  # DeepSpeed tags matrices (not embed / lm_head) for Muon, the rest for AdamW
        cfg["optimizer"] = {"type": "Muon", "params": {
            "lr": train.lr, "muon_lr": train.muon_lr, "adam_lr": train.lr, "momentum": 0.95,
            "betas": list(train.betas), "eps": 1e-8, "weight_decay": train.weight_decay, "torch_adam": True}}
    if train.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif train.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12}
    if train.zero_stage >= 2:
        cfg["zero_optimization"].update(overlap_comm=True, contiguous_gradients=True,
                                        reduce_bucket_size=5e8, allgather_bucket_size=5e8)
    return cfg


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of train.lr for optimizer step `step` (0-based): linear warmup, then cosine to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_scheduler(train):
    """A callable DeepSpeed turns into the scheduler (its state is saved in DeepSpeed's checkpoint)."""
    from functools import partial

    from torch.optim.lr_scheduler import LambdaLR

    factor = partial(lr_factor, warmup=train.warmup_steps, total=train.max_steps, min_ratio=train.min_lr_ratio)
    return lambda optimizer: LambdaLR(optimizer, factor)

"""The DeepSpeed config, written from the recipe's `train` section (one place, so a dry run can show it)."""
from __future__ import annotations


def build_ds_config(train, world_size: int) -> dict:
    """ZeRO stage, precision, batch sizes, clipping, AdamW, warmup-then-cosine LR down to min_lr_ratio."""
    cfg = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "train_batch_size": train.micro_batch_size * train.gradient_accumulation_steps * world_size,
        "gradient_clipping": train.grad_clip,
        "optimizer": {"type": "AdamW", "params": {
            "lr": train.lr, "betas": list(train.betas), "eps": 1e-8, "weight_decay": train.weight_decay,
            "torch_adam": True}},  # torch's AdamW: runs on CPU too, no fused-kernel build
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": train.max_steps, "warmup_num_steps": max(1, train.warmup_steps),
            "warmup_min_ratio": 0.0, "cos_min_ratio": train.min_lr_ratio, "warmup_type": "linear"}},
        "zero_optimization": {"stage": train.zero_stage},
        "steps_per_print": 10**9,  # our own logging (tqdm, TensorBoard) instead of DeepSpeed's
        "wall_clock_breakdown": False,
    }
    if train.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif train.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12}
    if train.zero_stage >= 2:
        cfg["zero_optimization"].update(overlap_comm=True, contiguous_gradients=True,
                                        reduce_bucket_size=5e8, allgather_bucket_size=5e8)
    return cfg

"""The training loop under DeepSpeed: one code path for 1 process (in-process) and N processes.

Run by `specdistill train` (train/launch.py), or per process by the DeepSpeed launcher:
    deepspeed --num_gpus N --module specdistill.train.loop --recipe RESOLVED.yaml

Data order is a pure function of (seed, step): step s takes the s-th block of `global batch`
sequences from an endless stream of per-epoch permutations, and micro batch k of it goes to rank
k % world (accumulation index k // world). So 1 process x 2 accumulation steps and 2 processes x 1
see the same micro batches, and a resumed run continues exactly where the interrupted one was.

Everything a step touches lives on the rank's device (`device.resolve(recipe.device)`, once per process):
the batches (read by a DataLoader: workers, pinned memory and prefetch on CUDA), the feature-noise
generators, the loss and the collectives (NCCL reduces only tensors on the GPU).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from tqdm import tqdm

from specdistill import device as devices
from specdistill import faults, kinds, layout
from specdistill.data.cache_reader import OnlineDataset, collate, open_cache
from specdistill.errors import Preempted, SpecdistillError
from specdistill.eval.chain_tau import heldout_chain_tau
from specdistill.formats import append_jsonl, read_jsonl, read_metrics, write_jsonl
from specdistill.processes import join, use_accelerator
from specdistill.recipe import load_recipe
from specdistill.strict import strict_device_from_env
from specdistill.target import DTYPES, fingerprint_target, load_target_parts
from specdistill.train import checkpoint, preemption, replay
from specdistill.train.ds_config import build_ds_config, lr_scheduler
from specdistill.train.report_to import Reporters


# ---- data order -------------------------------------------------------------------------------

def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g, device="cpu").tolist()  # host side: the order is the same on any device


def step_micro_batches(n: int, step: int, micro: int, accum: int, world: int, rank: int, seed: int) -> list[list[int]]:
    """Sequence indices of this rank's micro batches for optimizer step `step` (0-based)."""
    per_step = micro * accum * world
    orders: dict[int, list[int]] = {}
    flat = []
    for i in range(step * per_step, (step + 1) * per_step):
        epoch, j = divmod(i, n)
        if epoch not in orders:
            orders[epoch] = _epoch_order(n, seed, epoch)
        flat.append(orders[epoch][j])
    chunks = [flat[k * micro:(k + 1) * micro] for k in range(accum * world)]
    return [chunks[m * world + rank] for m in range(accum)]


class StepBatches(torch.utils.data.Sampler):
    """This rank's micro batches (lists of sequence indices), step after step from `start` to `stop`: the
    DataLoader's batch sampler, so workers read ahead while the order stays `step_micro_batches`'s."""

    def __init__(self, n: int, start: int, stop: int, train_cfg, world: int, rank: int):
        self.n, self.start, self.stop, self.tc, self.world, self.rank = n, start, stop, train_cfg, world, rank

    def __iter__(self):
        tc = self.tc
        for step in range(self.start, self.stop):
            yield from step_micro_batches(self.n, step, tc.micro_batch_size, tc.gradient_accumulation_steps,
                                          self.world, self.rank, tc.seed)

    def __len__(self) -> int:
        return (self.stop - self.start) * self.tc.gradient_accumulation_steps


def loader_workers(device: torch.device, processes_per_node: int, cores: int | None = None) -> int:
    """Reader processes per training process: on CUDA up to 4 of the node's cores per GPU process (the step runs
    on the GPU, the cores are free to read ahead); on the CPU none: the step needs every core, and the reader
    keeps up without help (`make bench ARGS=train`: reader tokens/s vs a step's)."""
    if torch.device(device).type != "cuda":
        return 0
    cores = cores or os.cpu_count() or 1
    return max(1, min(4, cores // max(1, processes_per_node) - 1))


def read_batches(data, sampler, device: torch.device, workers: int) -> Iterator[dict]:
    """Collated micro batches in the sampler's order, read by a DataLoader. An online cache computes with the
    target in this process: no workers. Pinned host memory on CUDA, so the copy to the GPU runs beside the step."""
    online = isinstance(data, OnlineDataset)
    workers = 0 if online else workers
    pin = torch.device(device).type == "cuda" and not online
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=collate, num_workers=workers, pin_memory=pin,
                        prefetch_factor=4 if workers else None, persistent_workers=False)
    with torch.device("cpu"):  # the loader's own bookkeeping (its workers' base seed) lives on the host
        return iter(loader)


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# ---- host memory ------------------------------------------------------------------------------

RELEASE_EVERY = 10  # steps between returns of freed host memory to the OS (CPU training)


def release_freed_host_memory() -> bool:
    """Hand the C allocator's free pages back to the OS (glibc `malloc_trim`); False where there is none.

    Why: on the CPU every micro batch has its own sequence length, so glibc's heap fragments and a rank's resident
    memory grew ~30 MB a step, never given back: a 12,000-row run was OOM-killed at step ~825 of 1,008 (rank 0 at
    11.8 GB). Trimming every RELEASE_EVERY steps bounds it (docs/STAGES.md "Stages in more detail", train)."""
    malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols: glibc's where linked
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


# ---- collectives: on the tensors' own device (NCCL refuses CPU tensors) ----------------------------

def all_mean(values: torch.Tensor, world: int) -> torch.Tensor:
    """The mean over ranks, on the device and in the dtype of `values`."""
    values = values.detach().clone()
    if world > 1:
        dist.all_reduce(values)
    return values / world


def all_sum(value: torch.Tensor, world: int) -> torch.Tensor:
    """The sum over ranks, on the device and in the dtype of `value`."""
    value = value.detach().clone()
    if world > 1:
        dist.all_reduce(value)
    return value


# ---- the loop ----------------------------------------------------------------------------------

@dataclass
class RunState:
    """What every step and save of one training process reads: who it is, where it writes, how far it got."""
    recipe: object
    rank: int
    world: int
    device: torch.device
    run_dir: Path
    writer: Reporters | None  # rank 0 only: TensorBoard + train.report_to
    last_good: Path | None  # the newest complete checkpoint (named when a NaN stops the run)
    meta: dict  # what draft_config.json records beside the draft's own config
    tokens_seen: int = 0  # trained tokens so far, all ranks (resumed from the last checkpoint)


def _heldout_batches(cache, recipe, device) -> list[dict]:
    try:
        held = open_cache(cache, "heldout", recipe.target, device)  # cache.mode online: the target computes features
    except SpecdistillError:
        return []
    mb = recipe.train.micro_batch_size
    n = min(len(held), recipe.train.heldout_batches * mb)
    return [to_device(collate([held[i] for i in range(a, min(a + mb, n))]), device) for a in range(0, n, mb)]


def _trim_log(run_dir: Path, keep_through: int) -> None:
    """Drop log lines past the step we restart from (an interrupted run may have logged beyond its checkpoint)."""
    path = run_dir / "train_log.jsonl"
    if not path.exists():
        return
    kept = [r for r in read_jsonl(path) if r["step"] <= keep_through]
    write_jsonl(path, kept)


def _log_line(run_dir: Path, record: dict) -> None:
    append_jsonl(run_dir / "train_log.jsonl", [record])  # append-only; one line per step


def train(recipe, stop_after: int | None = None, device: torch.device | None = None) -> list[dict]:
    """Train (resuming from the latest complete checkpoint). Returns rank 0's per-step log records.

    stop_after: stop once this step is done (simulates an interruption; used by the resume test).
    device: the resolved `recipe.device` when the caller resolved it already (in-process runs).
    """
    if device is None:
        device = devices.resolve(recipe.device)
        use_accelerator(device)
    import deepspeed  # deferred: seconds to import, and `specdistill train` may hand over to the launcher

    tc, draft_kind = recipe.train, kinds.kind(recipe.draft.kind)
    rank, world = join(device)
    run_dir = recipe.run_dir
    preemption.record_start(run_dir, rank)
    cache = layout.cache_dir(run_dir)
    data = open_cache(cache, "train", recipe.target, device)  # cache.mode online: the target computes features
    if len(data) == 0:
        raise SpecdistillError(f"{cache}: the train split has no sequences")
    torch.manual_seed(tc.seed)  # same draft initialisation on every rank and every run
    devices.warn_if_bf16_emulated(DTYPES[tc.precision], device, "training computes", "train.precision=fp32")
    with torch.device(device):  # modules are made where they train (no host copy of a large draft LM first)
        parts = load_target_parts(recipe.target, device, DTYPES[tc.precision])
        head = draft_kind.build(recipe, parts, data)
        objective = draft_kind.Objective(head, parts, recipe.loss, data)
    trainable = [p for p in objective.parameters() if p.requires_grad]
    ds_engine, _, _, _ = deepspeed.initialize(model=objective, model_parameters=trainable,
                                              config=build_ds_config(tc, world), lr_scheduler=lr_scheduler(tc))
    start, tokens_seen = 0, 0
    latest = checkpoint.latest_checkpoint(run_dir)
    if latest is not None:
        checkpoint.load_ds_state(ds_engine, latest)
        start = layout.step_of(latest)
        tokens_seen = (read_metrics(latest) or {}).get("tokens_seen", 0)
        if rank == 0:
            print(f"resuming from {latest.name}", flush=True)
    if objective.replay_weight:  # Draft-OPD: where verification rejects the head training starts from
        depth = replay.build_or_read(run_dir, objective, data, recipe.eval.k, tc.micro_batch_size, rank, world,
                                     device, resumed=latest is not None, started_from=recipe.draft.init_from)
        data = replay.WithReplay(data, depth)
    meta = {"kind": draft_kind.NAME, "target": {**recipe.target.model_dump(mode="json"), "fingerprint": _fingerprint(recipe)},
            "loss": recipe.loss.model_dump(mode="json"), **objective.recorded()}
    heldout = _heldout_batches(cache, recipe, device)
    if rank == 0:
        _trim_log(run_dir, start)
    run = RunState(recipe, rank, world, device, run_dir,
                   Reporters(recipe, layout.tb_dir(run_dir)) if rank == 0 else None, latest, meta, tokens_seen)
    stop = tc.max_steps if stop_after is None else min(tc.max_steps, max(stop_after, start))
    batches = read_batches(data, StepBatches(len(data), start, stop, tc, world, rank), device,
                           loader_workers(device, min(tc.num_gpus, world)))
    bar = tqdm(total=tc.max_steps, initial=start, desc=f"train {draft_kind.NAME}", disable=rank != 0, mininterval=1.0)
    history = []
    preempt = preemption.StopRequests().install()  # SIGTERM: save at the next step boundary, then stop
    try:
        for step in range(start, stop):
            t0 = time.time()
            record = _train_step(run, ds_engine, batches, step)
            if device.type == "cpu" and (step + 1) % RELEASE_EVERY == 0:
                release_freed_host_memory()
            record["tokens_per_s"] = record["tokens"] / max(time.time() - t0, 1e-9)
            run.tokens_seen += record["tokens"]
            record["tokens_seen"] = run.tokens_seen  # all ranks, pads excluded: the x axis of the data-scaling curve
            history.append(record)
            if rank == 0:
                _log_line(run_dir, record)
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
                if (step + 1) % tc.log_every == 0 or step == start:
                    for k, v in record.items():
                        if k != "step" and v is not None:
                            run.writer.add_scalar(f"train/{k}", v, step + 1)
            done = step + 1
            if done % tc.save_every == 0 or done == tc.max_steps:
                run.last_good = _save(run, ds_engine, done, heldout, record)
            if done < tc.max_steps and preempt.requested(world, device):
                if run.last_good is None or layout.step_of(run.last_good) != done:
                    run.last_good = _save(run, ds_engine, done, heldout, record)
                raise preemption.stopped(run_dir, run.last_good, rank)
    finally:
        preempt.restore()
        bar.close()
        if run.writer is not None:
            run.writer.close()
    return history


def _train_step(run: RunState, ds_engine, batches, step: int) -> dict:
    """One optimizer step: per micro batch, batch -> objective -> loss -> backward; then the step."""
    tc, world = run.recipe.train, run.world
    objective = ds_engine.module
    lr = ds_engine.get_lr()[0]
    sums, tokens = None, torch.zeros((), dtype=torch.long, device=run.device)
    accum = tc.gradient_accumulation_steps
    grad_norm = None
    objective.progress = step / tc.max_steps  # the hybrid objective's ramp (specdistill/objective/base.py)
    for m in range(accum):
        batch = to_device(next(batches), run.device)
        k = m * world + run.rank  # the micro batch's index in the global batch: same noise for any world size
        g = devices.generator(run.device, (tc.seed * 100_003 + step) * 65_536 + k)
        loss, components = objective.loss(ds_engine(batch, generator=g))
        values = all_mean(torch.stack([loss.detach(), *components.values()]).float(), world)
        if not torch.isfinite(values).all():
            where = f"last good checkpoint: {run.last_good.name}" if run.last_good else "no checkpoint was written"
            raise SpecdistillError(f"train: loss became {values[0].item()} at step {step + 1} "
                                   f"(micro batch {m}); stopping, {where}")
        sums = values if sums is None else sums + values
        tokens += batch["attention_mask"].sum()
        ds_engine.backward(loss)
        if m == 0:
            faults.point("step", step + 1, run.rank)  # fault suite: a kill in the middle of a step
        if m == accum - 1:
            grad_norm = _grad_norm(ds_engine)
        ds_engine.step()
    sums = (sums / accum).tolist()
    record = {"step": step + 1, "loss": sums[0], "lr": lr, "grad_norm": grad_norm,
              "tokens": int(all_sum(tokens, world).item())}
    record.update(dict(zip(components, sums[1:])))
    return record


def _grad_norm(ds_engine) -> float | None:
    norm = ds_engine.get_global_grad_norm()
    if norm is None and ds_engine.zero_optimization_stage() == 0:  # plain DP: grads are whole on each rank
        grads = [p.grad.float().norm() for p in ds_engine.module.parameters() if p.grad is not None]
        norm = torch.stack(grads).norm().item() if grads else 0.0
    return None if norm is None else float(norm)


def _fingerprint(recipe) -> dict | None:
    try:
        return fingerprint_target(recipe.target)
    except Exception as e:  # a hub target without network: the checkpoint still records the path
        return {"error": str(e).splitlines()[0][:200]}


def _save(run: RunState, ds_engine, step: int, heldout, record) -> Path:
    recipe, objective = run.recipe, ds_engine.module
    draft_kind = kinds.kind(recipe.draft.kind)
    ds_engine.eval()
    metrics = {"step": step, "train_loss": record["loss"], "tokens_seen": record["tokens_seen"]}
    t0 = time.time()
    metrics["heldout"] = objective.offline_metrics(heldout) if heldout else {"note": "no heldout split"}
    t1 = time.time()
    if heldout and recipe.train.heldout_chain_positions:  # the T=0 chain as decoding drafts it (eval/chain_tau.py)
        metrics["heldout"].update(heldout_chain_tau(draft_kind, objective.head, objective.parts, heldout,
                                                    recipe.eval.k, recipe.train.heldout_chain_positions))
    if run.rank == 0:  # what the held-out scoring cost: the plan prices a run's saves from its probe's (plan_stage.py)
        append_jsonl(layout.heldout_cost_path(recipe.run_dir),
                     [{"step": step, "rows": sum(int(b["input_ids"].shape[0]) for b in heldout),
                       "offline_s": round(t1 - t0, 3), "chain_s": round(time.time() - t1, 3),
                       "chain_positions": metrics["heldout"].get("chain_positions", 0)}])
    ds_engine.train()
    own = _gathered_own_state(ds_engine, draft_kind, objective.head)
    config = {**run.meta, "config": draft_kind.checkpoint_config(objective.head), "step": step}
    if run.writer is not None:
        for k, v in metrics["heldout"].items():
            if isinstance(v, (int, float)) and k not in ("temperature",):
                run.writer.add_scalar(f"heldout/{k}", v, step)
            elif isinstance(v, dict):  # e.g. simulated_tau per temperature: heldout/simulated_tau/T0
                for t, x in v.items():
                    if isinstance(x, (int, float)):
                        run.writer.add_scalar(f"heldout/{k}/T{t}", x, step)
        run.writer.flush()
    saved = checkpoint.save_checkpoint(recipe.run_dir, step, ds_engine, own, config, metrics, run.rank)
    if run.rank == 0:  # keep_last / best link (train/checkpoint.py)
        print(f"saved {saved.name}; " + checkpoint.housekeeping(recipe.run_dir, recipe.train.keep_last,
                                                                recipe.train.best_metric), flush=True)
    return saved


def _gathered_own_state(ds_engine, draft_kind, head) -> dict:
    if ds_engine.zero_optimization_stage() == 3:  # parameters are partitioned: gather them to save
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(head.parameters()), modifier_rank=None):
            return draft_kind.own_state_dict(head)
    return draft_kind.own_state_dict(head)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="one training process (started by the DeepSpeed launcher)")
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # set by the launcher (also in LOCAL_RANK)
    parser.add_argument("--stop_after", type=int, default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except SpecdistillError as e:
        print(f"specdistill train: error: {e}", flush=True)
        return 1
    rank = int(os.environ.get("RANK", 0))
    try:
        with strict_device_from_env():  # a launcher rank honours SPECDISTILL_STRICT_DEVICE as `specdistill` does
            train(recipe, stop_after=args.stop_after)
    except Preempted as e:
        preemption.record_end(recipe.run_dir, rank, "preempted")
        print(f"specdistill train: {e}", flush=True)
        return Preempted.EXIT_CODE
    except SpecdistillError as e:
        preemption.record_end(recipe.run_dir, rank, f"error: {e}")
        print(f"specdistill train: error: {e}", flush=True)
        return 1
    except BaseException as e:  # e.g. a collective failing because another rank died: recorded, then raised
        preemption.record_end(recipe.run_dir, rank, f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        raise
    preemption.record_end(recipe.run_dir, rank, "ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Draft-OPD's replay set (arXiv 2605.29343) at T=0, offline: the depths where verification rejects the head.

Draft-OPD trains a head on what decoding exposes: the target keeps the text on its own path (target-assisted
rollouts) and drafting is replayed where verification rejected a draft. At T=0 both come from the cache, with no
decoding: the target's own answers (`cache.regenerate`) are the text lossless decoding commits, and the head's
chains along them are computable from one batched, teacher-forced unroll (the objective's `chain_hits`: its own
states; where the earlier depths were accepted its drafted tokens are the text's), stepped as decoding steps them
(`walk`). tests/test_replay.py checks the steps against the engine's drafter replayed along the same text
(eval/chain_tau.py `replay`), which along the target's continuations gives the measured tau (experiments/data-ab).

A step that starts with n committed tokens drafts token n from prediction position n - 2 (the objective's step s at
position t predicts token t + 2 + s). A rejected step with `a` accepted depths marks position n - 2 with a + 1: the
accepted depths and the first rejected one, as verification exposed them; the objective counts those (position,
depth) pairs `1 + loss.replay_weight` times. Each assistant turn is walked from its first token, as decoding starts
a reply. The replay runs once, with the head training starts from (a warm start: `draft.init_from`), before the
first step, each process a share of the rows; the run's `replay.safetensors` keeps it, and a resumed run reads it
back (its head has moved on).
"""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from specdistill import layout
from specdistill.data.cache_reader import collate
from specdistill.errors import SpecdistillError
from specdistill.formats import read_replay, read_replay_header, write_replay
from specdistill.objective.base import counted

def turns(trained: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of trained positions (an assistant turn) of one row."""
    edges = torch.diff(trained.int(), prepend=trained.new_zeros(1).int(), append=trained.new_zeros(1).int())
    starts, ends = (edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, ends))


def walk(hits: torch.Tensor, trained: torch.Tensor, k: int) -> tuple[torch.Tensor, Counter]:
    """One row's chains of k drafts, stepped as decoding steps them, from `hits` [k, L] (step s at position t
    drafts token t + 2 + s right; the objective's `chain_hits`) and `trained` [L]: depth [L] int8 (0: no rejected
    step drafts from there) and the row's counts. Depth i is judged only where depths < i were accepted and its
    token lies in the turn (eval/chain_tau.py `replay`'s rule; tests/test_replay.py: the same steps)."""
    depth = torch.zeros(trained.numel(), dtype=torch.int8)
    hit = hits.tolist()
    counts = Counter(tokens=0, steps=0, rejected=0)
    for start, end in turns(trained):
        n = max(start, 2)  # the first draft reads the state of position n - 2
        counts["tokens"] += max(end - n, 0)
        while n < end:
            accepted = 0
            while accepted < k and n + accepted < end and hit[accepted][n - 2]:
                accepted += 1
            counts["steps"] += 1
            if accepted < k and n + accepted < end:  # verification rejected depth accepted + 1
                depth[n - 2] = accepted + 1
                counts["rejected"] += 1
            n += accepted + 1
    return depth, counts


@torch.no_grad()
def compute(objective, data, k: int, micro_batch: int, rank: int, world: int, device) -> tuple[list, Counter]:
    """This process's share of the rows (i = rank mod world), `micro_batch` rows a forward: [(i, depth)] and its
    counts."""
    was_training = objective.training
    objective.eval()
    out, counts = [], Counter(tokens=0, steps=0, rejected=0)
    try:
        mine = list(range(rank, len(data), world))
        for a in range(0, len(mine), micro_batch):
            rows = mine[a:a + micro_batch]
            batch = {key: v.to(device) for key, v in collate([data[i] for i in rows]).items()}
            hits = objective.chain_hits(batch, k).cpu()
            trained = counted(batch).cpu()
            for b, i in enumerate(rows):
                L = data.lengths[i]
                depth, c = walk(hits[:, b, :L], trained[b, :L], k)
                out.append((i, depth))
                counts.update(c)
    finally:
        objective.train(was_training)
    return out, counts


def row_offsets(lengths: list[int]) -> list[int]:
    """Where each row starts in the flat depth tensor (and where the last ends)."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets


def build_or_read(run_dir: Path, objective, data, k: int, micro_batch: int, rank: int, world: int, device,
                  resumed: bool, started_from: str | None) -> torch.Tensor:
    """The replay's depths over the train split, flat in row order (int8, one per cached token): read from the
    run's replay file, or computed by every process together (rank 0 writes the file). started_from: the warm
    start's path (draft.init_from), recorded: a file made from another start is refused, not reused."""
    path = layout.replay_path(run_dir)
    total = sum(data.lengths)
    made_by = {"k": k, "init_from": started_from, "positions": total}
    if path.is_file():
        _, recorded = read_replay_header(path)
        if recorded != made_by:
            raise SpecdistillError(f"{path}: made for {recorded}, this run has {made_by}; train with --restart "
                                   f"(or remove the file) to replay again")
        return read_replay(path)
    if resumed:
        raise SpecdistillError(f"{path}: missing, and training resumes from a checkpoint: the head now is not the "
                               f"one the replay must be drafted by; train with --restart to start again")
    t0 = time.time()
    mine, counts = compute(objective, data, k, micro_batch, rank, world, device)
    shares = [(mine, counts)]
    if world > 1:
        shares = [None] * world
        dist.all_gather_object(shares, (mine, counts))
    offsets = row_offsets(data.lengths)
    depth, counted_all = torch.zeros(total, dtype=torch.int8), Counter(tokens=0, steps=0, rejected=0)
    for rows, c in shares:
        for i, d in rows:
            depth[offsets[i]:offsets[i + 1]] = d
        counted_all.update(c)
    made = {"rows": len(data), "k": k, **counted_all}
    made["tau"] = round(made["tokens"] / made["steps"], 4) if made["steps"] else 0.0
    made["seconds"] = round(time.time() - t0, 2)
    if rank == 0:
        write_replay(path, depth, made, made_by)
        print(f"replay (Draft-OPD): {made['rows']} rows, {made['tokens']} trained tokens walked in "
              f"{made['steps']} steps of K={k} (tau {made['tau']:.3f}), {made['rejected']} rejected; "
              f"{made['seconds']:.0f} s", flush=True)
    return depth


def summary(run_dir: Path) -> dict | None:
    """What the run's replay counted and cost (None: the run has none)."""
    path = layout.replay_path(run_dir)
    return read_replay_header(path)[0] if path.is_file() else None


class WithReplay(Dataset):
    """The train split's rows with `replay_depth` [L] (long) beside the cached tensors."""

    def __init__(self, data, depth: torch.Tensor):
        self.data, self.depth, self.offsets = data, depth, row_offsets(data.lengths)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = self.data[i]
        item["replay_depth"] = self.depth[self.offsets[i]:self.offsets[i + 1]].long()
        return item

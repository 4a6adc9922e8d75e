"""EAGLE-3's training objective: training-time test, the head unrolled `ttt_steps` times on its own states
(`ttt_forward`, as SpecForge's `OnlineEagle3Model`), step s weighted ttt_decay**s; q against the target's p
restricted to the draft vocabulary. Offline metrics: the first drafted token against the target's FULL
distribution, and acceptance per unrolled depth.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from specdistill.errors import SpecdistillError
from specdistill.kinds.common.heads import ttt_mask
from specdistill.kinds.eagle3.model import Eagle3Head
from specdistill.metrics import acceptance, divergences, top1_match, total_variation_outside
from specdistill.target import target_logits_from_hidden
from specdistill.objective import losses
from specdistill.objective.base import BaseObjective, counted
from specdistill.objective.offline_metrics import DepthSums, FirstDraftSums


def ttt_forward(head: Eagle3Head, input_ids, aux_features, attention_mask, steps: int, noise: float = 0.0,
                generator=None, keep: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Unroll the head `steps` times over a batch (training-time test).

    Step s at position t reads token x[t+1+s] and predicts token x[t+2+s]; returns the draft-vocab logits
    of each step, [B, T, Vd]; positions whose inputs fall past the sequence are the caller's to mask.
    keep: one bool [B, T] per step; only those positions get logits, [n_s, Vd] (the LM head is about
    half a step's cost, and prompt tokens are not trained).
    """
    B, T = input_ids.shape
    cache = DynamicCache(config=head.config)
    state = head.project(aux_features)
    if noise > 0:  # EAGLE's feature noise, on the fused state
        u = torch.rand(state.shape, generator=generator, dtype=torch.float32, device=generator.device)
        u = u.to(state.device, state.dtype)  # drawn on the generator's device: the rank's, in training
        state = state + (2 * u - 1) * noise * state.detach().std()
    outs = []
    base = torch.arange(T, device=input_ids.device).expand(B, -1)
    for s in range(steps):
        ids = torch.zeros_like(input_ids)
        ids[:, :T - 1 - s] = input_ids[:, 1 + s:]
        mask = ttt_mask(T, s, attention_mask)
        state = head(ids, state, base + s, past_key_values=cache, attention_mask=mask)
        outs.append(head.logits(state if keep is None else state[keep[s]]))
    return outs


class Objective(BaseObjective):
    def step_positions(self, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(first, counted): step s at position t predicts token t+2+s. `first`: step 0 at every trained
        position (what the offline metrics measure, draft-vocabulary misses included); counted[s]: step s
        where that token is trained and inside the draft vocabulary (the draft cannot propose others)."""
        ids = batch["input_ids"]
        B, T = ids.shape
        trained = counted(batch)
        in_vocab = self.head.t2d[ids]
        first = torch.zeros(B, T, dtype=torch.bool, device=ids.device)
        first[:, :T - 2] = trained[:, 2:]
        steps = []
        for s in range(min(self.head.config.ttt_steps, T - 2)):  # later steps would have no positions left
            c = torch.zeros(B, T, dtype=torch.bool, device=ids.device)
            c[:, :T - 2 - s] = (trained & in_vocab)[:, 2 + s:]
            steps.append(c)
        return first, steps

    def forward(self, batch: dict, generator: torch.Generator | None = None) -> dict:
        """Per unroll step, q and the target's p restricted to the draft vocabulary and renormalised at the
        counted positions (`steps`; step 0's also at the top level); `metric_*`: step 0 at every trained
        position, with the target's final states, for the full-vocabulary metrics."""
        if "hidden_aux" not in batch or "hidden_last" not in batch:
            raise SpecdistillError("draft.kind eagle3 needs hidden_aux and hidden_last in the cache (cache.store)")
        head, parts = self.head, self.parts
        noise = self.loss_cfg.feature_noise if generator is not None else 0.0
        ids, att = batch["input_ids"], batch["attention_mask"]
        T = ids.shape[1]
        dtype = parts.lm_head.weight.dtype
        first, steps_at = self.step_positions(batch)
        aux = batch["hidden_aux"].to(dtype).flatten(2)  # [B, T, A*H]
        logits = ttt_forward(head, ids, aux, att, len(steps_at), noise, generator, [first] + steps_at[1:])
        draft_ids = head.draft_ids
        last = batch["hidden_last"].to(dtype)
        target_rows = parts.lm_head.weight[draft_ids]  # the target's LM head over the draft vocabulary
        steps = []
        for s, (c, q) in enumerate(zip(steps_at, logits)):
            if s == 0:
                q = q[c[first]]
            with torch.no_grad():  # target logits over the draft vocabulary, at the positions counted
                p = target_logits_from_hidden(parts.config, target_rows, last[:, 1 + s:][c[:, :T - 1 - s]])
            steps.append({"q_logits": q, "p_logits": p})
        out = {**steps[0], "steps": steps, "counted_at": steps_at, "draft_ids": draft_ids,
               "metric_q_logits": logits[0], "metric_f": last[:, 1:][first[:, :T - 1]]}
        if "replay_depth" in batch:  # Draft-OPD: step s at a position verification exposed to depth > s
            out["replayed_at"] = [batch["replay_depth"][c] > s for s, c in enumerate(steps_at)]
        return out

    @property
    def replay_weight(self) -> float:
        return self.loss_cfg.replay_weight

    @torch.no_grad()
    def chain_hits(self, batch: dict, k: int) -> torch.Tensor:
        """[k, B, T] bool: unroll step s at position t drafts the target's greedy token t + 2 + s (its top-1 over
        the draft vocabulary). The unroll is the drafter's own computation (tests/test_eagle3.py), teacher-forced:
        where depths < s were accepted it is what decoding drafts (train/replay.py walks the chains from it)."""
        if k > self.head.config.ttt_steps:
            raise SpecdistillError(f"loss.replay_weight: eval.k {k} drafts more than draft.ttt_steps "
                                   f"{self.head.config.ttt_steps} unrolled steps")
        parts, ids = self.parts, batch["input_ids"]
        T = ids.shape[1]
        dtype = parts.lm_head.weight.dtype
        trained = counted(batch)
        # step s at t is judged where training counts it (its token trained and in the draft vocabulary; one outside
        # it is never drafted, a miss either way)
        judged = self.step_positions(batch)[1][:k]
        logits = ttt_forward(self.head, ids, batch["hidden_aux"].to(dtype).flatten(2), batch["attention_mask"],
                             len(judged), keep=judged)
        needed = torch.zeros_like(trained)  # the target's greedy choice of each trained token (the LM head is the cost)
        needed[:, :T - 1] = trained[:, 1:]
        greedy = torch.full(ids.shape, -1, dtype=torch.long, device=ids.device)
        greedy[needed] = target_logits_from_hidden(parts.config, parts.lm_head,
                                                   batch["hidden_last"][needed].to(dtype)).argmax(-1)
        hits = torch.zeros((k,) + tuple(ids.shape), dtype=torch.bool, device=ids.device)
        for s, (c, q) in enumerate(zip(judged, logits)):
            hits[s][c] = self.head.draft_ids[q.argmax(-1)] == greedy[:, 1 + s:][c[:, :T - 1 - s]]
        return hits

    def loss(self, pred: dict):
        """Per unroll step, weighted ttt_decay**s (EAGLE-3 / SpecForge use 0.8). With loss.ttt_wrong_weight < 1
        (GRIFFIN-style), a position of step s >= 1 whose step s-1 predicted the wrong token (its input state was
        already off the target's path) counts that much in step s's mean. With loss.replay_weight (Draft-OPD,
        train/replay.py), a position whose step s verification exposed counts 1 + replay_weight times."""
        cfg = self.loss_cfg
        total, components, weights = 0.0, {}, 0.0
        wrong = None  # [B, T]: step s-1's top-1 missed the target's at that start position
        for s, step in enumerate(pred["steps"]):
            log_p, log_q = losses.distribution_logprobs(step, cfg.temperature)
            at = pred["counted_at"][s]
            rows = None
            if wrong is not None:
                rows = torch.where(wrong[at], cfg.ttt_wrong_weight, 1.0)
            if "replayed_at" in pred and cfg.replay_weight:
                replayed = 1.0 + cfg.replay_weight * pred["replayed_at"][s].float()
                rows = replayed if rows is None else rows * replayed
            dist, _ = self.distribution_loss(log_p, log_q, rows)
            if cfg.ttt_wrong_weight < 1:
                wrong = torch.zeros_like(at)
                wrong[at] = log_q.argmax(-1) != log_p.argmax(-1)
            total = total + cfg.ttt_decay ** s * dist
            weights += cfg.ttt_decay ** s
            components[f"step{s}"] = dist.detach()
        return total / weights, components

    def _full_p_at_step(self, batch, s: int, n: int):
        """The target's FULL-vocabulary p at the positions unroll step s counts (`step_positions`' rule);
        None if the count disagrees with the step's n rows (then the caller keeps the restricted p)."""
        ids = batch["input_ids"]
        B, T = ids.shape
        if "hidden_last" not in batch or T - 2 - s <= 0:
            return None
        c = torch.zeros(B, T, dtype=torch.bool, device=ids.device)
        c[:, :T - 2 - s] = (counted(batch) & self.head.t2d[ids])[:, 2 + s:]
        parts = self.parts
        f = batch["hidden_last"].to(parts.lm_head.weight.dtype)[:, 1 + s:][c[:, :T - 1 - s]]
        if f.shape[0] != n:
            return None
        return torch.softmax(target_logits_from_hidden(parts.config, parts.lm_head, f).float(), -1)

    @torch.no_grad()
    def offline_metrics(self, batches) -> dict:
        """EAGLE-3's first drafted token against the target's FULL distribution (q is zero outside the draft
        vocabulary), so predicted_alpha is the real expected acceptance; fkl is over the draft vocabulary
        (p restricted and renormalised, positions whose token is outside it left out, as training does);
        `vocab_coverage` is the target mass inside the draft vocabulary.

        Per unrolled draft depth s (the head fed its own states from depth 2 on, as when drafting):
        `top1_at[s]` (T=0 acceptance) and `alpha_at[s]` = E[sum_x min(p, q)] (T=1 acceptance, p over the full
        vocabulary); depth 1 counts every trained position, depths >= 2 the positions whose token is in the
        draft vocabulary (training's rule), which favours them slightly. `simulated_tau` = 1 + sum_k prod_{i<=k}
        of each, over the unrolled depths: the held-out prediction of the measured tau (T=0 and T=1)."""
        parts = self.parts
        first, fkl, depths = FirstDraftSums(("tvd", "top1", "vocab_coverage")), FirstDraftSums(("fkl",)), DepthSums()
        for batch in batches:
            pred = self(batch)
            ids = pred["draft_ids"]
            if pred["metric_q_logits"].shape[0]:
                p = torch.softmax(target_logits_from_hidden(parts.config, parts.lm_head, pred["metric_f"]).float(), -1)
                q_d = torch.softmax(pred["metric_q_logits"].float(), -1)
                # q is zero outside the draft vocabulary: no [N, V] q (each full-vocabulary tensor is N x V
                # floats; these metrics were the training's memory peak)
                p_in = p[:, ids]
                hits = top1_match(p, q_d, ids)
                first.add(p.shape[0], tvd=total_variation_outside(p, p_in, q_d), top1=hits, vocab_coverage=p_in.sum(-1))
                depths.add(0, hits, acceptance(p_in, q_d), p.shape[0])  # depth 1: every trained position, full p
                del p  # before the next depth's full-vocabulary p
            for s, step in enumerate(pred["steps"]):
                n = step["q_logits"].shape[0]
                if n and s > 0:
                    qs = torch.softmax(step["q_logits"].float(), -1)
                    full = self._full_p_at_step(batch, s, n)
                    if full is not None:
                        depths.add(s, top1_match(full, qs, ids), acceptance(full[:, ids], qs), n)
                    else:  # over the draft vocabulary (p renormalised): an upper bound
                        ps = torch.softmax(step["p_logits"].float(), -1)
                        depths.add(s, top1_match(ps, qs), acceptance(ps, qs), n)
                if s == 0 and n:
                    log_p, log_q = losses.distribution_logprobs(step, 1.0)
                    fkl.add(n, fkl=divergences(log_p, log_q, ("fkl",))["fkl"])
        label = "full vocabulary (q zero outside the draft vocabulary); fkl over the draft vocabulary"
        labels = {"fkl": "draft vocab", "tvd": "full vocabulary", "predicted_alpha": "full vocabulary",
                  "top1": "full vocabulary"}
        if first.positions == 0:
            return {"positions": 0, "temperature": 1.0, "distribution": label, "labels": labels}
        out = first.means()
        out["fkl"] = fkl.means()["fkl"] if fkl.positions else float("nan")
        out.update(depths.result("unrolled training-time-test depths (T=0: top1_at, T=1: alpha_at); held-out, "
                                 "teacher-forced tokens"))
        return {**out, "positions": first.positions, "temperature": 1.0, "distribution": label, "labels": labels}

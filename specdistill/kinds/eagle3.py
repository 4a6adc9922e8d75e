"""`draft.kind: eagle3` — an EAGLE-3 head (train/eagle3.py `Eagle3Head`), everything about it in one place.

  cache      hidden_aux (the input of the target layers `resolve_aux_layers` picks) and hidden_last
  objective  training-time test: the head unrolled `ttt_steps` times on its own states (train/eagle3.py
             `ttt_forward`), step s weighted ttt_decay**s; q against the target's p restricted to the
             draft vocabulary (the Vd most frequent trained tokens)
  metrics    the first drafted token against the target's FULL distribution, acceptance per unrolled depth
  drafter    fused aux states in, draft-vocabulary tokens out (mapped to target ids)
  export     vllm-eagle3 (vLLM's Eagle3LlamaForCausalLM), speculators
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from transformers import AutoConfig

from specdistill.errors import SpecdistillError
from specdistill.eval.runtime import StaticEagle3Head
from specdistill.eval.sampling import probs_from_logits, sample
from specdistill.kinds import eagle
from specdistill.kinds.eagle import EagleDrafter, checkpoint_config, own_state_dict  # noqa: F401  (stored alike)
from specdistill.metrics import divergences, simulated_tau
from specdistill.target import read_target_tensors, target_logits_from_hidden, vocab_size_of
from specdistill.train import losses, objective
from specdistill.train.eagle import init_layer_from_target
from specdistill.train.eagle3 import (Eagle3Head, draft_vocab_from_counts, resolve_aux_layers, trained_token_counts,
                                      ttt_forward)
from specdistill.train.objective import counted
from specdistill.train.warm_start import released_eagle3_shape, warm_eagle3

NAME = "eagle3"
LABEL = "EAGLE-3"  # in messages and reports
STORE = ["hidden_aux", "hidden_last"]
EXPORT_FORMATS = ("vllm-eagle3", "speculators")
DRAFTS_TREES = True
PROMPTS_FKL_NOTE = "EAGLE-3 reduced draft vocabulary: fkl undefined (q = 0 outside it); tvd and top1 exact"
DEFAULT_DRAFT_VOCAB = 32000


class Config(eagle.Config):
    """EAGLE-1's keys (a released head to continue from, the layer's start) and the EAGLE-3 ones."""
    kind: Literal["eagle3"]
    draft_vocab_size: int | None = Field(None, ge=16, description=f"default {DEFAULT_DRAFT_VOCAB} (at most the target's)")
    ttt_steps: int = Field(7, ge=1, description="training-time test: unroll steps")


# ---- build, checkpoint ------------------------------------------------------------------------------

def _draft_vocab(recipe, target_config) -> int:
    return min(recipe.draft.draft_vocab_size or DEFAULT_DRAFT_VOCAB, target_config.vocab_size)


def shapes(recipe, target_config) -> Eagle3Head:
    """The head's shapes only, on the meta device (dry runs, memory estimates)."""
    aux = resolve_aux_layers(recipe, target_config.num_hidden_layers)
    with torch.device("meta"):
        return Eagle3Head(target_config, _draft_vocab(recipe, target_config), aux)


def aux_feature_std(data) -> torch.Tensor:
    """Per-dimension std of the cached aux features of the first 8 sequences [A*H] (deterministic)."""
    return torch.cat([data[i]["hidden_aux"].float().flatten(1) for i in range(min(8, len(data)))]).std(0)


def build(recipe, parts, data=None) -> Eagle3Head:
    """A fresh head (or a warm start from draft.init_from) bound to the target's frozen embedding: its
    draft vocabulary from the cached train split, its readout the target's own, its input scaling
    measured on `data` (the same on every rank and every resume)."""
    config, cfg = parts.config, recipe.draft
    aux = resolve_aux_layers(recipe, config.num_hidden_layers)
    if cfg.init_from:
        vd, released_aux = released_eagle3_shape(cfg.init_from, config)
        if released_aux is not None and list(released_aux) != list(aux):
            raise SpecdistillError(f"draft.init_from {cfg.init_from}: the head reads target layers "
                                   f"{released_aux}, the cache holds {aux}; set cache.aux_layers: {released_aux}")
        head = Eagle3Head(config, vd, aux)
        head.config.ttt_steps = cfg.ttt_steps
        warm_eagle3(cfg.init_from, head, config)
    else:
        head = Eagle3Head(config, _draft_vocab(recipe, config), aux)
        head.config.ttt_steps = cfg.ttt_steps
        if cfg.init_layer_from_target and parts.where is not None:
            init_layer_from_target(head.layers[0], parts.where, config)
        counts = trained_token_counts(recipe.run_dir, config.vocab_size)
        head.set_draft_vocab(draft_vocab_from_counts(counts, head.lm_head.weight.shape[0]))
        if parts.lm_head is not None:
            norm = read_target_tensors(parts.where, ["model.norm.weight"]).get("model.norm.weight")
            head.init_readout(parts.lm_head.weight, norm)
    if data is not None:
        head.set_aux_scale(aux_feature_std(data))
    return head.bind_target(parts.embed)


def owns(module) -> bool:
    return isinstance(module, Eagle3Head)


def load(config: dict, state: dict[str, torch.Tensor], target_model) -> Eagle3Head:
    cfg = dict(config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    head = Eagle3Head(config, config.draft_vocab_size, config.eagle_aux_hidden_state_layer_ids)
    head.load_own_state_dict(state)
    return head.bind_target(target_model.get_input_embeddings())


def draft_vocabulary(head) -> torch.Tensor | None:
    """The target ids the draft can propose, where that is fewer than the target's vocabulary."""
    return head.draft_ids

# ---- training objective -----------------------------------------------------------------------------

class Objective(objective.Objective):
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
        return {**steps[0], "steps": steps, "draft_ids": draft_ids,
                "metric_q_logits": logits[0], "metric_f": last[:, 1:][first[:, :T - 1]]}

    def loss(self, pred: dict):
        """Per unroll step, weighted ttt_decay**s (EAGLE-3 / SpecForge use 0.8)."""
        cfg = self.loss_cfg
        total, components, weights = 0.0, {}, 0.0
        for s, step in enumerate(pred["steps"]):
            log_p, log_q = losses.distribution_logprobs(step, cfg.temperature)
            dist, _ = losses.mixed_loss(log_p, log_q, dict(cfg.terms), cfg.jsd_beta)
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
        sums = {"tvd": 0.0, "top1": 0.0, "vocab_coverage": 0.0}
        fkl_sum, fkl_n, positions = 0.0, 0, 0
        step_hits, step_acc, step_n = [], [], []
        for batch in batches:
            pred = self(batch)
            ids = pred["draft_ids"]
            if pred["metric_q_logits"].shape[0]:
                p = torch.softmax(target_logits_from_hidden(parts.config, parts.lm_head, pred["metric_f"]).float(), -1)
                q_d = torch.softmax(pred["metric_q_logits"].float(), -1)
                q = torch.zeros_like(p)
                q[:, ids] = q_d
                sums["tvd"] += (0.5 * (p - q).abs().sum(-1)).sum().item()
                sums["top1"] += (ids[q_d.argmax(-1)] == p.argmax(-1)).sum().item()
                sums["vocab_coverage"] += p[:, ids].sum(-1).sum().item()
                positions += p.shape[0]
            for s, step in enumerate(pred["steps"]):
                if s == len(step_hits):
                    step_hits.append(0)
                    step_acc.append(0.0)
                    step_n.append(0)
                if s == 0 and pred["metric_q_logits"].shape[0]:  # depth 1: every trained position, full p
                    step_hits[0] += (ids[q_d.argmax(-1)] == p.argmax(-1)).sum().item()
                    step_acc[0] += torch.minimum(p, q).sum(-1).sum().item()
                    step_n[0] += p.shape[0]
                n = step["q_logits"].shape[0]
                if n and s > 0:
                    qs = torch.softmax(step["q_logits"].float(), -1)
                    full = self._full_p_at_step(batch, s, n)
                    if full is not None:
                        step_hits[s] += (ids[qs.argmax(-1)] == full.argmax(-1)).sum().item()
                        step_acc[s] += torch.minimum(full[:, ids], qs).sum(-1).sum().item()
                    else:  # over the draft vocabulary (p renormalised): an upper bound
                        ps = torch.softmax(step["p_logits"].float(), -1)
                        step_hits[s] += (qs.argmax(-1) == ps.argmax(-1)).sum().item()
                        step_acc[s] += torch.minimum(ps, qs).sum(-1).sum().item()
                    step_n[s] += n
                if s == 0 and n:
                    log_p, log_q = losses.distribution_logprobs(step, 1.0)
                    fkl_sum += divergences(log_p, log_q, ("fkl",))["fkl"].sum().item()
                    fkl_n += n
        label = "full vocabulary (q zero outside the draft vocabulary); fkl over the draft vocabulary"
        labels = {"fkl": "draft vocab", "tvd": "full vocabulary", "predicted_alpha": "full vocabulary",
                  "top1": "full vocabulary"}
        if positions == 0:
            return {"positions": 0, "temperature": 1.0, "distribution": label, "labels": labels}
        out = {k: v / positions for k, v in sums.items()}
        out["predicted_alpha"] = 1.0 - out["tvd"]
        out["fkl"] = fkl_sum / fkl_n if fkl_n else float("nan")
        out["top1_at"] = [h / n if n else 0.0 for h, n in zip(step_hits, step_n)]
        out["alpha_at"] = [a / n if n else 0.0 for a, n in zip(step_acc, step_n)]
        out["positions_at"] = list(step_n)
        out["simulated_tau"] = {"0": simulated_tau(out["top1_at"]), "1": simulated_tau(out["alpha_at"])}
        out["simulated_tau_note"] = (f"1 + sum_k prod_(i<=k) acceptance at depth i over the {len(step_n)} unrolled "
                                     "depths (T=0: top1_at, T=1: alpha_at); held-out, teacher-forced tokens")
        return {**out, "positions": positions, "temperature": 1.0, "distribution": label, "labels": labels}


# ---- decoding -----------------------------------------------------------------------------------------

class Eagle3Drafter(EagleDrafter):
    """EAGLE-3 head: reads the target's aux-layer states (fused by its fc), drafts over a reduced
    vocabulary mapped back to target ids; its own output state feeds the next drafted position.
    Same cache discipline as EagleDrafter. At T>0, q is the draft-vocabulary distribution placed on
    the target ids (zero elsewhere), which keeps the accept/residual rule exact."""
    additive_tree_mask = False  # the head's attention takes the boolean mask itself

    def __init__(self, head, static: bool = False):
        super().__init__(head)
        self.draft_ids = head.draft_ids
        self.vocab = head.config.vocab_size
        self.static = StaticEagle3Head(head) if static else None  # the static runtime's lean drafting forward

    def reset(self, capacity: int = 0) -> None:
        if self.static is None:
            return super().reset(capacity)
        self.static.reset(capacity)

    def run(self, ids, state, start):
        if self.static is None:
            return super().run(ids, state, start)
        return self.static.forward(ids, state, start)  # slots past `start` are masked: no crop needed

    def features(self, hidden_states):
        return self.head.target_features(hidden_states, self.head.aux_layers)

    def project(self, features):
        return self.head.project(features)

    def to_target(self, ids):
        return self.draft_ids[ids]

    def pick(self, h, temperature, generator):
        logits = self.head.logits(h)
        if temperature == 0:
            return self.to_target(logits.argmax(-1)), None
        qd = probs_from_logits(logits, temperature)
        q = torch.zeros(self.vocab, dtype=qd.dtype, device=qd.device).index_copy_(0, self.draft_ids, qd)
        return self.to_target(sample(qd, generator)), q


def drafter(head: Eagle3Head, target_model=None, static: bool = False) -> Eagle3Drafter:
    """static: the target runs in the static runtime, and the head drafts over a slot cache too."""
    if target_model is not None and head.config.vocab_size != vocab_size_of(target_model):
        raise SpecdistillError(f"draft: EAGLE-3 head built for vocabulary size {head.config.vocab_size}, "
                               f"the target's is {vocab_size_of(target_model)}")
    return Eagle3Drafter(head, static)


def prompt_logits(head: Eagle3Head, target_model, seq: torch.Tensor):
    """(p, q) logits [T, V] over `seq`, teacher-forced (head row t predicts target row t+1; row 0 has none);
    q is -inf outside the draft vocabulary."""
    out = target_model(seq, output_hidden_states=True)
    p_logits = out.logits[0]
    t = seq.shape[1]
    state = head.project(head.target_features(out.hidden_states, head.aux_layers)[:, :-1])
    qd = head.logits(head(seq[:, 1:], state, torch.arange(t - 1, device=seq.device)[None])[0])
    q = torch.full((t - 1, p_logits.shape[-1]), float("-inf"), dtype=qd.dtype, device=qd.device)
    q = q.index_copy_(1, head.draft_ids, qd)
    return p_logits, torch.cat([torch.zeros_like(p_logits[:1]), q.to(p_logits.dtype)])

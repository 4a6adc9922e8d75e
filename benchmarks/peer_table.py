"""`make bench ARGS=peer`'s text (benchmarks/peer_bench.py measures, this writes): the notes on what differs
between the two trainers, the table's rows (the README renders them from the experiment's record, through
experiments/tables.py) and the table the bench prints."""
from __future__ import annotations

from specdistill.eval.tables import ci, num
from specdistill.eval.tables import table as markdown_table


def notes(recipe, drift: float, overlap: int, peer_args: list[str]) -> list[str]:
    """What differs between the two trainers that this comparison does not remove."""
    loss, tc, draft = recipe.loss, recipe.train, recipe.draft
    changed = f" (its flags given here: {' '.join(peer_args)})" if peer_args else ""
    return [
        "same: the sequences of each step and their order (its batch sampler replaced by ours), steps, lr, "
        f"warmup steps, TTT steps ({draft.ttt_steps}), aux layers, draft-vocabulary size ({overlap} of "
        f"{draft.draft_vocab_size} draft tokens shared: each counts the trained tokens itself), "
        + ("bf16 autocast over fp32 weights" if tc.precision == "bf16" else "fp32 throughout")
        + ", one process, the same threads",
        f"loss: ours {dict(loss.terms)} with TTT step weights {loss.ttt_decay}^s, feature noise "
        f"{loss.feature_noise}, steps counted where the token is in the draft vocabulary; its kl_div (forward KL to "
        "the target renormalised over the draft vocabulary) with step weights 1.0, no noise" + changed,
        f"optimizer: ours {'Muon on the matrices (muon_lr ' + str(tc.muon_lr) + ') + AdamW' if tc.optimizer == 'muon' else 'AdamW'} "
        f"(betas {tc.betas}, weight decay {tc.weight_decay}, grad clip {tc.grad_clip}); its "
        "default Muon on the 2-D weights + AdamW (weight decay 0.01), grad clip 1.0; schedules: warmup then "
        f"cosine, ours down to {tc.min_lr_ratio}×lr, its to 0",
        "readout: ours the target's LM-head rows and final norm, trained; its the target's LM-head rows frozen "
        "(its load_verifier_weights), its final norm from 1; ours scales fc's input by 1/std of the aux states",
        "architecture: both the EAGLE-3 head vLLM's Eagle3LlamaForCausalLM loads (its 0.9 defaults norm_before_fc, "
        "norm_output and norm_before_residual switched off: our drafter runs the plain head)",
        "CPU adaptations of its trainer: sdpa attention instead of FlexAttention (no backward on the CPU), its "
        "eager loss instead of the fused Triton one, model and batches on the CPU, autocast on the CPU",
        "batch shape: ours pads a step's sequences to the longest (attention within each sequence); its packs them "
        "into one row as long as the longest step, and sdpa computes attention over that whole row under a "
        "block-diagonal mask (~sequences-per-step times the attention work; FlexAttention on a GPU skips the "
        "masked blocks): its tokens/s here is a CPU figure, not its GPU design's",
        "wall time: ours the whole `specdistill train` stage (DeepSpeed start, held-out metrics at every "
        "checkpoint); its `cli.main` (model build, the data loaders, one validation pass, its save); tokens/s "
        "counts the optimizer steps only (each step's batch read included), the same tokens for both",
        "its head reaches our eval through draft.init_from and one step at lr 1e-30 (train.max_steps >= 1, lr > 0): "
        f"that checkpoint equals its weights to {drift:.1e} (relative); its weights were saved in bf16",
    ]


HEADER = ["trainer", "held-out top-1", "held-out sim. τ (chain, T=0)", "sim. τ (continuations)", "measured τ (T=0)",
          "speedup T=0 (95% CI)", "train wall s", "train tokens/s (steps)"]


def rows(result: dict) -> list[list[str]]:
    """One row per trainer (HEADER's columns): the table the README renders from the experiment's record."""
    return [[name, num(a["heldout_top1"]), num(a["heldout_sim_tau"]), num(a["continuations_sim_tau"]),
             num(a["measured_tau"]), f"{num(a['speedup'], 2)}×{ci(a, 'speedup', 2)}", f"{a['train_wall_s']:.0f}",
             f"{a['tokens_per_s']:.0f}" if a["tokens_per_s"] else "—"] for name, a in result["arms"].items()]


def table(result: dict) -> str:
    notes = "\n".join(f"- {n}" for n in result["notes"])
    return f"{result['command']}\n\n{markdown_table(HEADER, rows(result))}\n\nNotes:\n{notes}"

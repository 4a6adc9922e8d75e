"""Draft-OPD's replay (train/replay.py): the batched chains step as the engine's drafter steps them, the loss
counts the exposed depths, and training computes the replay once and reads it back when it resumes."""
from __future__ import annotations

import pytest
import torch

from benchmarks.tiny import make_recipe, read_log, write_cache
from specdistill import kinds, layout
from specdistill.data.cache_reader import collate
from specdistill.errors import SpecdistillError
from specdistill.formats import read_replay
from specdistill.eval.chain_tau import heldout_sequences, replay as engine_replay
from specdistill.kinds.eagle3.model import Eagle3Head
from specdistill.kinds.eagle3.objective import ttt_forward
from specdistill.metrics import divergences
from specdistill.objective import losses
from specdistill.target import parts_of
from specdistill.train import replay
from tests.test_train import checkpoints_root  # noqa: F401  (a fixture)

EAGLE3 = kinds.kind("eagle3")


def text_the_head_partly_drafts(target, head, mask: list[int], seed: int = 0) -> dict:
    """One cached row (input_ids, loss_mask, hidden_aux, hidden_last) whose tokens are, at random, the head's own
    depth-1 or depth-2 draft (teacher-forced) or a random token, so chains are accepted to every depth and
    rejected at every depth; hidden_last makes the target's greedy choice the text's next token (the row is the
    target's own answer, as a regenerated corpus is)."""
    g = torch.Generator().manual_seed(seed)
    T = len(mask)
    ids = torch.randint(3, 400, (1, T), generator=g)
    for j in range(3, T):
        r = float(torch.rand(1, generator=g))
        if r > 0.8:
            continue
        with torch.no_grad():
            aux = Eagle3Head.target_features(target(ids[:, :j], output_hidden_states=True).hidden_states,
                                             head.aux_layers)
            steps = ttt_forward(head, ids[:, :j], aux, torch.ones(1, j, dtype=torch.long), 2)
        depth = 0 if r < 0.45 else 1  # step s at position t predicts token t + 2 + s
        ids[0, j] = head.draft_ids[steps[depth][0, j - 2 - depth].argmax()]
    with torch.no_grad():
        aux = Eagle3Head.target_features(target(ids, output_hidden_states=True).hidden_states, head.aux_layers)
    rows = target.get_output_embeddings().weight
    last = torch.zeros(T, rows.shape[1])
    last[:T - 1] = 50 * rows[ids[0, 1:]]  # the target's greedy choice after token j is token j + 1
    return {"input_ids": ids[0], "loss_mask": torch.tensor(mask, dtype=torch.uint8),
            "hidden_aux": aux[0].reshape(T, len(head.aux_layers), -1), "hidden_last": last}


@pytest.mark.parametrize("k", [2, 3])
def test_batched_replay_steps_as_the_engine_drafter(tiny_target_dir, k):
    """walk(chain_hits) marks, step for step, what the engine's drafter replayed along the same text marks
    (eval/chain_tau.py replay: its KV cache, its own drafted tokens), for two assistant turns of one row."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    head = EAGLE3.tiny_draft(target)
    head.config.ttt_steps = 3
    objective = EAGLE3.Objective(head, parts_of(target), EAGLE3.Loss(replay_weight=1.0))
    mask = [0] * 6 + [1] * 20 + [0] * 4 + [1] * 18
    item = text_the_head_partly_drafts(target, head, mask)
    batch = collate([item])
    depth, counts = replay.walk(objective.chain_hits(batch, k)[:, 0], batch["loss_mask"][0].bool(), k)

    want, steps = torch.zeros_like(depth), 0
    drafter = EAGLE3.drafter(head)
    (ids, features, greedy, trained), = heldout_sequences([batch], EAGLE3.DRAFTER_READS, parts_of(target))
    assert torch.equal(greedy[:-1], ids[1:])  # the row is the target's own text
    for start, end in replay.turns(trained):
        for n, drafted, accepted in engine_replay(drafter, ids[:end], features[:end], greedy[:end], start, k):
            steps += 1
            if accepted < drafted and n + accepted < end:
                want[n - 2] = accepted + 1
    assert replay.turns(trained) == [(6, 26), (30, 48)]
    assert {1, 2} <= set(want.tolist()) and counts["steps"] < counts["tokens"]  # rejected at depth 1 and 2, accepted
    assert torch.equal(depth, want), (depth.tolist(), want.tolist())
    assert counts["steps"] == steps and counts["tokens"] == 38
    assert counts["rejected"] == int((want > 0).sum())


def test_exposed_depths_count_one_plus_the_replay_weight():
    """loss.replay_weight w: a position whose step s verification exposed counts 1 + w times in step s's mean; the
    others once; w = 0 is the plain mean."""
    at = torch.tensor([[True, True, True]])
    right, wrong = [4.0, 0.0, 0.0], [0.0, 4.0, 0.0]
    step0 = {"p_logits": torch.tensor([right] * 3), "q_logits": torch.tensor([right, wrong, [1.0, 1.0, 1.0]])}
    step1 = {"p_logits": torch.tensor([right] * 3), "q_logits": torch.tensor([wrong, right, right])}
    replayed = [torch.tensor([False, True, True]), torch.tensor([True, False, False])]
    pred = {"steps": [step0, step1], "counted_at": [at, at], "replayed_at": replayed}
    for weight in (0.0, 2.0):
        objective = EAGLE3.Objective(torch.nn.Linear(1, 1), None, EAGLE3.Loss(terms={"fkl": 1.0}, ttt_decay=1.0,
                                                                             replay_weight=weight))
        _, parts = objective.loss(pred)
        for s, step in enumerate((step0, step1)):
            fkl = divergences(*losses.full_vocab_logprobs(step["p_logits"], step["q_logits"]), ("fkl",))["fkl"]
            w = 1 + weight * replayed[s].float()
            assert parts[f"step{s}"].item() == pytest.approx(((fkl * w).sum() / w.sum()).item(), rel=1e-6)


def eagle3_recipe(tmp_path, target_dir, name, **train):
    from tests.test_eagle3 import add_aux_states

    recipe = make_recipe(tmp_path, target_dir, name, kind="eagle3", max_steps=4, save_every=2, **train)
    recipe.draft.draft_vocab_size = 128
    recipe.draft.ttt_steps = 3
    recipe.cache.aux_layers = [0, 1, 2]
    recipe.loss.replay_weight = 2.0
    recipe.eval.k = 2  # the replay drafts at most ttt_steps deep
    write_cache(recipe.run_dir, target_dir, n_train=8)
    add_aux_states(recipe.run_dir, target_dir, [0, 1, 2])
    return recipe


def test_training_replays_once_and_resumes_with_the_same_replay(tmp_path, tiny_target_dir, checkpoints_root):
    """A run with loss.replay_weight writes the replay before its first step (2 processes write what 1 does), a
    resumed run reads it back (its losses are the uninterrupted run's), one made for another K is refused, a resumed
    run without it stops, and the weights change what is trained."""
    from specdistill.train import launch

    full = eagle3_recipe(tmp_path, tiny_target_dir, "opd-full")
    launch.run(full)
    made = replay.summary(full.run_dir)
    assert made["rows"] == 8 and made["k"] == full.eval.k and made["steps"] > 0 and made["rejected"] > 0
    depth = read_replay(layout.replay_path(full.run_dir))
    assert int((depth > 0).sum()) == made["rejected"]

    cut = eagle3_recipe(tmp_path, tiny_target_dir, "opd-cut")
    launch.run(cut, stop_after=3)
    launch.run(cut)
    for a, b in zip(read_log(full.run_dir), read_log(cut.run_dir), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6), a["step"]

    cut.eval.k = 3  # a replay made for another K (or another start) is refused, not reused
    with pytest.raises(SpecdistillError, match="replay.safetensors: made for .*'k': 2.*'k': 3"):
        launch.run(cut)
    cut.eval.k = 2
    layout.replay_path(cut.run_dir).unlink()
    with pytest.raises(SpecdistillError, match="replay.safetensors: missing, and training resumes"):
        launch.run(cut)

    plain = eagle3_recipe(tmp_path, tiny_target_dir, "opd-off")
    plain.loss.replay_weight = 0.0
    launch.run(plain)
    assert not layout.replay_path(plain.run_dir).exists()
    assert read_log(plain.run_dir)[0]["loss"] != pytest.approx(read_log(full.run_dir)[0]["loss"], rel=1e-4)

    two = eagle3_recipe(tmp_path, tiny_target_dir, "opd-two", num_gpus=2, micro_batch_size=1)
    launch.run(two)  # the DeepSpeed launcher, 2 CPU processes: each replays half the rows
    assert torch.equal(read_replay(layout.replay_path(two.run_dir)), depth)
    assert replay.summary(two.run_dir)["steps"] == made["steps"]

"""Training on tiny real models: checkpoints, reload, resume, 1 vs 2 processes, NaN stop.

Caches are written by benchmarks/tiny.py in the docs/DESIGN.md format by running the tiny target (no dependency on
the cache stage's writer), and read back through specdistill.data.cache_reader like real runs.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.tiny import make_recipe, read_log, write_cache  # noqa: F401  (other tests import them from here too)
from specdistill import layout
from specdistill.formats import read_draft_config
from specdistill.kinds import kind, load_draft
from specdistill.metrics import simulated_tau
from specdistill.target import TargetParts, parts_of

eagle_kind, eagle3, draft_lm = kind("eagle"), kind("eagle3"), kind("draft_lm")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def checkpoints_root(tmp_path, monkeypatch):
    import specdistill.recipe

    root = tmp_path / "checkpoints"
    monkeypatch.setenv("SPECDISTILL_CHECKPOINTS", str(root))
    monkeypatch.setattr(specdistill.recipe, "CHECKPOINTS", root)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    return root


def test_step_micro_batches_same_for_one_and_two_processes():
    from specdistill.train.loop import step_micro_batches

    for step in range(5):
        one = step_micro_batches(7, step, micro=2, accum=2, world=1, rank=0, seed=3)
        two = [step_micro_batches(7, step, micro=2, accum=1, world=2, rank=r, seed=3)[0] for r in range(2)]
        assert one == two
    seen = [i for s in range(7) for mb in step_micro_batches(7, s, 1, 1, 1, 0, seed=0) for i in mb]
    assert sorted(seen) == list(range(7)), "one epoch visits every sequence once"


FRAGMENTED_HEAP = """
import sys
from specdistill.train.loop import release_freed_host_memory

def anon_mb():
    return next(int(l.split()[1]) // 1024 for l in open("/proc/self/status") if l.startswith("RssAnon"))

blocks = [bytearray(64 * 1024) for _ in range(4000)]  # 256 MB on the heap: each block is below glibc's mmap threshold
del blocks[::2]  # 128 MB freed between live blocks: the heap cannot shrink, the pages stay resident
before = anon_mb()
released = release_freed_host_memory() if sys.argv[1] == "release" else False
print(released, before - anon_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (glibc's malloc_trim)")
def test_training_hands_freed_host_memory_back():
    """Per-batch sequence lengths fragment glibc's heap: freed pages between live blocks stay resident (a rank grew
    ~30 MB a step, OOM at step ~825 of the 12,000-row run) until the loop's release hands them back."""
    def freed_mb(mode: str) -> tuple[str, int]:
        done = subprocess.run([sys.executable, "-c", FRAGMENTED_HEAP, mode], capture_output=True, text=True,
                              timeout=120, cwd=ROOT, check=True)
        released, mb = done.stdout.split()
        return released, int(mb)

    released, mb = freed_mb("release")
    assert released == "True"
    assert mb >= 96, "the 128 MB freed between live blocks went back to the OS"
    assert freed_mb("keep")[1] < 32, "without the release the freed pages stay resident (what the test relies on)"


def test_a_stage_started_after_an_in_process_group_joins_its_own():
    """An in-process run (a test, a notebook) keeps its 1-process group listening on its port: a stage started
    from there as a child must not inherit that MASTER_PORT (it failed with EADDRINUSE in CI)."""
    from specdistill.processes import join

    assert join(torch.device("cpu")) == (0, 1)
    child = "import torch; from specdistill.processes import join; print(join(torch.device('cpu')))"
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("(0, 1)")


def test_eagle_trains_checkpoints_and_reloads(tmp_path, tiny_target_dir, checkpoints_root):
    from transformers import AutoModelForCausalLM

    from specdistill.train import launch
    from specdistill.kinds.eagle.model import EagleHead

    recipe = make_recipe(tmp_path, tiny_target_dir, "eagle-run", max_steps=4)
    write_cache(recipe.run_dir, tiny_target_dir)
    history = launch.run(recipe)
    assert [r["step"] for r in history] == [1, 2, 3, 4]
    assert {"loss", "fkl", "tvd", "feature_smooth_l1", "distribution", "lr", "grad_norm", "tokens_per_s"} <= set(history[0])
    steps = layout.checkpoints(recipe.run_dir)
    assert [p.name for p in steps] == ["step-0000002", "step-0000004"]
    last = steps[-1]
    assert sorted(q.name for q in last.iterdir()) == ["COMPLETE", "draft.safetensors", "draft_config.json", "ds", "metrics.json"]
    held = json.loads((last / "metrics.json").read_text())["heldout"]
    assert {"fkl", "tvd", "predicted_alpha", "top1"} <= set(held)
    assert read_draft_config(last)["kind"] == "eagle"
    assert_heldout_metrics_recomputed(recipe, last, held)

    from safetensors.torch import load_file

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    saved = load_file(str(last / "draft.safetensors"))
    assert set(saved) == set(EagleHead(target.config).own_state_dict())
    loaded = load_draft(last, target)
    head = loaded.module
    assert isinstance(head, EagleHead) and loaded.kind is eagle_kind
    assert torch.equal(head.fc.weight, saved["fc.weight"])
    f = torch.randn(1, 5, target.config.hidden_size)
    assert head(torch.arange(5)[None], f, torch.arange(5)[None]).shape == (1, 5, target.config.hidden_size)
    assert list((recipe.run_dir / "tb").glob("events.*"))


def assert_heldout_metrics_recomputed(recipe, step_dir, held):
    """predicted_alpha and top1 recomputed here from the head and the held-out cache, by definition
    (E[sum_x min(p, q)], argmax agreement), without the training code's prediction or metric functions."""
    from transformers import AutoModelForCausalLM

    from specdistill.data.cache_reader import CacheDataset

    target = AutoModelForCausalLM.from_pretrained(recipe.target.path).eval()
    head = load_draft(step_dir, target).module
    lm_head = target.get_output_embeddings()
    overlap, agree, n = 0.0, 0, 0
    with torch.no_grad():
        for item in CacheDataset(layout.cache_dir(recipe.run_dir), "heldout"):
            ids, h, mask = item["input_ids"].long(), item["hidden_last"].float(), item["loss_mask"].bool()
            f_hat = head(ids[None, 1:], h[None, :-1], torch.arange(len(ids) - 1)[None])[0]  # row t predicts f[t+1]
            rows = [t for t in range(len(ids) - 2) if mask[t + 2]]  # its token t+2 is trained
            p = torch.softmax(lm_head(h[[t + 1 for t in rows]]), -1)
            q = torch.softmax(lm_head(f_hat[rows]), -1)
            overlap += torch.minimum(p, q).sum(-1).sum().item()
            agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
            n += len(rows)
    assert held["positions"] == n
    assert held["predicted_alpha"] == pytest.approx(overlap / n, abs=1e-4)
    assert held["top1"] == pytest.approx(agree / n)


def test_draft_lm_trains_on_topk_and_reloads(tmp_path, tiny_target_dir, checkpoints_root):
    from transformers import AutoModelForCausalLM

    from specdistill.train import launch

    recipe = make_recipe(tmp_path, tiny_target_dir, "lm-run", kind="draft_lm", max_steps=2, lr=0.01)
    write_cache(recipe.run_dir, tiny_target_dir)
    history = launch.run(recipe)
    assert all(r["loss"] >= 0 and r["loss"] < 10 for r in history)
    last = layout.checkpoints(recipe.run_dir)[-1]
    from safetensors.torch import load_file

    from specdistill.target import read_target_tensors

    saved = load_file(str(last / "draft.safetensors"))
    start = read_target_tensors(tiny_target_dir, ["model.layers.0.mlp.up_proj.weight"])
    assert "lm_head.weight" not in saved  # tied: the head is the embedding
    assert not torch.equal(saved["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])
    held = json.loads((last / "metrics.json").read_text())["heldout"]
    assert "truncated" in held["distribution"] and 0 <= held["predicted_alpha"] <= 1
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    draft = load_draft(last, target).module
    assert draft.config.num_hidden_layers == 1 and draft.config.vocab_size == target.config.vocab_size
    assert draft(torch.arange(6)[None]).logits.shape[-1] == target.config.vocab_size


def test_resume_continues_the_same_schedule(tmp_path, tiny_target_dir, checkpoints_root):
    from specdistill.train import launch

    full = make_recipe(tmp_path, tiny_target_dir, "full", max_steps=4, save_every=2)
    write_cache(full.run_dir, tiny_target_dir)
    launch.run(full)
    cut = make_recipe(tmp_path, tiny_target_dir, "cut", max_steps=4, save_every=2)
    write_cache(cut.run_dir, tiny_target_dir)
    launch.run(cut, stop_after=3)  # "interrupted" one step past the first checkpoint
    assert [p.name for p in layout.checkpoints(cut.run_dir)] == ["step-0000002"]
    launch.run(cut)
    a, b = read_log(full.run_dir), read_log(cut.run_dir)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5, abs=1e-6), ra["step"]
        assert rb["lr"] == pytest.approx(ra["lr"], rel=1e-9)


def test_two_processes_match_one(tmp_path, tiny_target_dir, checkpoints_root, monkeypatch):
    """2 launcher ranks give one process's losses; the ranks run in the strict-device mode (as under make
    gpu-check), so a tensor made without device= in a rank's code path (collectives, sharding) stops the run."""
    from specdistill.train import launch

    one = make_recipe(tmp_path, tiny_target_dir, "one", max_steps=3, save_every=3, micro_batch_size=2,
                      gradient_accumulation_steps=2)
    two = make_recipe(tmp_path, tiny_target_dir, "two", max_steps=3, save_every=3, micro_batch_size=2,
                      num_gpus=2)
    for r in (one, two):
        write_cache(r.run_dir, tiny_target_dir)
    launch.run(one)
    buffers = lambda: set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    before = buffers()
    monkeypatch.setenv("SPECDISTILL_STRICT_DEVICE", "1")  # the launcher's ranks inherit it
    launch.run(two)  # the DeepSpeed launcher, 2 CPU processes (gloo)
    assert buffers() <= before, "the ranks' shared-memory all-reduce segments outlived the run"
    a, b = read_log(one.run_dir), read_log(two.run_dir)
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4), ra["step"]
    assert rb["tokens_per_s"] > 0


def test_nan_loss_stops_with_step_and_keeps_last_good(tmp_path, tiny_target_dir, checkpoints_root):
    from specdistill.errors import SpecdistillError
    from specdistill.train import launch

    recipe = make_recipe(tmp_path, tiny_target_dir, "nan", max_steps=6, save_every=1, micro_batch_size=1)
    write_cache(recipe.run_dir, tiny_target_dir, n_train=6, nan_sequence=4)
    with pytest.raises(SpecdistillError, match=r"at step (\d+)") as err:
        launch.run(recipe)
    import re

    bad = int(re.search(r"at step (\d+)", str(err.value)).group(1))
    kept = layout.checkpoints(recipe.run_dir)
    assert [int(p.name[5:]) for p in kept] == list(range(1, bad))
    if kept:
        assert kept[-1].name in str(err.value)


def test_draft_lm_lora_and_resized_hidden(tiny_target_dir):
    from specdistill.recipe import TargetConfig
    from specdistill.target import load_target_config, read_target_tensors

    cfg = load_target_config(TargetConfig(path=str(tiny_target_dir)))
    copied = draft_lm.build_model(draft_lm.Config(kind="draft_lm", num_layers=1), cfg, str(tiny_target_dir))
    src = read_target_tensors(tiny_target_dir, ["model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"])
    assert torch.equal(copied.model.layers[0].self_attn.q_proj.weight, src["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(copied.model.embed_tokens.weight, src["model.embed_tokens.weight"])
    small = draft_lm.build_model(draft_lm.Config(kind="draft_lm", num_layers=1, hidden_size=32, intermediate_size=64,
                                                 num_attention_heads=2, num_key_value_heads=1), cfg, str(tiny_target_dir))
    assert small.config.hidden_size == 32 and small(torch.arange(4)[None]).logits.shape[-1] == cfg.vocab_size
    lora = draft_lm.build_model(draft_lm.Config(kind="draft_lm", num_layers=1, lora=draft_lm.LoraConfig(r=4)), cfg,
                                str(tiny_target_dir))
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.fill_(0.01)  # make the adapter non-trivial so merging changes the weights
    state = draft_lm.own_state_dict(lora)
    assert not any("lora" in k or "base_layer" in k for k in state)
    merged = state["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(merged, src["model.layers.0.self_attn.q_proj.weight"])
    x = torch.arange(6)[None]
    reloaded = draft_lm.load(draft_lm.checkpoint_config(lora), state, target_model=None)
    with torch.no_grad():
        assert torch.allclose(reloaded(x).logits, lora(input_ids=x).logits, atol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_target_parts_match_the_loaded_target(tmp_path, model_type):
    from specdistill.recipe import TargetConfig
    from specdistill.target import load_target_parts
    from tests.conftest import tiny_model

    target = tiny_model(model_type, vocab_size=300)
    target.save_pretrained(tmp_path / "t")
    parts = load_target_parts(TargetConfig(path=str(tmp_path / "t")))
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.allclose(parts.embed(ids), target.get_input_embeddings()(ids))
        h = torch.randn(1, 3, target.config.hidden_size)
        assert torch.allclose(parts.lm_head(h), target.get_output_embeddings()(h))
    assert not any(p.requires_grad for p in (*parts.embed.parameters(), *parts.lm_head.parameters()))


def test_eagle3_offline_acceptance_per_depth_and_simulated_tau(tmp_path, tiny_target_dir, checkpoints_root):
    """Per unrolled depth s: alpha_at[s] = E[sum_x min(p, q)] with p the target's FULL distribution of the token
    s+1 places ahead, recomputed here with ttt_forward on the held-out cache; simulated_tau from them."""
    from transformers import AutoModelForCausalLM

    from specdistill.data.cache_reader import CacheDataset, collate
    from specdistill.kinds.eagle3.model import Eagle3Head
    from specdistill.kinds.eagle3.objective import ttt_forward
    from tests.test_eagle3 import add_aux_states

    recipe = make_recipe(tmp_path, tiny_target_dir, "e3-metrics", kind="eagle3")
    write_cache(recipe.run_dir, tiny_target_dir, n_train=2, n_heldout=3)
    add_aux_states(recipe.run_dir, tiny_target_dir, [0, 1, 2])
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    torch.manual_seed(0)
    head = Eagle3Head(target.config, 96, [0, 1, 2])
    head.set_draft_vocab(torch.arange(0, 384, 4))
    head.config.ttt_steps = 3
    head.bind_target(target.get_input_embeddings()).eval()
    items = list(CacheDataset(layout.cache_dir(recipe.run_dir), "heldout"))
    m = eagle3.Objective(head, parts_of(target), eagle3.Loss()).offline_metrics([collate(items)])

    acc, n = [0.0] * 3, [0] * 3
    with torch.no_grad():
        for item in items:
            ids, h = item["input_ids"].long(), item["hidden_last"].float()
            trained, T = item["loss_mask"].bool(), len(ids)
            outs = ttt_forward(head, ids[None], item["hidden_aux"].float().flatten(1)[None], torch.ones(1, T), 3)
            for s in range(3):
                for t in range(T - 2 - s):  # step s at t predicts token t+2+s, whose p is read at t+1+s
                    tok = int(ids[t + 2 + s])
                    if not trained[t + 2 + s] or (s > 0 and not bool(head.t2d[tok])):
                        continue
                    p = torch.softmax(target.get_output_embeddings()(h[t + 1 + s]), -1)[head.draft_ids]
                    acc[s] += torch.minimum(p, torch.softmax(outs[s][0, t], -1)).sum().item()
                    n[s] += 1
    want = [a / c for a, c in zip(acc, n)]
    assert m["positions_at"] == n
    assert m["alpha_at"] == pytest.approx(want, abs=1e-4)
    assert m["alpha_at"][0] == pytest.approx(m["predicted_alpha"], abs=1e-5) and m["top1_at"][0] == m["top1"]
    assert m["simulated_tau"]["1"] == pytest.approx(1 + want[0] + want[0] * want[1] + want[0] * want[1] * want[2],
                                                    abs=1e-4)
    assert simulated_tau([0.5, 0.5], k=3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert m["labels"]["fkl"] == "draft vocab"


def test_gemma2_final_logit_softcap_wherever_p_is_formed():
    """Gemma-2 caps its final logits (tanh(z / c) * c); every p built from lm_head(h) outside the model's
    forward (EAGLE, EAGLE-3 and draft-LM training and metrics, the EAGLE head's q) must be the model's own."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdistill.target import target_logits_from_hidden
    from specdistill.kinds.eagle.model import EagleHead
    from specdistill.kinds.eagle3.model import Eagle3Head
    from tests.conftest import tiny_config

    cfg = tiny_config("gemma2", vocab_size=256)
    cfg.final_logit_softcapping, cfg.initializer_range = 2.0, 0.5  # a cap well inside the logits' range
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 256, (1, 12))
    T = ids.shape[1]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    want, h = out.logits[0], out.hidden_states[-1]
    lm_head = model.get_output_embeddings()
    assert not torch.allclose(lm_head(h[0]), want, atol=1e-3)  # the cap matters for this model
    torch.testing.assert_close(target_logits_from_hidden(cfg, lm_head, h[0]), want, atol=1e-4, rtol=1e-4)

    parts = TargetParts(cfg, model.get_input_embeddings(), lm_head, None)
    ones = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones, "hidden_last": h,
             "hidden_aux": torch.stack([out.hidden_states[i] for i in (0, 1, 2)], dim=2)}
    with torch.no_grad():
        eagle = EagleHead(cfg).bind_target(model.get_input_embeddings(), lm_head).eval()
        pred = eagle_kind.Objective(eagle, parts, eagle_kind.Loss())(batch)
        torch.testing.assert_close(pred["p_logits"], want[1:T - 1], atol=1e-4, rtol=1e-4)
        assert pred["q_logits"].abs().max() <= 2.0 and eagle.logits(h[0]).abs().max() <= 2.0
        saved = json.loads(eagle.config.to_json_string())  # what draft_config.json keeps; load_draft rebuilds from it
        assert EagleHead(AutoConfig.for_model(saved.pop("model_type"), **saved)).config.final_logit_softcapping == 2.0

        lm = draft_lm.Objective(model, parts, draft_lm.Loss())(batch)
        torch.testing.assert_close(lm["p_logits"], want[:T - 1], atol=1e-4, rtol=1e-4)

        head = Eagle3Head(cfg, 256, [0, 1, 2])
        head.set_draft_vocab(torch.arange(256))
        head.config.ttt_steps = 2
        head.bind_target(model.get_input_embeddings()).eval()
        e3 = eagle3.Objective(head, parts, eagle3.Loss())(batch)
        torch.testing.assert_close(e3["steps"][0]["p_logits"], want[1:T - 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(e3["steps"][1]["p_logits"], want[2:T - 1], atol=1e-4, rtol=1e-4)


def test_eagle_offline_acceptance_per_depth_on_its_own_features(tmp_path, tiny_target_dir, checkpoints_root):
    """EAGLE-1's held-out acceptance at depth s+1 = the head run from scratch, as when drafting: real features up to
    the start position, then its own predicted features, teacher-forced tokens; p the target's at that position."""
    from transformers import AutoModelForCausalLM

    from specdistill.data.cache_reader import CacheDataset, collate
    from specdistill.kinds.eagle.model import EagleHead

    recipe = make_recipe(tmp_path, tiny_target_dir, "e1-metrics")
    write_cache(recipe.run_dir, tiny_target_dir, n_train=2, n_heldout=3)
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    torch.manual_seed(0)
    head = EagleHead(target.config).bind_target(target.get_input_embeddings(), target.get_output_embeddings()).eval()
    items = list(CacheDataset(layout.cache_dir(recipe.run_dir), "heldout"))
    m = eagle_kind.Objective(head, parts_of(target), eagle_kind.Loss()).offline_metrics([collate(items)])

    hits, overlap, n = [0] * 3, [0.0] * 3, [0] * 3
    with torch.no_grad():
        for item in items:
            ids, h, trained = item["input_ids"].long(), item["hidden_last"].float(), item["loss_mask"].bool()
            for t in range(len(ids) - 2):  # a chain drafted after the target's real feature f[t]
                tokens, feats = ids[1:t + 2], h[:t + 1]
                for s in range(3):
                    if t + 2 + s >= len(ids):
                        break
                    f_hat = head(tokens[None], feats[None])[0, -1]  # predicts f[t+1+s], i.e. token t+2+s
                    if trained[t + 2 + s]:
                        p = torch.softmax(target.get_output_embeddings()(h[t + 1 + s]), -1)
                        q = torch.softmax(head.logits(f_hat), -1)
                        hits[s] += int(p.argmax() == q.argmax())
                        overlap[s] += torch.minimum(p, q).sum().item()
                        n[s] += 1
                    tokens, feats = torch.cat([tokens, ids[t + 2 + s:t + 3 + s]]), torch.cat([feats, f_hat[None]])
    assert m["positions_at"] == n
    assert m["top1_at"] == pytest.approx([a / c for a, c in zip(hits, n)])
    assert m["alpha_at"] == pytest.approx([b / c for b, c in zip(overlap, n)], abs=1e-4)
    assert m["top1_at"][0] == pytest.approx(m["top1"]) and m["alpha_at"][0] == pytest.approx(m["predicted_alpha"], abs=1e-5)
    assert m["simulated_tau"]["1"] == pytest.approx(simulated_tau(m["alpha_at"]))


def test_muon_moves_the_matrices_and_adamw_the_rest(tmp_path, tiny_target_dir, checkpoints_root):
    """train.optimizer muon: DeepSpeed's Muon on the head's matrices at muon_lr, AdamW at lr on the rest. With
    lr ~0 only the matrices move, and only under muon."""
    from safetensors.torch import load_file

    from specdistill.train import launch

    weights = {}
    for name, optimizer in (("adamw", "adamw"), ("muon", "muon")):
        recipe = make_recipe(tmp_path, tiny_target_dir, name, max_steps=1, save_every=1, lr=1e-12,
                             optimizer=optimizer, muon_lr=0.02)
        write_cache(recipe.run_dir, tiny_target_dir)
        launch.run(recipe)
        weights[name] = load_file(str(layout.checkpoints(recipe.run_dir)[-1] / "draft.safetensors"))
    moved = {k: (weights["muon"][k] - weights["adamw"][k]).abs().max().item() for k in weights["adamw"]}
    matrices = [k for k in moved if weights["adamw"][k].dim() == 2]
    assert matrices and all(moved[k] > 1e-4 for k in matrices), moved
    assert all(moved[k] < 1e-9 for k in moved if k not in matrices), moved

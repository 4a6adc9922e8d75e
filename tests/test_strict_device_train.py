"""The cache pass, training, online mode and regeneration are device-clean: proven on the CPU.

Under `device.strict_device()` every tensor the project creates must name its device, so a stage that
runs here without a StrictDeviceError puts nothing on the CPU by default (where a GPU run would then
mix devices). Beside it: the processes' environment per device, collectives that keep their inputs'
device and dtype, the DataLoader's order, and the cache pass split over 2 processes (gloo, CPU).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from specdistill import device as devices
from specdistill import kinds
from specdistill.cli import main
from specdistill.errors import SpecdistillError
from specdistill.formats import read_manifest
from specdistill import processes
from tests.helpers import draft_section
from tests.test_other_targets import CHAT



def write_recipe(tmp_path: Path, target_dir: Path, kind: str, mode: str = "offline", extra: str = "") -> Path:
    corpus = tmp_path / "chat.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    recipe = tmp_path / f"{kind}-{mode}.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'runs'}\ntarget: {{path: {target_dir}}}\n"
                      f"corpus: {{path: {corpus}, format: messages, max_length: 64, heldout_fraction: 0.2}}\n"
                      f"cache: {{dtype: float32, mode: {mode}, topk: 8}}\ndraft: {draft_section(kind)}\n"
                      f"train: {{max_steps: 1, save_every: 1, micro_batch_size: 4, warmup_steps: 1}}\n{extra}")
    return recipe


# ---- strict device: every stage of this scope, every draft kind ----------------------------------------------

@pytest.mark.parametrize("kind,mode", [*((name, "offline") for name in kinds.KIND_NAMES), ("eagle3", "online")])
def test_cache_pass_and_a_training_step_create_no_tensor_without_a_device(tmp_path, tiny_target_dir, monkeypatch,
                                                                          kind, mode):
    """The cache pass, one training step (feature noise, loss, collectives, DataLoader) and the checkpoint's
    offline metrics on the held-out split, in strict-device mode; online mode computes the target in the step."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    recipe = write_recipe(tmp_path, tiny_target_dir, kind, mode)
    assert main(["prepare", "--recipe", str(recipe), "run_name=r"]) == 0
    with devices.strict_device():
        for stage in ("cache", "train"):
            assert main([stage, "--recipe", str(recipe), "run_name=r"]) == 0, stage
    metrics = json.loads((tmp_path / "runs" / "r" / "step-0000001" / "metrics.json").read_text())["heldout"]
    assert "predicted_alpha" in metrics  # the offline metrics ran, under the strict mode


def test_regeneration_creates_no_tensor_without_a_device(tmp_path, tiny_target_dir, smollm_tokenizer):
    from specdistill.data.prepare import prepare_corpus
    from specdistill.data.regenerate import regenerated_corpus
    from specdistill.recipe import load_recipe
    from specdistill.target import load_target

    path = write_recipe(tmp_path, tiny_target_dir, "eagle", extra="")
    recipe = load_recipe(path, ["cache.regenerate=true", "cache.regenerate_max_new_tokens=4",
                                "cache.regenerate_batch_size=2", "corpus.min_assistant_tokens=0"])
    corpus = tmp_path / "corpus"
    prepare_corpus(recipe, corpus, smollm_tokenizer)
    model = load_target(recipe.target, devices.resolve(recipe.device))
    with devices.strict_device():
        out = regenerated_corpus(recipe, corpus, tmp_path / "shared", model, smollm_tokenizer)
    assert (out / "summary.json").exists()


# ---- the processes' environment ----------------------------------------------------------------------

@pytest.mark.parametrize("gpus_visible", [True, False])
def test_launcher_environment_follows_the_device(monkeypatch, gpus_visible):
    """GPUs visible: DeepSpeed's CUDA accelerator (an inherited DS_ACCELERATOR=cpu dropped), NCCL, no thread limit.
    None: the CPU accelerator, gloo, the cores shared among the processes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus_visible)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8 if gpus_visible else 0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    device = devices.resolve("auto")
    env = processes.process_env(device, 4, {"DS_ACCELERATOR": "cpu", "PATH": "/bin"}, cores=16)
    assert env["PATH"] == "/bin"
    if gpus_visible:
        assert device == torch.device("cuda", 3)  # one GPU per LOCAL_RANK
        assert env["DS_ACCELERATOR"] == "cuda" and processes.backend(device) == "nccl"
        assert "OMP_NUM_THREADS" not in env
    else:
        assert device == torch.device("cpu")
        assert env["DS_ACCELERATOR"] == "cpu" and processes.backend(device) == "gloo"
        assert env["OMP_NUM_THREADS"] == "4"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_train_asking_for_cuda_without_it_is_one_line_naming_the_key(tmp_path, tiny_target_dir):
    from specdistill.recipe import load_recipe
    from specdistill.train import launch
    from tests.test_train import write_cache

    recipe = load_recipe(write_recipe(tmp_path, tiny_target_dir, "eagle"), ["run_name=r", "device=cuda"])
    write_cache(recipe.run_dir, tiny_target_dir)
    with pytest.raises(SpecdistillError, match=r"^device: 'cuda' asked for") as e:
        launch.run(recipe)
    assert "\n" not in str(e.value)


# ---- collectives ----------------------------------------------------------------------------------------------

def test_collectives_keep_device_and_dtype_of_their_inputs():
    """On the `meta` device: a collective that moved its input to the CPU (NCCL refuses CPU tensors) fails here."""
    from specdistill.train.loop import all_mean, all_sum

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.ones(3, dtype=dtype, device="meta")
        out = all_mean(x, 1)
        assert out.device == x.device and out.dtype == dtype and out.shape == x.shape
    n = torch.tensor(7, dtype=torch.long, device="meta")
    assert all_sum(n, 1).device == n.device and all_sum(n, 1).dtype == torch.long


def _two_rank_collectives(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from specdistill.train.loop import all_mean, all_sum

    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    mean = all_mean(torch.tensor([1.0, 2.0], dtype=torch.float64, device="cpu") * (rank + 1), 2)
    total = all_sum(torch.tensor(rank + 5, dtype=torch.long, device="cpu"), 2)
    torch.save({"mean": mean, "sum": total}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_collectives_reduce_over_two_gloo_processes(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_two_rank_collectives, args=(processes.free_port(), str(tmp_path / "r")), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"r.{rank}")
        assert got["mean"].dtype == torch.float64 and got["mean"].tolist() == [1.5, 3.0]
        assert got["sum"].dtype == torch.long and got["sum"].item() == 11


# ---- the DataLoader ---------------------------------------------------------------------------------------------

def test_loader_with_workers_yields_the_step_order(tmp_path, tiny_target_dir):
    """Workers and prefetch change nothing: the micro batches are `step_micro_batches`' for (seed, step), also
    from a resumed step."""
    from specdistill import layout
    from specdistill.data.cache_reader import CacheDataset, collate
    from specdistill.recipe import load_recipe
    from specdistill.train.loop import StepBatches, loader_workers, read_batches, step_micro_batches
    from tests.test_train import write_cache

    recipe = load_recipe(write_recipe(tmp_path, tiny_target_dir, "eagle"),
                         ["run_name=r", "train.micro_batch_size=2", "train.gradient_accumulation_steps=2"])
    write_cache(recipe.run_dir, tiny_target_dir, n_train=7)
    data = CacheDataset(layout.cache_dir(recipe.run_dir), "train")
    tc = recipe.train
    assert loader_workers(torch.device("cpu"), 1) == 0 and loader_workers(torch.device("cuda", 0), 8, cores=64) == 4
    for start in (0, 3):
        expected = [collate([data[i] for i in mb]) for step in range(start, 6)
                    for mb in step_micro_batches(len(data), step, 2, 2, 2, 1, tc.seed)]
        got = list(read_batches(data, StepBatches(len(data), start, 6, tc, world=2, rank=1), torch.device("cpu"),
                                workers=2))
        assert len(got) == len(expected) == (6 - start) * 2
        for a, b in zip(got, expected):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- the cache pass over 2 processes -------------------------------------------------------------------------------

def test_cache_pass_split_over_two_ranks_equals_one_process_and_resumes(tmp_path, tiny_target_dir):
    """The DeepSpeed launcher's 2 gloo processes, each computing every other shard, write the shards one process
    writes, byte for byte, into one manifest; an interrupted 2-rank pass resumes with the shards it finished.
    The ranks run in the strict-device mode."""
    from specdistill.data.cache_ranks import rank_file, rank_shards
    from specdistill.formats import write_json_atomic, write_manifest

    assert rank_shards(5, 0, 2) == [0, 2, 4] and rank_shards(5, 1, 2) == [1, 3]
    recipe = write_recipe(tmp_path, tiny_target_dir, "eagle3", extra="")
    settings = ["cache.shard_tokens=64", "cache.batch_tokens=128"]
    assert main(["prepare", "--recipe", str(recipe), "run_name=r"]) == 0
    assert main(["cache", "--recipe", str(recipe), "run_name=r", f"cache.dir={tmp_path / 'one'}", *settings]) == 0
    one = read_manifest(tmp_path / "runs" / "r" / "cache")

    def two_ranks():
        cmd = processes.launcher_command("specdistill.data.cache", ["--recipe", str(recipe), "run_name=r",
                                                                    f"cache.dir={tmp_path / 'two'}", *settings], 2)
        env = processes.process_env(torch.device("cpu"), 2, {**os.environ, "SPECDISTILL_STRICT_DEVICE": "1"})
        done = processes.run_ranks(cmd, env, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return read_manifest(tmp_path / "runs" / "r" / "cache")

    two = two_ranks()
    strip = lambda m: {s: m["splits"][s]["shards"] for s in m["splits"]}
    assert len(one["splits"]["train"]["shards"]) >= 3  # both ranks computed some
    assert two["complete"] and strip(two) == strip(one)  # same files, bytes and sha256, in corpus order
    assert {k: v for k, v in two.items() if k != "splits"} == {k: v for k, v in one.items() if k != "splits"}

    # interrupt: rank 1 finished none of its shards, rank 0 all of its; the manifest lists none
    cache = (tmp_path / "runs" / "r" / "cache").resolve()
    kept = {s: {str(i): sh for i, sh in enumerate(two["splits"][s]["shards"]) if i % 2 == 0} for s in two["splits"]}
    mtimes = {(s, sh["file"]): (cache / s / sh["file"]).stat().st_mtime_ns for s in kept for sh in kept[s].values()}
    for s in two["splits"]:
        for i, sh in enumerate(two["splits"][s]["shards"]):
            if i % 2 == 1:
                (cache / s / sh["file"]).unlink()
        two["splits"][s]["shards"] = []
    two["complete"] = False
    write_manifest(cache, two)
    rank_file(cache, 0).parent.mkdir(exist_ok=True)
    write_json_atomic(rank_file(cache, 0), kept)
    resumed = two_ranks()
    assert resumed["complete"] and strip(resumed) == strip(one)
    assert all((cache / s / f).stat().st_mtime_ns == t for (s, f), t in mtimes.items())  # not recomputed
    assert not (cache / "ranks").exists()

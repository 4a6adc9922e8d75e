"""The fault suite: corruption caught and named, kills resumed bit for bit, disk full, one writer per run.

Fast checks (in-process) run in `make test`. The kill-and-resume chains start real `specdistill train`
processes (1 process, and 2 under the DeepSpeed launcher with gloo) and kill them at chosen points
(SPECDISTILL_FAULT, specdistill/faults.py); they take minutes, so they run in `make faults`
(SPECDISTILL_FAULT_SUITE=1), which CI runs after `make test`.
"""
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

from specdistill import integrity, layout
from specdistill.errors import SpecdistillError
from specdistill.formats import read_manifest
from tests.conftest import SHARED_DATA
from tests.test_train import checkpoints_root, make_recipe, write_cache  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(SHARED_DATA)
suite = pytest.mark.skipif(os.environ.get("SPECDISTILL_FAULT_SUITE") != "1",
                           reason="kill-and-resume chains: `make faults` (SPECDISTILL_FAULT_SUITE=1)")


def flip_byte(path: Path, offset_from_end: int = 100) -> None:
    """Flip one byte inside a file's data (near its end: the tensors of a safetensors file, not its header)."""
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def datasets_fingerprint_fallback(monkeypatch):
    """This machine's datasets 5.1 + pyarrow 26 cannot hash a new Dataset (PicklingError on MonthDayNano) in
    `Dataset.from_dict`; a random fingerprint keeps `prepare` working here. No effect where hashing works."""
    import datasets.arrow_dataset as arrow_dataset

    try:
        arrow_dataset.Dataset.from_dict({"a": [1]})
    except Exception:
        import uuid

        monkeypatch.setattr(arrow_dataset, "generate_fingerprint", lambda ds: uuid.uuid4().hex)


# ---- integrity: the checks themselves ------------------------------------------------------------------

def test_size_header_sample_and_full_checks(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    monkeypatch.setattr(integrity, "BLOCK", 4096)
    f = tmp_path / "x.safetensors"
    save_file({"a": torch.arange(64 * 1024, dtype=torch.float32)}, str(f))  # 256 KiB: 64 blocks
    entry = integrity.file_digest(f)
    assert len(entry["block_sha256"]) == 65 and integrity.check_file(f, entry) is None
    flip_byte(f, 5000)  # inside the last full block but one
    assert "sha256 differs" in integrity.check_file(f, entry)
    assert integrity.check_file(f, entry, blocks=[]) is None  # size and header only: a data flip passes
    bad_block = (f.stat().st_size - 5000) // 4096
    assert f"bytes {bad_block * 4096}.." in integrity.check_file(f, entry, blocks=[0, bad_block])
    # a sampled check of a large cache hashes about SAMPLE_FRACTION of it; a small one all of it
    monkeypatch.setattr(integrity, "SAMPLE_MIN", 4096)
    plan = integrity.sampled_blocks([entry] * 20, "sample")
    share = sum(len(p) for p in plan) / (20 * 65)
    assert 0.002 < share < 0.06, share
    monkeypatch.setattr(integrity, "SAMPLE_MIN", 1 << 30)
    assert integrity.sampled_blocks([entry] * 20, "sample") == [None] * 20
    # truncation and a broken header are caught without hashing
    f.write_bytes(f.read_bytes()[:-10])
    assert "recorded (truncated" in integrity.check_file(f, entry, blocks=[])
    g = tmp_path / "y.safetensors"
    save_file({"a": torch.zeros(8)}, str(g))
    e = integrity.file_digest(g)
    raw = bytearray(g.read_bytes())
    raw[8] = ord("[")  # the JSON header's opening brace
    g.write_bytes(bytes(raw))
    assert "header is not valid JSON" in integrity.check_file(g, e, blocks=[])


# ---- integrity: the cache ---------------------------------------------------------------------------------

def write_cache_recipe(tmp_path: Path, target: Path) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(f"run_name: a\ntarget: {{path: {target}}}\noutput_dir: {tmp_path / 'runs'}\n"
                 f"corpus: {{path: {DATA / 'gsm8k_train.jsonl'}, format: columns, "
                 f"columns: {{user: question, assistant: answer}}, max_rows: 24, max_length: 96}}\n"
                 f"cache: {{shard_tokens: 256, dtype: float32}}\n"
                 f"draft: {{kind: eagle}}\ntrain: {{max_steps: 1, save_every: 1}}\n")
    return p


def shard_sums(cache: Path) -> dict:
    m = read_manifest(cache)
    return {s: [sh["sha256"] for sh in m["splits"][s]["shards"]] for s in m["splits"]}


def test_corrupt_shard_stops_training_verify_names_it_and_cache_rebuilds_only_it(
        tmp_path, tiny_target_dir, capsys, datasets_fingerprint_fallback):
    from specdistill.cli import main

    recipe = str(write_cache_recipe(tmp_path, tiny_target_dir))
    assert main(["prepare", "--recipe", recipe]) == 0
    assert main(["cache", "--recipe", recipe]) == 0
    cache = tmp_path / "runs" / "a" / "cache"
    clean = shard_sums(cache)
    assert len(clean["train"]) >= 3
    bad = cache / "train" / read_manifest(cache)["splits"]["train"]["shards"][1]["file"]
    flip_byte(bad)
    capsys.readouterr()

    assert main(["train", "--recipe", recipe]) == 1  # stops before any process starts
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "sha256 differs" in err[0] and "specdistill cache" in err[0]

    assert main(["verify", "--recipe", recipe]) == 1
    captured = capsys.readouterr()
    assert [line for line in captured.out.splitlines() if line.startswith("BAD")] == [
        f"BAD {bad}: sha256 differs from the recorded one (corrupted data)"]
    assert "1 bad files" in captured.err

    assert main(["cache", "--recipe", recipe]) == 0  # the run's cache is a shared one: found bad when reused
    out = capsys.readouterr().out
    assert f"corrupt cache shard, to be rebuilt: {bad.resolve()}" in out
    manifest = read_manifest(cache)
    assert f"over {manifest['splits']['train']['shards'][1]['tokens']} computed tokens" in out  # that shard only
    assert shard_sums(cache) == clean  # identical to the clean build
    assert not list(cache.rglob("*.tmp"))
    assert main(["verify", "--recipe", recipe, "--full"]) == 0
    assert "all good" in capsys.readouterr().out
    assert manifest["complete"]


def test_disk_full_during_a_shard_write_leaves_nothing_and_the_rerun_resumes(
        tmp_path, tiny_target_dir, capsys, monkeypatch, datasets_fingerprint_fallback):
    """Injected ENOSPC at the write call of shard 2 (the cache stage checks free space before it starts, so a
    disk that fills up under it is another process's doing)."""
    from specdistill.cli import main

    recipe = str(write_cache_recipe(tmp_path, tiny_target_dir))
    assert main(["prepare", "--recipe", recipe]) == 0
    monkeypatch.setenv("SPECDISTILL_FAULT", "enospc:shard:2")
    capsys.readouterr()
    assert main(["cache", "--recipe", recipe]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("specdistill cache:")]
    assert len(err) == 1 and "shard-00002.safetensors: disk full" in err[0] and "resumes" in err[0]
    cache = tmp_path / "runs" / "a" / "cache"
    shared = next(p for p in (tmp_path / "runs" / "shared-cache").iterdir() if p.is_dir())
    assert not list(shared.rglob("*.tmp")) and not read_manifest(shared)["complete"]
    assert [s["file"] for s in read_manifest(shared)["splits"]["train"]["shards"]] == [
        "shard-00000.safetensors", "shard-00001.safetensors"]  # what a rerun trusts: whole shards only
    monkeypatch.delenv("SPECDISTILL_FAULT")
    assert main(["cache", "--recipe", recipe]) == 0
    assert "resuming" in capsys.readouterr().out
    assert main(["verify", "--recipe", recipe, "--full"]) == 0
    assert read_manifest(cache)["complete"]


# ---- integrity: checkpoints and exports --------------------------------------------------------------------

class Args:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_corrupt_checkpoint_is_refused_by_eval_export_resume_and_warm_start(
        tmp_path, tiny_target_dir, checkpoints_root, capsys):
    from specdistill import verify_stage
    from specdistill.eval import evaluate
    from specdistill.kinds.common.released import read_released
    from specdistill.train import export, launch

    recipe = make_recipe(tmp_path, tiny_target_dir, "ck", max_steps=2, save_every=1)
    write_cache(recipe.run_dir, tiny_target_dir)
    launch.run(recipe)
    step1, step2 = layout.checkpoints(recipe.run_dir)
    files = integrity.read_complete(step2)
    assert {"draft.safetensors", "draft_config.json", "metrics.json", "ds/state/mp_rank_00_model_states.pt"} <= set(files)
    out = export.export_checkpoint(recipe, step2, "vllm-eagle")
    assert (out / integrity.CHECKSUMS).is_file() and not integrity.export_problems(out)
    assert verify_stage.run(recipe) == []

    flip_byte(out / "model.safetensors")
    with pytest.raises(SpecdistillError, match=r"^draft.init_from: .*model.safetensors: sha256 differs"):
        read_released(out)
    flip_byte(step2 / "draft.safetensors")
    for attempt in (lambda: evaluate.run(recipe, Args(checkpoint="last")),
                    lambda: export.export_checkpoint(recipe, step2, "vllm-eagle")):
        with pytest.raises(SpecdistillError, match=r"step-0000002/draft.safetensors: sha256 differs.*refusing"):
            attempt()
    with pytest.raises(SpecdistillError, match="2 bad files"):
        verify_stage.run(recipe)
    assert sorted(line.split(":")[0].split("/")[-1] for line in capsys.readouterr().out.splitlines()
                  if line.startswith("BAD")) == ["draft.safetensors", "model.safetensors"]
    flip_byte(step2 / "draft.safetensors")  # flipped back: now only the optimizer state is bad
    flip_byte(step2 / "ds" / "state" / "mp_rank_00_model_states.pt")
    longer = make_recipe(tmp_path, tiny_target_dir, "ck", max_steps=3, save_every=1)
    with pytest.raises(SpecdistillError, match=r"mp_rank_00_model_states.pt: sha256 differs"):
        launch.run(longer)  # resuming from a corrupt optimizer state is refused
    # a checkpoint whose optimizer state keep_last removed is not corrupt
    import shutil

    shutil.rmtree(step1 / "ds")
    assert integrity.checkpoint_problems(step1) == []


# ---- disk full during a checkpoint write ---------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 1.2 MiB tmpfs (root only; skipped elsewhere, where the injected ENOSPC test still runs)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def assert_same_final_state(a: Path, b: Path) -> None:
    """Bit for bit: the draft weights file, and every tensor and value of DeepSpeed's state (weights, Adam's
    moments and step counts, the LR schedule)."""
    assert (a / "draft.safetensors").read_bytes() == (b / "draft.safetensors").read_bytes()
    for f in sorted((a / "ds").rglob("*.pt")):
        sa = torch.load(f, map_location="cpu", weights_only=False)
        sb = torch.load(b / "ds" / f.relative_to(a / "ds"), map_location="cpu", weights_only=False)
        assert_same_tree(sa, sb, f.name)


def assert_same_tree(x, y, where: str) -> None:
    if isinstance(x, dict):
        assert set(x) == set(y), where
        for k in x:
            assert_same_tree(x[k], y[k], f"{where}/{k}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            assert_same_tree(u, v, f"{where}/{i}")
    elif torch.is_tensor(x):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), where
    else:
        assert x == y, where


def test_disk_full_during_a_checkpoint_write(tmp_path, tiny_target_dir, checkpoints_root, monkeypatch):
    """Injected ENOSPC at checkpoint 4's write: one line, no partial checkpoint, the rerun resumes from step 2
    and ends bit for bit where an uninterrupted run does."""
    from specdistill.train import launch

    ref = make_recipe(tmp_path, tiny_target_dir, "ref", max_steps=4, save_every=2)
    full = make_recipe(tmp_path, tiny_target_dir, "full", max_steps=4, save_every=2)
    for r in (ref, full):
        write_cache(r.run_dir, tiny_target_dir)
    launch.run(ref)
    monkeypatch.setenv("SPECDISTILL_FAULT", "enospc:checkpoint:4")
    with pytest.raises(SpecdistillError) as err:
        launch.run(full)
    line = str(err.value)
    assert "\n" not in line and "step-0000004: disk full" in line and "last complete checkpoint is step-0000002" in line
    assert sorted(p.name for p in full.run_dir.glob("step-*")) == ["step-0000002"]  # no step-0000004.tmp
    monkeypatch.delenv("SPECDISTILL_FAULT")
    launch.run(full)
    assert_same_final_state(layout.step_dir(ref.run_dir, 4), layout.step_dir(full.run_dir, 4))


def test_disk_full_on_a_real_small_filesystem(tmp_path, tiny_target_dir, checkpoints_root, small_disk, monkeypatch):
    """The run directory on a 1.2 MiB tmpfs: checkpoint 2 (~0.75 MiB) fits, checkpoint 4 does not. Then the disk
    grows (remount) and the rerun finishes."""
    import specdistill.recipe
    from specdistill.train import launch

    monkeypatch.setattr(specdistill.recipe, "CHECKPOINTS", small_disk)
    monkeypatch.setenv("SPECDISTILL_CHECKPOINTS", str(small_disk))
    recipe = make_recipe(tmp_path, tiny_target_dir, "tight", max_steps=4, save_every=2, report_to=[])
    outside = tmp_path / "cache-elsewhere"
    write_cache(outside, tiny_target_dir)
    recipe.run_dir.mkdir(parents=True)
    layout.cache_dir(recipe.run_dir).symlink_to(layout.cache_dir(outside))
    with pytest.raises(SpecdistillError) as err:
        launch.run(recipe)
    line = str(err.value)
    assert "\n" not in line and "disk full" in line, line
    assert [p.name for p in recipe.run_dir.glob("step-*")] == ["step-0000002"]
    assert integrity.checkpoint_problems(recipe.run_dir / "step-0000002") == []
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    launch.run(recipe)
    assert [p.name for p in layout.checkpoints(recipe.run_dir)] == ["step-0000002", "step-0000004"]


# ---- one run, one writer ----------------------------------------------------------------------------------

HOLD = """
import sys, time
from pathlib import Path
from specdistill import runlock
with runlock.hold(Path(sys.argv[1]), "train"):
    print("holding", flush=True)
    time.sleep(600)
"""


def test_a_second_train_on_the_same_run_is_refused_and_a_dead_holder_taken_over(tmp_path, capsys):
    from specdistill import runlock

    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout.readline().strip() == "holding"
    try:
        with pytest.raises(SpecdistillError) as err:
            with runlock.hold(run_dir, "train"):
                pass
        line = str(err.value)
        assert "\n" not in line and f"pid {holder.pid} on host {os.uname().nodename}" in line and "started 20" in line
        with runlock.hold(run_dir, "eval"):  # eval may read checkpoints while training writes new ones
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    capsys.readouterr()
    with runlock.hold(run_dir, "train"):
        assert f"took over {run_dir / 'train.lock'} from a process that is gone (pid {holder.pid}" in capsys.readouterr().out
    with runlock.hold(run_dir, "train"):  # released cleanly: no note
        assert "took over" not in capsys.readouterr().out


def test_the_cli_refuses_a_second_train_with_one_line(tmp_path, tiny_target_dir, checkpoints_root, capsys):
    from specdistill import runlock
    from specdistill.cli import main

    recipe = make_recipe(tmp_path, tiny_target_dir, "busy")
    write_cache(recipe.run_dir, tiny_target_dir)
    with runlock.hold(recipe.run_dir, "train"):
        assert main(["train", "--recipe", str(tmp_path / "busy.yaml")]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("specdistill")]
    assert len(err) == 1 and f"pid {os.getpid()}" in err[0] and "another `specdistill train`" in err[0]


# ---- kill anywhere, resume bit for bit (make faults) -----------------------------------------------------

def train_process(recipe_file: Path, root: Path, fault: str | None = None, sigterm_after_step: int | None = None,
                  timeout: float = 900) -> tuple[int, str, float]:
    for attempt in range(3):
        rc, text, seconds = train_process_once(recipe_file, root, fault, sigterm_after_step, timeout)
        if "EADDRINUSE" not in text:  # the free port picked for the process group was taken meanwhile: retried
            break
    return rc, text, seconds


def train_process_once(recipe_file: Path, root: Path, fault: str | None, sigterm_after_step: int | None,
                       timeout: float) -> tuple[int, str, float]:
    """`specdistill train` as a real process: (exit status, its output, seconds from the injected fault or the
    SIGTERM to its exit). sigterm_after_step: SIGTERM its top process once the train log has that step."""
    env = dict(os.environ, SPECDISTILL_CHECKPOINTS=str(root), DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS=str(torch.get_num_threads()))
    env.pop("SPECDISTILL_FAULT", None)
    if fault:
        env["SPECDISTILL_FAULT"] = fault
    log = Path(str(recipe_file) + f".{time.time_ns()}.out")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specdistill.cli", "train", "--recipe", str(recipe_file)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
        signalled = None
        deadline = time.time() + timeout
        run_dir = root / Path(recipe_file).stem
        while proc.poll() is None and time.time() < deadline:
            if sigterm_after_step is not None and signalled is None:
                logged = (run_dir / "train_log.jsonl").read_text() if (run_dir / "train_log.jsonl").exists() else ""
                if any(json.loads(line)["step"] >= sigterm_after_step for line in logged.splitlines() if line):
                    proc.send_signal(signal.SIGTERM)
                    signalled = time.time()
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        ended = time.time()
    text = log.read_text()
    injected = [float(line.rsplit("t=", 1)[1]) for line in text.splitlines() if line.startswith("SPECDISTILL_FAULT:")]
    start = signalled or (injected[0] if injected else ended)
    return proc.returncode, text, ended - start


def steps_of(run_dir: Path) -> list[int]:
    return [layout.step_of(p) for p in layout.checkpoints(run_dir)]


def logged_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "train_log.jsonl").read_text().splitlines() if line]


def run_chain(tmp_path, target, root, world: int):
    """Uninterrupted reference, then the same run killed at every point in turn, each time resumed."""
    train = {"max_steps": 6, "save_every": 2, "micro_batch_size": 2, "num_gpus": world, "report_to": []}
    if world == 1:
        train["gradient_accumulation_steps"] = 2  # the same global batch as 2 processes
    ref, cut = (make_recipe(tmp_path, target, name, **train) for name in ("ref", "cut"))
    for r in (ref, cut):
        write_cache(r.run_dir, target)
    rc, out, _ = train_process(tmp_path / "ref.yaml", root)
    assert rc == 0, out
    cut_file = tmp_path / "cut.yaml"
    last_rank = world - 1

    # a kill with DeepSpeed's state written and the draft's files not: nothing is trusted
    # (rank 0: it writes the draft's files and renames; another rank's state is whole once it reaches this point)
    rc, out, _ = train_process(cut_file, root, "kill:checkpoint-write:2:0")
    assert rc != 0 and steps_of(cut.run_dir) == [], out
    if world > 1:
        assert "rank 0 (pid" in out and "died without a word" in out, out
    # a kill after COMPLETE is written, before the rename: still nothing is trusted
    rc, out, _ = train_process(cut_file, root, "kill:checkpoint-rename:2")
    assert rc != 0 and steps_of(cut.run_dir) == [] and (cut.run_dir / "step-0000002.tmp" / "COMPLETE").exists(), out
    # a kill in the middle of step 3 (in the last rank only: a rank dies); the others stop within a bounded time
    rc, out, seconds = train_process(cut_file, root, f"kill:step:3:{last_rank}")
    assert rc != 0 and steps_of(cut.run_dir) == [2], out
    if world > 1:
        line = next(line for line in out.splitlines() if "died without a word" in line)
        assert f"rank {last_rank} (pid" in line and "rank 0" not in line and "resume from step-0000002" in line, out
        assert seconds < 45, f"the surviving rank took {seconds:.0f} s to stop"
    # SIGTERM inside step 3 (one rank only): every rank saves step 3 and stops with status 75
    rc, out, _ = train_process(cut_file, root, f"term:step:3:{last_rank}")
    assert rc == 75 and "preempted (SIGTERM): saved step-0000003" in out and steps_of(cut.run_dir) == [2, 3], out
    # SIGTERM from outside (a scheduler) to the `specdistill train` process: at most the step in flight is lost
    rc, out, seconds = train_process(cut_file, root, sigterm_after_step=4)
    assert rc == 75 and "preempted (SIGTERM)" in out, out
    assert steps_of(cut.run_dir)[-1] == max(logged_steps(cut.run_dir)) >= 4, out
    # and the last resumption ends exactly where the uninterrupted run did
    rc, out, _ = train_process(cut_file, root)
    assert rc == 0, out
    assert logged_steps(cut.run_dir) == [1, 2, 3, 4, 5, 6]
    ref_log = [json.loads(line) for line in (ref.run_dir / "train_log.jsonl").read_text().splitlines()]
    cut_log = [json.loads(line) for line in (cut.run_dir / "train_log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in ref_log] == [r["loss"] for r in cut_log]
    assert_same_final_state(layout.step_dir(ref.run_dir, 6), layout.step_dir(cut.run_dir, 6))


@suite
def test_one_process_killed_anywhere_resumes_bit_for_bit(tmp_path, tiny_target_dir, checkpoints_root):
    run_chain(tmp_path, tiny_target_dir, checkpoints_root, world=1)


@suite
def test_two_processes_killed_anywhere_resume_bit_for_bit(tmp_path, tiny_target_dir, checkpoints_root):
    run_chain(tmp_path, tiny_target_dir, checkpoints_root, world=2)

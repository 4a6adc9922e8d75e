"""`make bench ARGS=peer`: our EAGLE-3 trainer and vllm-project/speculators' (v0.9.0) side by side, same data.

1. our `prepare` + `cache` on the recipe (default recipes/smollm2-135m-eagle3.yaml, plus the overrides given);
2. the cache converted to speculators' offline format in `<run_dir>/peer/data` (benchmarks/peer_format.py);
3. our `train` stage, then speculators' own trainer (its `speculators.train` CLI config and `cli.main`, in a
   subprocess whose path holds the peer site), the same number of steps over the same sequences in the same
   order (its batch sampler is replaced by ours, so each step packs exactly the sequences our step reads), the
   same lr, warmup, TTT steps, aux layers and draft-vocabulary size;
4. its last checkpoint brought into our pipeline by our warm-start reader (`draft.init_from`): `train.max_steps`
   must be >= 1 and `train.lr` > 0, so the route is one step at lr 1e-30 (no weight decay, fp32), which writes
   our checkpoint format with our held-out metrics; the bench then checks that checkpoint holds speculators'
   weights unchanged (the largest difference is printed);
5. our `eval` of both (chain at eval.k, T=0, no tree, no comparators) and one table: held-out top-1 and
   simulated τ (our offline metrics on both heads), τ simulated on the target's continuations, measured τ,
   speedup, training wall time and tokens/s; written to `<output_dir>/bench/peer.json`.

    python -m benchmarks.peer_bench [--recipe R] [--toy] [--peer-arg=--optimizer=adamw ...] [overrides ...]

speculators is never a dependency of this project: it lives in its own folder, `$SPECDISTILL_PEER_SITE`
(default `.peer-site` in the checkout, git-ignored), installed without its dependencies (torch, transformers
and datasets come from this project's environment):

    pip install --target .peer-site --no-deps speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3 \
        pydantic-settings==2.16.3 python-dotenv==1.2.4 openai==3.51.0 httpx==0.28.1 httpcore==1.0.9 \
        distro==1.9.0 jiter==0.19.0 sniffio==1.3.1

Adapted to the CPU at run time, nothing of it copied: by its own flags, sdpa attention (its default FlexAttention
has no backward on the CPU) and its eager loss (the fused one needs Triton); by `_cpu_patches` in its process,
the model and batches on the CPU (it moves them to `get_local_rank()`, the int 0: cuda:0), autocast on the CPU (it
autocasts on the accelerator's device type, "cuda" when there is none), a no-op `torch.accelerator.synchronize`
(its step timer calls it; there is no accelerator); and the torchrun variables our in-process DeepSpeed left in
the environment are not passed on (its trainer would start a process group on an accelerator).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from importlib.machinery import PathFinder
from pathlib import Path

import torch

from benchmarks.peer_format import write_offline_data
from benchmarks.peer_table import notes, table
from benchmarks.scaling_bench import EVAL
from specdistill import layout
from specdistill.cli import main as cli
from specdistill.data.cache_reader import CacheDataset
from specdistill.errors import SpecdistillError
from specdistill.eval.results import result_at, result_path
from specdistill.formats import read_checkpoint, read_json, read_jsonl, read_metrics, write_json_atomic
from specdistill.kinds.common.released import read_released
from specdistill.recipe import load_recipe
from specdistill.target import load_target_config, read_target_tensors, resolve_aux_layers, resolve_target
from specdistill.train.loop import step_micro_batches

REPO = Path(__file__).resolve().parents[1]
PEER_SITE_ENV = "SPECDISTILL_PEER_SITE"
PEER_PACKAGES = ("speculators==0.9.0", "hs-connectors==0.9.0", "loguru==0.7.3", "pydantic-settings==2.16.3",
                 "python-dotenv==1.2.4", "openai==3.51.0", "httpx==0.28.1", "httpcore==1.0.9", "distro==1.9.0",
                 "jiter==0.19.0", "sniffio==1.3.1")
PEER_MODULES = ("speculators", "hs_connectors", "loguru", "pydantic_settings", "dotenv", "openai", "httpx",
                "httpcore", "distro", "jiter", "sniffio")  # what importing its trainer needs beyond our venv
DISTRIBUTED_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "CROSS_RANK", "CROSS_SIZE")  # set by our in-process DeepSpeed; its trainer reads them as torchrun's
DEFAULT_RECIPE = "recipes/smollm2-135m-eagle3.yaml"
TOY = ["corpus.max_rows=24", "corpus.max_length=128", "train.max_steps=2", "train.save_every=2",
       "train.micro_batch_size=2", "train.warmup_steps=1", "train.heldout_batches=1",
       "train.heldout_chain_positions=16", "eval.num_prompts=1", "eval.max_new_tokens=8", "eval.tuning_prompts=0"]
EVAL_ONLY_STEP = ["train.max_steps=1", "train.save_every=1", "train.lr=1e-30", "train.weight_decay=0",
                  "train.warmup_steps=0", "train.precision=fp32",  # one step that moves no weight (checked):
                  "train.optimizer=adamw"]  # AdamW, whose lr is that 1e-30 (Muon steps the matrices at muon_lr)


# ---- the peer's folder ---------------------------------------------------------------------------------

def peer_site() -> Path:
    return Path(os.environ.get(PEER_SITE_ENV) or REPO / ".peer-site").expanduser().resolve()


def install_line(site: Path) -> str:
    return f"pip install --target {site} --no-deps {' '.join(PEER_PACKAGES)}"


def missing_peer(site: Path | None = None) -> str | None:
    """None when `site` holds speculators' trainer and what it imports that our environment lacks; else one line
    saying how to install it."""
    site = site or peer_site()
    absent = [m for m in PEER_MODULES if PathFinder.find_spec(m, [str(site)]) is None
              and PathFinder.find_spec(m) is None]
    if not absent:
        return None
    return (f"speculators' trainer is not installed in {site} (missing {', '.join(absent)}): "
            f"{install_line(site)}  (or set {PEER_SITE_ENV} to a folder that has it)")


# ---- speculators' trainer (runs in a subprocess with the peer site on its path) ---------------------------

def peer_argv(*, target_dir: str, data: Path, save: Path, logs: Path, recipe, aux_layers: list[int],
              total_seq_len: int, train_data_ratio: float, extra: list[str]) -> list[str]:
    """Its CLI flags (`python -m speculators.train ...`), matched to our recipe where both trainers have the knob."""
    tc, draft = recipe.train, recipe.draft
    return ["--speculator-type", "eagle3", "--verifier-name-or-path", target_dir, "--data-path", str(data),
            "--save-path", str(save), "--log-dir", str(logs), "--no-resume-from-checkpoint",
            "--draft-arch", "llama", "--num-layers", "1", "--full-attention-indices", "0",
            # the EAGLE-3 head vLLM's Eagle3LlamaForCausalLM loads, which our drafter runs: its defaults add the normed
            # state as the residual, an RMSNorm before fc and post-norm states between steps ("Eagle 3.1")
            "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output",
            "--draft-attn-impl", "sdpa",  # its default, FlexAttention, has no backward on the CPU (torch 2.13)
            "--loss-implementation", "eager",  # its default, fused, needs Triton (a GPU)
            "--target-layer-ids", *map(str, aux_layers), "--draft-vocab-size", str(draft.draft_vocab_size),
            "--ttt-steps", str(draft.ttt_steps), "--lr", str(tc.lr), "--scheduler-type", "cosine",
            "--scheduler-warmup-steps", str(tc.warmup_steps), "--epochs", "1", "--max-steps", str(tc.max_steps),
            "--total-seq-len", str(total_seq_len), "--train-data-ratio", str(train_data_ratio),
            "--hidden-states-dtype", "bfloat16" if tc.precision == "bf16" else "float32",
            "--num-workers", "0", "--on-missing", "raise", "--seed", str(tc.seed), "--log-freq", "1", *extra]


class OurStepOrder:
    """Stands in for its multipack batch sampler on the train split: step s packs exactly the sequences our
    step s reads (train/loop.py step_micro_batches), so both trainers see the same data in the same order."""
    def __init__(self, batches: list[list[int]]):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _cpu_patches(order: list[list[int]], n_train: int, step_s: list[float]) -> None:
    """What its trainer assumes of CUDA, replaced for this process; and our data order on its train split."""
    from speculators.train import cli as peer_cli
    from speculators.train import dataloader as peer_loader
    from speculators.train import trainer as peer_trainer

    peer_trainer.get_local_rank = lambda: torch.device("cpu")  # model.to(0) / batch.to(0) mean cuda:0
    if not torch.accelerator.is_available():  # its step timer synchronizes the accelerator; CPU work is synchronous
        torch.accelerator.synchronize = lambda device=None: None

    class CpuTrainer(peer_trainer.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.device_type = "cpu"  # torch.autocast("cuda") when no accelerator is found

        def train_epoch(self, epoch, *, step_callback=None):  # each step's seconds, its batch's fetch included
            last = [time.perf_counter()]

            def stepped():
                now = time.perf_counter()
                step_s.append(now - last[0])
                last[0] = now
                if step_callback is not None:
                    step_callback()

            return super().train_epoch(epoch, step_callback=stepped)

    peer_cli.Trainer = CpuTrainer
    own_sampler, built = peer_loader.MultipackDistributedBatchSamplerV2, []

    def sampler(**kwargs):  # its loaders are built train first, then validation (dataloader.py)
        built.append(len(kwargs["lengths"]))
        if len(built) == 1:
            if built[0] != n_train:
                raise RuntimeError(f"peer_bench: expected the train split ({n_train} rows) first, got {built[0]}")
            return OurStepOrder(order)
        return own_sampler(**kwargs)

    peer_loader.MultipackDistributedBatchSamplerV2 = sampler


def train_speculators(spec_path: Path) -> None:
    """The subprocess: token frequencies counted its way on the train rows, then its CLI's config and main."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    from datasets import load_from_disk
    from speculators.train import cli as peer_cli
    from speculators.train.config import TrainConfig
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    data = Path(spec["data"])
    train_rows = load_from_disk(str(data)).select(range(spec["n_train"]))
    save_token_frequency_distribution(train_rows, data / "token_freq.pt")  # its d2t/t2d are built from this
    steps = []
    _cpu_patches(spec["order"], spec["n_train"], steps)
    cfg = TrainConfig.resolve(spec["argv"])
    t0 = time.perf_counter()
    peer_cli.main(cfg)
    result = {"wall_s": time.perf_counter() - t0, "step_s": steps, "threads": torch.get_num_threads()}
    Path(spec["result"]).write_text(json.dumps(result))


def run_speculators(spec: dict, work: Path, site: Path) -> dict:
    """speculators' training in a subprocess with `site` on its path; what it measured."""
    spec = {**spec, "result": str(work / "train_result.json"), "threads": torch.get_num_threads()}
    (work / "train_spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}  # ours ran in this process
    env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(site), str(REPO), os.environ.get("PYTHONPATH")) if p),
           "OMP_NUM_THREADS": str(spec["threads"]), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "benchmarks.peer_bench", "--speculators-train",
                           str(work / "train_spec.json")], cwd=REPO, env=env)
    if done.returncode != 0:
        raise SpecdistillError(f"peer_bench: speculators' trainer failed (exit {done.returncode}); its output is above")
    return {**json.loads(Path(spec["result"]).read_text()), "process_s": time.perf_counter() - t0}


# ---- the benchmark ------------------------------------------------------------------------------------

def _stage(stage: str, recipe_path: str, overrides: list[str]) -> float:
    t0 = time.perf_counter()
    if cli([stage, "--recipe", recipe_path, *overrides]) != 0:
        raise SpecdistillError(f"peer_bench: `specdistill {stage}` failed ({' '.join(overrides)})")
    return time.perf_counter() - t0


def step_order(recipe, n_train: int) -> list[list[int]]:
    """Our trainer's sequences per optimizer step (one process: its micro batches, concatenated)."""
    tc = recipe.train
    return [[i for micro in step_micro_batches(n_train, s, tc.micro_batch_size, tc.gradient_accumulation_steps,
                                                1, 0, tc.seed) for i in micro] for s in range(tc.max_steps)]


def last_checkpoint(save: Path) -> Path:
    """The directory of its last saved epoch (`<save>/<epoch>/`: config.json + model.safetensors)."""
    epochs = sorted((d for d in save.iterdir() if d.is_dir() and not d.is_symlink() and d.name.isdigit()),
                    key=lambda d: int(d.name)) if save.is_dir() else []
    if not epochs:
        raise SpecdistillError(f"{save}: speculators' trainer saved no checkpoint")
    return epochs[-1]


def unchanged_by_the_step(released: Path, step_dir: Path) -> float:
    """Largest |difference| between speculators' head and the checkpoint our 1-step lr≈0 run wrote of it (fc
    compared as the function it computes: ours reads aux * aux_scale)."""
    _, theirs = read_released(released)
    _, ours = read_checkpoint(step_dir)
    ours = {**ours, "fc.weight": ours["fc.weight"].float() * ours["aux_scale"].float()[None, :]}
    compared = [k for k in theirs if k in ours and k not in ("d2t", "t2d")]
    if "fc.weight" not in compared or not any(k.startswith("layers.0.") for k in compared):
        raise SpecdistillError(f"{released}: its tensors do not match our head's names ({sorted(theirs)[:6]} ...)")
    worst = 0.0
    for k in compared:
        a, b = theirs[k].float(), ours[k].float()
        if a.shape != b.shape:
            raise SpecdistillError(f"{step_dir}: {k} has shape {tuple(b.shape)}, speculators' {tuple(a.shape)}")
        worst = max(worst, (a - b).abs().max().item() / max(a.abs().max().item(), 1e-12))
    if worst > 1e-5:
        raise SpecdistillError(f"{step_dir}: the evaluation step changed speculators' head (relative {worst:.2e})")
    return worst


def arm(recipe, train_s: float | None, step_s: list[float] | None) -> dict:
    """What one run measured: its last checkpoint's held-out metrics and its eval at T=0."""
    step_dir = layout.checkpoints(recipe.run_dir)[-1]
    metrics = read_metrics(step_dir) or {}
    held = metrics.get("heldout") or {}
    e = read_json(result_path(recipe, step_dir.name))
    t0 = result_at(e, 0.0)
    if step_s is None:  # ours: the training log's steps
        log = read_jsonl(recipe.run_dir / "train_log.jsonl")
        step_s = [r["tokens"] / r["tokens_per_s"] for r in log]
    return {"run": recipe.run_name, "checkpoint": step_dir.name, "heldout_top1": held.get("top1"),
            "heldout_top1_label": (held.get("labels") or {}).get("top1"),
            "heldout_sim_tau": (held.get("chain_tau") or {}).get("0"), "chain_k": held.get("chain_k"),
            "continuations_sim_tau": ((e.get("offline") or {}).get("chain_on_continuations") or {}).get("tau"),
            "measured_tau": t0.get("tau"), "speedup": t0.get("speedup"), "speedup_ci95": t0.get("speedup_ci95"),
            "lossless": t0.get("lossless"), "train_wall_s": train_s, "train_step_s": sum(step_s),
            "steps": len(step_s)}


def peer(recipe_path: str, overrides: list[str], peer_args: list[str]) -> dict:
    """Run the whole comparison (module docstring, steps 1-5); the result peer.json holds."""
    site = peer_site()
    reason = missing_peer(site)
    if reason:
        raise SpecdistillError(reason)
    base = load_recipe(recipe_path, overrides)
    if base.draft.kind != "eagle3":
        raise SpecdistillError(f"{recipe_path}: draft.kind is {base.draft.kind}; the peer bench compares EAGLE-3 trainers")
    if base.train.num_nodes != 1:
        raise SpecdistillError(f"{recipe_path}: the peer bench runs on one node (train.num_nodes 1)")
    # both trainers in one process, with the recipe's sequences per step (its trainer is single-process here)
    overrides = [*overrides, "train.num_gpus=1", f"train.micro_batch_size={base.train.micro_batch_size * base.train.num_gpus}"]
    ours_run = [*overrides, f"run_name={base.run_name}-peer-ours"]
    theirs_run = [*overrides, f"run_name={base.run_name}-peer-speculators"]
    ours, theirs = load_recipe(recipe_path, ours_run), load_recipe(recipe_path, theirs_run)
    for run in (ours_run, theirs_run):  # prepare + cache (the second reuses the shared cache)
        _stage("prepare", recipe_path, run)
        _stage("cache", recipe_path, run)
    for r in (ours, theirs):  # a rerun starts over: both trainers from scratch on the same data
        for d in layout.checkpoints(r.run_dir):
            shutil.rmtree(d)

    work = ours.run_dir / "peer"
    shutil.rmtree(work, ignore_errors=True)
    target_dir = resolve_target(ours.target)
    norm = read_target_tensors(target_dir, ["model.norm.weight"])["model.norm.weight"]
    converted = write_offline_data(layout.cache_dir(ours.run_dir), work / "data", norm)
    n_train = converted["rows"]["train"]
    lengths = CacheDataset(layout.cache_dir(ours.run_dir), "train").lengths
    order = step_order(ours, n_train)
    total_seq_len = max(sum(lengths[i] - 1 for i in step) for step in order)  # its shift drops one token a row
    print(f"peer: converted {sum(converted['rows'].values())} sequences ({converted['tokens']:,} tokens) to "
          f"speculators' offline format in {work / 'data'}", flush=True)

    ours_train_s = _stage("train", recipe_path, ours_run)
    aux = resolve_aux_layers(ours, load_target_config(ours.target).num_hidden_layers)
    argv = peer_argv(target_dir=target_dir, data=work / "data", save=work / "checkpoints", logs=work / "logs",
                     recipe=ours, aux_layers=aux, total_seq_len=total_seq_len,
                     train_data_ratio=converted["train_data_ratio"], extra=peer_args)
    measured = run_speculators({"argv": argv, "data": str(work / "data"), "n_train": n_train, "order": order},
                               work, site)
    released = last_checkpoint(work / "checkpoints")
    _stage("train", recipe_path, [*theirs_run, f"draft.init_from={released}", *EVAL_ONLY_STEP])
    drift = unchanged_by_the_step(released, layout.checkpoints(theirs.run_dir)[-1])
    overlap = vocabulary_overlap(released, layout.checkpoints(ours.run_dir)[-1])
    for run in (ours_run, theirs_run):
        _stage("eval", recipe_path, [*run, *EVAL])

    tokens = (read_metrics(layout.checkpoints(ours.run_dir)[-1]) or {}).get("tokens_seen")  # same sequences in both
    rows = {"ours": arm(ours, ours_train_s, None), "speculators": arm(theirs, measured["wall_s"], measured["step_s"])}
    for r in rows.values():
        r["tokens"] = tokens
        r["tokens_per_s"] = tokens / r["train_step_s"] if tokens and r["train_step_s"] else None
    command = " ".join(["python -m benchmarks.peer_bench --recipe", recipe_path, *overrides,
                        *(f"--peer-arg={a}" for a in peer_args)])
    result = {"command": command, "arms": rows, "peer_checkpoint": str(released), "eval_step_drift": drift,
              "peer_argv": argv, "threads": {"ours": torch.get_num_threads(), "speculators": measured["threads"]},
              "converted": converted, "draft_vocabulary_overlap": overlap,
              "notes": notes(ours, drift, overlap, peer_args)}
    out = base.run_dir.parent / "bench"  # beside the runs, as checkpoints/bench/scaling.json
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "peer.json", result)
    return result


def vocabulary_overlap(released: Path, step_dir: Path) -> int:
    """Draft tokens both heads have (target id = i + d2t[i])."""
    ids = [set((torch.arange(len(s["d2t"])) + s["d2t"].long()).tolist())
           for s in (read_released(released)[1], read_checkpoint(step_dir)[1])]
    return len(ids[0] & ids[1])


def run(recipe_path: str) -> dict:
    """The benchmark at full size on a pinned recipe (experiments/run.py's bench runner)."""
    return peer(recipe_path, [], [])


def main(argv: list[str] | None = None) -> None:
    """argv: this benchmark's own arguments (`make bench ARGS="peer ..."` passes what follows)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--speculators-train"]:
        train_speculators(Path(argv[1]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--toy", action="store_true", help="a handful of rows and 2 steps: proves it runs")
    parser.add_argument("--peer-arg", action="append", default=[], help="one more flag for its trainer, "
                        "e.g. --peer-arg=--optimizer=adamw (repeatable)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    reason = missing_peer()
    if reason:
        print(reason)
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    overrides = (TOY if args.toy else []) + args.overrides
    print(table(peer(args.recipe, overrides, args.peer_arg)))


if __name__ == "__main__":
    main()

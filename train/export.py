"""The `export` stage: write a checkpoint in a format vLLM loads, with the exact `vllm serve` command.

Which kind offers which formats, and how each is written, is the kind's (specdistill/kinds/<kind>/config.py
`EXPORT_FORMATS`, the default first; its formats.py `export`; formats and names: ../shared/docs/vllm-formats.md).
This stage picks the checkpoint, checks it belongs to the recipe's target, has the kind write the format into
a temp directory, adds a README (the target, the serve command, what `specdistill eval` measured) and swaps
the directory into place.

The export directory name ("vllm-eagle") does not contain "eagle-", so vLLM cannot guess the method
from the path: the README's serve command always passes "method".
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from specdistill import formats, integrity, kinds, layout
from specdistill.errors import SpecdistillError
from specdistill.eval.results import read_result, result_path
from specdistill.eval.tables import summary_line
from specdistill.target import fingerprint_target, load_target_config, resolve_target


# ---------------------------------------------------------------------------------------------- run

def run(recipe, args) -> None:
    run_dir = recipe.run_dir
    step_dir = layout.select_checkpoint(run_dir, getattr(args, "checkpoint", None))
    kind = read_draft_config(step_dir)["kind"]
    formats = [args.format] if getattr(args, "format", None) else (recipe.export.formats
                                                                   or [kinds.kind(kind).EXPORT_FORMATS[0]])
    for fmt in formats:
        out = export_checkpoint(recipe, step_dir, fmt)
        print(f"exported {step_dir.name} ({kind}) as {fmt}: {out}")
        print("serve it with:", serve_command(recipe, fmt, out, speculative_tokens(recipe, step_dir)))


def read_draft_config(step_dir: Path) -> dict:
    """The checkpoint's draft_config.json, its kind one that is implemented."""
    cfg = formats.read_draft_config(step_dir)
    kinds.kind(cfg["kind"])
    return cfg


def export_checkpoint(recipe, step_dir: Path, fmt: str) -> Path:
    """Write checkpoints/<run>/export/<fmt>/ atomically; return it."""
    fmt_kind = kinds.kind_of_format(fmt)
    draft_cfg = read_draft_config(step_dir)
    kind = kinds.kind(draft_cfg["kind"])
    if fmt_kind is not kind:
        raise SpecdistillError(f"{step_dir}: format {fmt} exports '{fmt_kind.NAME}' drafts ({fmt_kind.LABEL}), "
                               f"this checkpoint is a '{kind.NAME}' draft (use --format {kind.EXPORT_FORMATS[0]})")
    check_same_target(recipe, step_dir, draft_cfg)
    integrity.check_checkpoint(step_dir, only=formats.DRAFT_FILES)  # a corrupt checkpoint is refused, not exported
    target_config = load_target_config(recipe.target)

    out = layout.export_dir(recipe.run_dir, fmt)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        kind.export(fmt, step_dir, draft_cfg, recipe, target_config, tmp, speculative_tokens(recipe, step_dir))
        write_readme(recipe, step_dir, draft_cfg, fmt, tmp, final_dir=out)
        integrity.write_checksums(tmp)  # SHA256SUMS, read back by `specdistill verify` and by draft.init_from
        for f in tmp.iterdir():  # safetensors writes 0600; a serving process may run as another user
            f.chmod(0o644)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def replace_dir(tmp: Path, out: Path) -> None:
    """Swap a finished temp dir into place; a crash never leaves a half-written export at `out`."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def check_same_target(recipe, step_dir: Path, draft_cfg: dict) -> None:
    """A head is only valid for the target it was trained on."""
    saved = (draft_cfg.get("target") or {}).get("fingerprint")
    if not saved or "error" in saved:  # training could not fingerprint (e.g. a hub target offline)
        return
    try:
        now = fingerprint_target(recipe.target)
    except Exception as e:  # same reason now: say so, do not block the export
        print(f"warning: cannot fingerprint target {recipe.target.path} to check the checkpoint against it: "
              f"{str(e).splitlines()[0][:200]}")
        return
    for key in ("config", "weights"):
        if key in saved and saved[key] != now[key]:
            raise SpecdistillError(f"{step_dir}/draft_config.json: trained against a different target "
                                   f"({key} fingerprint {saved[key]} != {now[key]} of target.path {recipe.target.path})")


# --------------------------------------------------------------------------------------------- README

def measured(recipe, checkpoint: str, run_dir: Path | None = None) -> tuple[dict | None, str]:
    """(the checkpoint's eval result on the recipe's prompts in its runtime, or None; the README's "Measured"
    text). A result of other weights (the checkpoint retrained since) is refused, with its best K; one that
    records no fingerprint is flagged. run_dir: the run's directory (default the recipe's)."""
    result = read_result(recipe, checkpoint, run_dir)
    if result is None:
        return None, f"not evaluated on these prompts in this runtime (no {result_path(recipe, checkpoint, run_dir).name})"
    changed = [r for r in result["_stale"] if not r.startswith("unverified")]
    if changed:
        return None, (f"not shown: {Path(result['_file']).name} measured another version of this checkpoint "
                      f"({'; '.join(changed)}); rerun `specdistill eval`")
    lines = [f"- ⚠ {r}" for r in result["_stale"]]
    lines += [f"- {summary_line(result, r)}" for r in result["results"]]
    hw = result.get("hardware") or {}
    where = (f"measured by `specdistill eval` ({Path(result['_file']).name}) on {result.get('num_prompts')} prompts of "
             f"{result.get('prompts')}, max_new_tokens {result.get('max_new_tokens')}, on "
             f"{hw.get('cpu', '?')} ({hw.get('device', '?')}, {hw.get('threads', '?')} threads); "
             "speedup is against plain decoding of the target in the same run, by specdistill's own engine.")
    return result, "\n".join(lines + ["", where])


def speculative_tokens(recipe, step_dir: Path, why: bool = False):
    """export.num_speculative_tokens, else the measured best K at T=0, else eval.k (and why, if asked)."""
    k, reason = recipe.export.num_speculative_tokens, "export.num_speculative_tokens"
    if not k:
        data, _ = measured(recipe, step_dir.name)
        best = [r for r in (data or {}).get("results", []) if r.get("temperature") == 0 and r.get("best_k")]
        k, reason = (int(best[0]["best_k"]), "the best K measured at T=0 by `specdistill eval`: "
                     + best[0].get("best_k_from", "")) if best else (recipe.eval.k, "eval.k (no measured best K)")
    return (k, reason) if why else k


# At T>0 vLLM drafts the argmax by default and takes the draft as one-hot (a draft is kept with probability p(x));
# our engine samples the draft and keeps it with min(1, p/q), which keeps more (served α₁ 0.17 against our 0.25
# at T=1, experiment served-parity). "probabilistic" makes vLLM do what was measured; its proposer for these
# methods has the mode (vllm/v1/spec_decode/llm_base_proposer.py), Medusa's has not.
PROBABILISTIC_DRAFTS = {"eagle", "eagle3", "draft_model"}


def serve_command(recipe, fmt: str, export_dir: Path, k: int) -> str:
    method = kinds.kind_of_format(fmt).VLLM_METHOD[fmt]
    spec = {"method": method, "model": str(Path(export_dir).resolve()), "num_speculative_tokens": k}
    if method in PROBABILISTIC_DRAFTS:
        spec["draft_sample_method"] = "probabilistic"
    return f"vllm serve {resolve_target(recipe.target)} --speculative-config '{json.dumps(spec)}'"


def write_readme(recipe, step_dir: Path, draft_cfg: dict, fmt: str, out: Path, final_dir: Path) -> None:
    fingerprint = (draft_cfg.get("target") or {}).get("fingerprint")
    _, measured_text = measured(recipe, step_dir.name)
    k, k_reason = speculative_tokens(recipe, step_dir, why=True)
    text = f"""# {recipe.run_name} / {step_dir.name} — {fmt}

Draft kind `{draft_cfg['kind']}`, step {draft_cfg.get('step')}, exported by
`specdistill export --recipe {recipe.source} --checkpoint {step_dir.name} --format {fmt}`.

## Target it belongs to
- target.path: `{recipe.target.path}` (dtype {recipe.target.dtype})
- served from: `{serve_command(recipe, fmt, final_dir, k).split()[2]}`
- fingerprint: `{json.dumps(fingerprint) if fingerprint else 'not recorded in the checkpoint'}`

The head is only valid with this exact target.

## Serve with vLLM
```sh
{serve_command(recipe, fmt, final_dir, k)}
```
"method" is explicit: vLLM guesses it from the directory name only, and an export directory may be
moved or renamed.
num_speculative_tokens {k}: {k_reason}.

## Measured
{measured_text}

## Served by vLLM
`specdistill served --recipe {recipe.source}` serves this directory with the command above, measures
acceptance in vLLM and writes SERVED.md here: whether the head is fit to deploy (every tensor loaded, lossless
at T=0, served τ inside the interval of the τ measured above). No SERVED.md: not served yet.
"""
    formats.write_text_atomic(out / "README.md", text)

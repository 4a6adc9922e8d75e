"""An experiment file: one README table, every setting it depends on pinned.

`recipe` is a complete recipe (every key of the schema written out, as `specdistill.recipe.recipe_dump`
gives it), so the experiment does not move when a default changes; `arms` are the runs the table compares,
each a list of `section.key=value` overrides of that recipe. A key added to the schema after the experiment's
record was written (absent from the record's `settings`) may stay unpinned: the arm runs it at its default, as
the record's run ran without it; a key the record has must be pinned. `command` is what reproduces it, as written;
`python -m experiments.run <name>` runs the runner named by `runner` and writes experiments/records/<name>.json.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from specdistill.errors import SpecdistillError
from specdistill.recipe import load_recipe, parse_override, recipe_dump

EXPERIMENTS = Path(__file__).resolve().parent
RECORDS = EXPERIMENTS / "records"


class Experiment(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    title: str
    readme_section: str  # the experiments/README.md section holding the table (its marker: <!-- experiment: NAME -->)
    command: str  # what reproduces the table, as a user types it
    runner: Literal["pipeline", "bench", "exactness"]
    bench: Literal["decode", "hybrid", "runtime", "scaling", "peer"] | None = None  # runner bench: the `make bench` entry, on the pinned recipe
    recipe: dict
    arms: dict[str, list[str]] = {"main": []}
    columns: list[str]


def path_of(name: str) -> Path:
    return EXPERIMENTS / f"{name}.yaml"


def names() -> list[str]:
    return sorted(p.stem for p in EXPERIMENTS.glob("*.yaml"))


def load(name: str) -> Experiment:
    """The experiment file, validated: its fields, and its recipe complete and valid under the current schema,
    with every arm's overrides applied (a renamed or removed key, or a key of the schema not pinned here that
    the record's settings have, stops with the key named; with no record for the arm, every key is pinned)."""
    path = path_of(name)
    try:
        exp = Experiment.model_validate(yaml.safe_load(path.read_text()))
    except (OSError, yaml.YAMLError) as e:
        raise SpecdistillError(f"{path}: {e}".replace("\n", " ")) from None
    except ValidationError as e:
        raise SpecdistillError(f"{path}: " + "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}"
                                                       for x in e.errors())) from None
    if exp.name != name:
        raise SpecdistillError(f"{path}: name {exp.name!r} differs from the file's {name!r}")
    if exp.command != f"python -m experiments.run {name}":  # the one command that runs the pinned settings
        raise SpecdistillError(f"{path}: command must be `python -m experiments.run {name}`, not {exp.command!r}")
    if (exp.runner == "bench") != (exp.bench is not None):
        raise SpecdistillError(f"{path}: bench names the benchmark of runner bench, and only of it")
    recorded = recorded_settings(name)
    for arm in exp.arms:
        record = recorded.get(arm)
        missing = [key for key in unpinned(exp, arm) if record is None or has_key(record, key)]
        if missing:
            raise SpecdistillError(f"{path}: recipe does not pin {', '.join(missing)} (a default it would inherit)")
    return exp


def recorded_settings(name: str) -> dict[str, dict]:
    """The record's settings, arm -> the full recipe it ran ({} when the experiment has no record yet)."""
    path = RECORDS / f"{name}.json"
    return json.loads(path.read_text())["settings"] if path.is_file() else {}


def unpinned(exp: Experiment, arm: str) -> list[str]:
    """Keys of the arm's full recipe that neither the recipe nor the arm's overrides pin (an arm of another draft
    kind sets that kind's keys)."""
    full = recipe_dump(pinned_recipe(exp, arm))
    return sorted(set(missing_keys(full, exp.recipe)) & set(missing_keys(full, arm_recipe(exp, arm))))


def newer_than_record(exp: Experiment, arm: str, record: dict | None) -> list[str]:
    """The unpinned keys the record's settings for this arm lack: added to the schema after the record was
    written, run at their defaults. None when there is no record of the arm (then no key is newer)."""
    if record is None:
        return []
    return [key for key in unpinned(exp, arm) if not has_key(record, key)]


def has_key(tree: dict, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def settings_as_recorded(exp: Experiment, arm: str, record: dict | None) -> dict:
    """The arm's full recipe less the keys newer than its record: what the record's settings hold when the file
    has not changed since the record was written."""
    full = recipe_dump(pinned_recipe(exp, arm))
    for key in newer_than_record(exp, arm, record):
        *parents, last = key.split(".")
        node = full
        for part in parents:
            node = node[part]
        del node[last]
    return full


def arm_recipe(exp: Experiment, arm: str) -> dict:
    """The pinned recipe as written, with the arm's overrides set in it (what the arm pins)."""
    tree = json.loads(json.dumps(exp.recipe))
    for text in exp.arms[arm]:
        parts, value = parse_override(text)
        node = tree
        for p in parts[:-1]:
            node = node.setdefault(p, {}) if isinstance(node.get(p, {}), dict) else {}
        node[parts[-1]] = value
    return tree


def pinned_recipe(exp: Experiment, arm: str):
    """The recipe of one arm: the pinned recipe with the arm's overrides, through the recipe loader; never a plan's
    sizes (a run of the same name may have left one in its run dir; each stage applies it itself)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        fh.write(json.dumps(exp.recipe))  # JSON is YAML
    try:
        return load_recipe(fh.name, exp.arms[arm], planned=False)
    except SpecdistillError as e:
        raise SpecdistillError(f"{path_of(exp.name)}: arm {arm!r}: {e}") from None
    finally:
        Path(fh.name).unlink()


def missing_keys(full: dict, pinned: dict, prefix: str = ""):
    """Keys of the schema's full dump that the pinned recipe leaves to a default."""
    for key, value in full.items():
        if key not in pinned:
            yield prefix + key
        elif isinstance(value, dict) and isinstance(pinned[key], dict) and key not in ("terms", "tree", "columns"):
            yield from missing_keys(value, pinned[key], f"{prefix}{key}.")

"""`specdistill config --recipe R [overrides]`: print the resolved recipe, i.e. what a stage would run.

The YAML printed is the recipe after overrides and defaults (every key), followed by comments with
where the run's outputs go. Feeding it back as a recipe reproduces the same run.
"""
from __future__ import annotations

import yaml

from specdistill import layout
from specdistill.recipe import recipe_dump


def resolved_yaml(recipe) -> str:
    return yaml.safe_dump(recipe_dump(recipe), sort_keys=False, default_flow_style=None, width=100)


def run(recipe, args=None) -> str:
    text = resolved_yaml(recipe)
    text += (f"# recipe file: {recipe.source}\n"
             f"# run directory: {recipe.run_dir}\n"
             f"# shared cache directory: {layout.shared_cache_root(recipe)}\n")
    print(text, end="")
    return text

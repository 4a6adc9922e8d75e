"""`specdistill <stage> --recipe recipes/NAME.yaml [section.key=value ...]`.

Each stage lives in its own module and exposes `run(recipe, args)`; the CLI only parses arguments,
loads the recipe and turns a SpecdistillError into one readable line. Overrides may stand anywhere
on the command line, before or after the options (`parse_intermixed_args`).
`specdistill config --recipe R [overrides]` prints the resolved recipe: what a stage would run.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import time

from specdistill import runlock
from specdistill.errors import Preempted, SpecdistillError
from specdistill.plan import time_left
from specdistill.recipe import load_recipe
from specdistill.stages import STAGES
from specdistill.strict import strict_device_from_env

# Stages that accept --restart (start the run over instead of refusing changed settings).
RESTARTABLE = {"train"}
# Stages that write into a run: one at a time per run and stage (specdistill/runlock.py).
ONE_WRITER = {"train", "eval"}


def build_parser(subparsers: dict | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdistill",
        description="Train draft models for speculative decoding and measure them by real decoding. "
                    "Stages run in this order: " + " -> ".join(STAGES) + ".",
        epilog="Example: specdistill train --recipe recipes/smollm2-135m-eagle.yaml train.max_steps=50",
    )
    sub = parser.add_subparsers(dest="stage", metavar="STAGE")
    for name, (_, help_text, extra) in STAGES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--recipe", required=True, help="recipe YAML file (see recipes/)")
        for flag, kwargs in extra:
            p.add_argument(flag, **kwargs)
        if name in RESTARTABLE:
            p.add_argument("--restart", action="store_true",
                           help="start the run over: remove its checkpoints instead of refusing changed settings")
        p.add_argument("overrides", nargs="*", metavar="section.key=value",
                       help="override recipe keys (anywhere on the line), values parsed as YAML")
        if subparsers is not None:
            subparsers[name] = p
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Stage arguments with overrides collected from anywhere on the line.

    argparse's parse_intermixed_args refuses a parser with sub-commands, so the stage's own parser
    (which has no sub-commands) parses everything after the stage name.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    subparsers: dict[str, argparse.ArgumentParser] = {}
    parser = build_parser(subparsers)
    if not argv or argv[0] not in subparsers:
        return parser.parse_args(argv)  # --help, no stage, or an unknown stage: argparse's own message
    args = subparsers[argv[0]].parse_intermixed_args(argv[1:])
    args.stage = argv[0]
    if getattr(args, "runs", None):  # `--runs a b eval.k=3`: the greedy list took an override (run names have no '=')
        args.overrides = [r for r in args.runs if "=" in r] + list(args.overrides)
        args.runs = [r for r in args.runs if "=" not in r] or None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.stage is None:
        build_parser().print_help()
        return 2
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        module = importlib.import_module(STAGES[args.stage][0])
        strict = strict_device_from_env()
        if args.stage in ONE_WRITER:
            lock = runlock.hold(recipe.run_dir, args.stage)
        else:
            lock = contextlib.nullcontext()
        t0 = time.time()
        with lock, strict:
            module.run(recipe, args)
        line = time_left(recipe, args.stage, time.time() - t0)
        if line:
            print(line, flush=True)
    except Preempted as e:  # stopped on request after saving: not an error, but not done either
        print(f"specdistill {args.stage}: {e}", file=sys.stderr)
        return Preempted.EXIT_CODE
    except SpecdistillError as e:
        print(f"specdistill {args.stage}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"specdistill {args.stage}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

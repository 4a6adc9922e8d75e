"""One process of a spread eval (eval/spread.py starts it): the serial eval (`evaluate.run`) over its share of the
checkpoints, on the one GPU it sees, writing each checkpoint's eval JSON; its output goes to its log.

`python -m specdistill.eval.spread_worker --recipe R --checkpoint step-A,step-B --comparators-with step-N [overrides]`
"""
from __future__ import annotations

import argparse
import os
import sys

from specdistill.errors import SpecdistillError
from specdistill.eval.evaluate import run
from specdistill.recipe import load_recipe
from specdistill.strict import strict_device_from_env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="one process of a spread eval (started by `specdistill eval`)")
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--checkpoint", required=True, help="its checkpoints, comma-separated")
    parser.add_argument("--comparators-with", dest="comparators_with", required=True,
                        help="the run's last checkpoint: the comparators are measured with it alone")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        with strict_device_from_env():  # a spread process honours SPECDISTILL_STRICT_DEVICE as `specdistill` does
            run(recipe, args)
    except SpecdistillError as e:
        print(f"specdistill eval: error: {e}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

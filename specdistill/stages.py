"""The stages the CLI runs, in `make distill`'s order: each one's module (exposing `run(recipe, args)`), its one-line
help and its own arguments. The CLI builds its parser from this table and the plan (specdistill/plan_stage.py)
runs each stage at a few rows from it.
"""
from __future__ import annotations

from specdistill import kinds

# stage -> (module, one-line help, extra arguments)
STAGES = {
    "plan": ("specdistill.plan_stage", "measure this machine at a few rows and size the run to budget_minutes "
             "(make distill's first step)", []),
    "prepare": ("specdistill.data.prepare", "read the corpus, apply the chat template, tokenize, split", []),
    "cache": ("specdistill.data.cache", "run the target once over the corpus and cache what training needs", []),
    "train": ("specdistill.train.launch", "train the draft under DeepSpeed (one or many processes)", []),
    "eval": ("specdistill.eval.evaluate", "decode the prompts speculatively with every checkpoint; measure alpha, tau, speedup",
             [("--checkpoint", dict(default=None, help="step-N (several: comma-separated), 'all' or 'last' (default: the recipe's eval.checkpoints)"))]),
    "workloads": ("specdistill.eval.by_workload", "decode each workload (chat, summarise, passage_qa, code, math) with "
                  "the head, prompt lookup and their hybrid; tau and speedup per workload", []),
    "report": ("specdistill.eval.report", "write report.md with plots: offline KL vs measured acceptance",
               [("--runs", dict(nargs="+", default=None, help="compare several run names"))]),
    "export": ("specdistill.train.export", "export a checkpoint in a format vLLM loads",
               [("--checkpoint", dict(default=None, help="step-N or best (default: the last)")),
                ("--format", dict(default=None, help=f"{', '.join(kinds.export_formats())} (default: the recipe's)"))]),
    "served": ("specdistill.eval.served", "serve every export with vLLM, measure acceptance there, gate on parity "
               "with eval (needs `make setup-vllm`)", []),
    "config": ("specdistill.config_stage", "print the resolved recipe (file + overrides + defaults): what will run", []),
    "verify": ("specdistill.verify_stage", "check a run's cache, checkpoints and exports against their checksums; "
               "name every bad file",
               [("--full", dict(action="store_true", help="hash every byte of the cache (default: sizes, headers and "
                                                            "a sample of the data, as cache.verify: sample)"))]),
}

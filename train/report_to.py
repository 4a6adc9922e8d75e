"""Where training metrics go (`train.report_to`): TensorBoard always; Weights & Biases and MLflow when asked
for and installed — never a dependency. Both run offline unless told otherwise: wandb in `WANDB_MODE`
(default offline: runs land in <run>/wandb, `wandb sync` uploads them later), MLflow to
`MLFLOW_TRACKING_URI` (default a file store in <run>/mlruns). Same interface as SummaryWriter."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from specdistill.recipe import recipe_dump


def _flat(tree, prefix: str = "") -> dict:
    out = {}
    for k, v in (tree or {}).items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class Reporters:
    def __init__(self, recipe, tb_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(tb_dir))
        self.wandb = self.mlflow = None
        self.notes: list[str] = []
        run_dir = recipe.run_dir
        wanted = list(getattr(recipe.train, "report_to", None) or ["tensorboard"])
        config = recipe_dump(recipe)
        if "wandb" in wanted:
            if importlib.util.find_spec("wandb") is None:
                self.notes.append("train.report_to wandb: wandb is not installed (pip install wandb); skipped")
            else:
                import wandb

                run_dir.mkdir(parents=True, exist_ok=True)
                self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "specdistill"), name=recipe.run_name,
                                        dir=str(run_dir), config=config, mode=os.environ.get("WANDB_MODE", "offline"),
                                        resume="allow", id=os.environ.get("WANDB_RUN_ID"))
                self.notes.append(f"train.report_to wandb: logging ({os.environ.get('WANDB_MODE', 'offline')}) "
                                  f"under {run_dir / 'wandb'}")
        if "mlflow" in wanted:
            if importlib.util.find_spec("mlflow") is None:
                self.notes.append("train.report_to mlflow: mlflow is not installed (pip install mlflow); skipped")
            else:
                import mlflow

                uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
                mlflow.set_tracking_uri(uri)
                mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "specdistill"))
                self.mlflow = mlflow
                mlflow.start_run(run_name=recipe.run_name)
                mlflow.log_params({k: str(v)[:250] for k, v in _flat(config).items()})
                self.notes.append(f"train.report_to mlflow: logging to {uri}")
        for note in self.notes:
            print(note, flush=True)

    def add_scalar(self, tag: str, value, step: int) -> None:
        self.tb.add_scalar(tag, value, step)
        if self.wandb is not None:
            self.wandb.log({tag: value}, step=step)
        if self.mlflow is not None:
            self.mlflow.log_metric(tag, float(value), step=step)

    def flush(self) -> None:
        self.tb.flush()

    def close(self) -> None:
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.end_run()

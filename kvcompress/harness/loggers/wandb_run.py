"""``logger=wandb``: one W&B run per experiment (config, metrics, per-case tables), one per finished sweep
(table and plots). Offline by default (``WANDB_MODE``), no account needed; ``wandb sync`` uploads later.
"""

from __future__ import annotations

from pathlib import Path

from kvcompress.harness.extras import require
from kvcompress.harness.loggers import Logger, scalar_metrics, table_metrics


def _table(rows: list[dict]):
    import wandb

    columns = sorted({k for r in rows for k in r})
    return wandb.Table(columns=columns, data=[[_cell(r.get(c)) for c in columns] for r in rows])


def _cell(value):
    return value if isinstance(value, (int, float, str, type(None))) else str(value)


class WandbLogger(Logger):
    """Logs to W&B; ``mode`` is ``offline`` unless set (``online`` needs ``wandb login``), ``dir`` defaults
    to the run (or sweep) folder so offline runs sit next to their ``results.json``. Needs the ``wandb``
    extra (``pip install 'kvcompress[wandb]'``): refused by name without it."""

    def __init__(self, project="kvcompress", entity=None, mode="offline", dir=None, tags=(), group=None):
        require(["logger=wandb"], [])
        self.settings = {"project": project, "entity": entity, "mode": mode, "tags": list(tags or [])}
        self.dir, self.group = dir, group
        self.last_run = None

    def _init(self, folder, name: str, config: dict, job_type: str):
        import wandb

        folder = Path(self.dir or folder)
        folder.mkdir(parents=True, exist_ok=True)
        group = self.group or config.get("sweep_name")
        return wandb.init(
            dir=str(folder), name=name, group=group, job_type=job_type, config=config, **self.settings
        )

    def log_run(self, record: dict, out_dir) -> None:
        config = record.get("config", {})
        run = self._init(out_dir, Path(out_dir).name, config, "run")
        scalars = scalar_metrics(record)
        run.log(scalars)
        run.summary.update({"status": record.get("status"), "policy": record.get("policy_name"), **scalars})
        if record.get("error"):
            run.summary["error"] = record["error"]
        for key, rows in table_metrics(record).items():
            run.log({key: _table(rows)})
        run.finish()
        self.last_run = run

    def log_sweep(self, summary: dict, sweep_dir) -> None:
        import wandb

        name = Path(sweep_dir).name
        run = self._init(
            sweep_dir, f"{name}-summary", {"sweep_dir": str(sweep_dir), "sweep_name": name}, "sweep"
        )
        run.log({"summary": _table(summary["rows"])})
        images = {Path(p).stem: wandb.Image(str(p)) for p in summary["files"] if str(p).endswith(".png")}
        if images:
            run.log(images)
        run.summary["runs"] = len(summary["rows"])
        run.finish()
        self.last_run = run

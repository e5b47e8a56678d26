"""One experiment: validate, load, run the task, write ``results.json`` atomically, print a table."""

from __future__ import annotations

import importlib
import inspect
import random
import time
import traceback
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from kvcompress.cache import make_policy
from kvcompress.models import load_model
from kvcompress.report import flatten, markdown_table
from kvcompress.results import RESULTS_FILE, environment, write_json_atomic


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def _task_fn(task_cfg):
    target = task_cfg.get("_target_")
    module, _, attr = target.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def run_experiment(cfg: DictConfig, out_dir: Path) -> dict:
    """Run ``cfg`` and write its record to ``out_dir/results.json`` (a failure record on error)."""
    config = OmegaConf.to_container(cfg, resolve=True)
    record = {"status": "running", "config": config}
    policy = make_policy(config["policy"])  # validates fields before any model work
    record["policy_name"] = policy.name
    task = _task_fn(cfg.task)
    seed_everything(cfg.get("seed", 0))
    start = time.time()
    try:
        model, tok = load_model(cfg.model.name, dtype=cfg.model.get("dtype"), device=cfg.model.get("device"))
        if cfg.model.get("attn_backend"):
            from kvcompress.attention import set_backend

            set_backend(model, cfg.model.attn_backend)
        record["environment"] = environment(model)
        extra = {"out_dir": Path(out_dir)} if "out_dir" in inspect.signature(task).parameters else {}
        record["metrics"] = task(model, tok, policy, cfg.task, **extra)
        record["status"] = "ok"
    except Exception as err:
        record.update(status="failed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
        raise
    finally:
        record["wall_s"] = time.time() - start
        write_json_atomic(Path(out_dir) / RESULTS_FILE, record)
    print(markdown_table([flatten(record)]))
    return record

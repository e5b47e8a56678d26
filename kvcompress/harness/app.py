"""One experiment: validate, load, run the task, write ``results.json`` atomically, log, print a table (a
multirun's runs print none: the sweep's table is printed once, at its end, by ``sweep.CollectCallback``).

A run whose folder already holds an ``ok`` record of the same config and code version is skipped
(``resume=false`` reruns it, ``resume=any`` also reuses records of other code versions), so a killed sweep
started again with the same command only runs what is missing.
"""

from __future__ import annotations

import importlib
import inspect
import random
import sys
import time
import traceback
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from kvcompress.core.cache import make_policy
from kvcompress.harness.loggers import make_logger
from kvcompress.harness.report import flatten, markdown_table
from kvcompress.harness.results import (
    RESULTS_FILE,
    code_version,
    command_line,
    environment,
)
from kvcompress.harness.sweep import completed_record, running_process
from kvcompress.resources import packed_linears
from kvcompress.resources.files import write_json_atomic
from kvcompress.resources.models import load_model


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


def run_policy(config: dict):
    """The run's policy, over the ``storage`` group's choice when one is selected."""
    storage = config.get("storage")
    if storage:
        return make_policy(config["policy"], storage=storage)
    return make_policy(config["policy"])


def _storage_name(policy) -> str:
    storage = getattr(policy, "storage", None)
    return "per-layer" if storage is None else storage.name


def _execute(cfg: DictConfig, record: dict, out_dir: Path) -> dict:
    """Validate the policy, load the model, run the task; returns the task's metrics."""
    policy = run_policy(record["config"])  # validates fields before any model work
    record["policy_name"] = policy.name
    record["selector"], record["storage"] = policy.selector, _storage_name(policy)
    task = _task_fn(cfg.task)
    seed_everything(cfg.get("seed", 0))
    packed_linears.check(cfg.model.get("linears"))
    model, tok = load_model(cfg.model.name, dtype=cfg.model.get("dtype"), device=cfg.model.get("device"))
    if cfg.model.get("attn_backend"):
        from kvcompress.core.attention import set_backend

        set_backend(model, cfg.model.attn_backend)
    packed = packed_linears.apply(model, cfg.model.get("linears"))
    record["environment"] = environment(model) | {"packed_linears": packed}
    extra = {"out_dir": Path(out_dir)} if "out_dir" in inspect.signature(task).parameters else {}
    return task(model, tok, policy, cfg.task, **extra)


def _hydra_overrides() -> list[str] | None:
    """This run's command-line overrides from Hydra (None outside a Hydra app)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except (ImportError, ValueError):
        return None


def _in_multirun() -> bool:
    """Whether this is one run of a Hydra multirun (False outside a Hydra app)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except (ImportError, ValueError):
        return False


def run_experiment(cfg: DictConfig, out_dir: Path, raise_errors: bool = True) -> dict:
    """Run ``cfg`` and write its record to ``out_dir/results.json`` (a failure record on error).

    Args:
        raise_errors: re-raise a failure after recording it (single runs); sweeps go on to the next run.
    """
    out_dir, config, version = Path(out_dir), OmegaConf.to_container(cfg, resolve=True), code_version()
    done = completed_record(out_dir, config, cfg.get("resume", True), version)
    if done is not None:
        print(f"[kvcompress] skipped {out_dir}: results.json is ok for this config (resume=false reruns)")
        return done
    record, error, start = {"status": "running", "config": config, "code_version": version}, None, time.time()
    record["process"] = running_process()  # lets a sweep's end tell a live run elsewhere from a killed one
    record["command"] = command_line(overrides=_hydra_overrides())
    write_json_atomic(out_dir / RESULTS_FILE, record)  # a killed run leaves status=running: redone on resume
    try:
        record["metrics"] = _execute(cfg, record, out_dir)
        record["status"] = "ok"
    except Exception as err:
        error = err
        record.update(status="failed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
        if getattr(err, "step", None) is not None:  # NonFiniteError: where NaN/Inf appeared
            record["failed_step"] = err.step
    finally:
        record["wall_s"] = time.time() - start
        del record["process"]  # only a running record names its process
        write_json_atomic(out_dir / RESULTS_FILE, record)
    make_logger(cfg.get("logger")).log_run(record, out_dir)
    if error is not None and raise_errors:
        raise error
    if error is not None:
        print(f"[kvcompress] run failed ({out_dir}): {record['error']}", file=sys.stderr)
    if not _in_multirun():
        print(markdown_table([flatten(record)]))
    return record

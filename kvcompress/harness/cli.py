"""Console entry point ``kvcompress`` (``python -m kvcompress``): a Hydra app over ``kvcompress/conf``."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import kvcompress.harness.cli_help  # noqa: F401  (the kvc_help resolver of hydra.help.template)
import kvcompress.harness.hydra_groups  # noqa: F401  (the declared/ groups the primary config composes)
from kvcompress.core.conf_path import conf_dirs
from kvcompress.core.registry import CONF_DIR as REGISTRY_DIR
from kvcompress.harness import compare, extras
from kvcompress.harness.sweep import run_dirname

CONF_DIR = str(REGISTRY_DIR)  # the Hydra tree is the registry's folder, inside the package
OmegaConf.register_new_resolver("kvc_dirname", run_dirname, replace=True)  # used by hydra.sweep.subdir


def cuda_gpus() -> int:
    """1 where this machine has a CUDA GPU, else 0: the GPUs a Ray job asks for (conf/hydra/launcher/ray)."""
    import torch

    return int(torch.cuda.is_available())


OmegaConf.register_new_resolver("kvc_cuda_gpus", cuda_gpus, replace=True)
# conf/hydra/launcher/ray.yaml presets the Ray plugin's own config of that name, on purpose: Hydra 1.3 still
# validates it against the plugin's schema and says so on every run
warnings.filterwarnings("ignore", message=r"(?s).*'hydra/launcher/ray' is validated against ConfigStore")


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    from kvcompress.harness.app import run_experiment

    hydra_cfg = HydraConfig.get()
    out_dir, single = Path(hydra_cfg.runtime.output_dir), hydra_cfg.mode != RunMode.MULTIRUN
    # In a sweep a failed run is recorded and the sweep goes on; the end-of-sweep callback reports it.
    try:
        record = run_experiment(cfg, out_dir, raise_errors=single)
    except (ValueError, ImportError) as err:  # a bad input: its message names the field and what is allowed
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"Error: {err}\n(record: {out_dir}; HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(1) from None
    if single:
        print(f"[kvcompress] output folder: {out_dir}")
    return objectives(record, cfg.get("objectives"))


def objectives(record: dict, names) -> list[float] | None:
    """The metrics ``names`` of a finished run, in order: what a sweeper that optimises (``sweep=frontier``,
    Optuna) reads back from each job. None without names; a failed run, or a metric it lacks, raises (the
    sweeper records a failed trial)."""
    if not names:
        return None
    if record.get("status") != "ok":
        raise RuntimeError(f"objectives: the run did not finish ok ({record.get('error')})")
    metrics = record.get("metrics") or {}
    numbers = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    missing = [name for name in names if name not in numbers]
    if missing:
        raise ValueError(
            f"objectives={list(names)}: the run recorded no number for {missing}; it has {numbers}"
        )
    return [float(metrics[name]) for name in names]


SUBCOMMANDS = {"bench": "task=bench", "compare": "task=compare"}


def main() -> None:
    """``kvcompress [bench|compare] [overrides...]``: a subcommand is shorthand for its task override;
    ``kvcompress ask ...`` answers questions on a context file (``harness.ask``, its own options);
    ``kvcompress compare RUN_A RUN_B`` compares two finished runs (``harness.compare``);
    ``kvcompress check-policy NAME`` runs the contract checks on a policy (``harness.check_policy``)."""
    command, rest = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else (None, [])
    if command == "ask":
        from kvcompress.harness.ask import main as ask

        ask(rest)
        return
    if command == "check-policy":
        from kvcompress.harness.check_policy import main as check_policy

        sys.exit(check_policy(rest))
    if command == "compare" and compare.wants_runs(rest):
        sys.exit(compare.main(rest))
    if command in SUBCOMMANDS:
        sys.argv[1] = SUBCOMMANDS[command]
    try:  # a launcher, sweeper or logger of a missing extra: refused before Hydra starts, naming the extra
        extras.require(sys.argv[1:], conf_dirs())
    except extras.MissingExtraError as err:
        sys.exit(f"kvcompress: {err}")
    _main()

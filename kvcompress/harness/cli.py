"""Console entry point ``kvcompress`` (also ``python -m kvcompress``): a Hydra app over ``conf/``."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from kvcompress.harness.sweep import run_dirname

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
OmegaConf.register_new_resolver("kvc_dirname", run_dirname, replace=True)  # used by hydra.sweep.subdir


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    from kvcompress.harness.app import run_experiment

    hydra_cfg = HydraConfig.get()
    # In a sweep a failed run is recorded and the sweep goes on; the end-of-sweep callback reports it.
    run_experiment(cfg, Path(hydra_cfg.runtime.output_dir), raise_errors=hydra_cfg.mode != RunMode.MULTIRUN)


SUBCOMMANDS = {"bench": "task=bench", "compare": "task=compare"}


def main() -> None:
    """``kvcompress [bench|compare] [overrides...]``: a subcommand is shorthand for its task override;
    ``kvcompress ask ...`` answers questions on a context file (``harness.ask``, its own options)."""
    if len(sys.argv) > 1 and sys.argv[1] == "ask":
        from kvcompress.harness.ask import main as ask

        ask(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] in SUBCOMMANDS:
        sys.argv[1] = SUBCOMMANDS[sys.argv[1]]
    _main()

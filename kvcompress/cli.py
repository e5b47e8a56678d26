"""Console entry point ``kvcompress`` (also ``python -m kvcompress``): a Hydra app over ``conf/``."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    from kvcompress.app import run_experiment

    run_experiment(cfg, Path(HydraConfig.get().runtime.output_dir))


SUBCOMMANDS = {"bench": "task=bench"}


def main() -> None:
    """``kvcompress [bench] [overrides...]``: a subcommand is shorthand for its task override."""
    if len(sys.argv) > 1 and sys.argv[1] in SUBCOMMANDS:
        sys.argv[1] = SUBCOMMANDS[sys.argv[1]]
    _main()

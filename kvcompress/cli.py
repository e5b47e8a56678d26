"""Console entry point ``kvcompress`` (also ``python -m kvcompress``): a Hydra app over ``conf/``."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    from kvcompress.app import run_experiment

    run_experiment(cfg, Path(HydraConfig.get().runtime.output_dir))


def main() -> None:
    _main()

"""Every Hydra config composes; sweep, experiment and launcher configs say what they sweep and where."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import kvcompress.harness.cli  # noqa: F401  (registers the kvc_dirname resolver)
from kvcompress.harness.cli import CONF_DIR
from kvcompress.harness.loggers import Logger, make_logger
from kvcompress.harness.sweep import run_dirname

CONF = Path(CONF_DIR)
POLICIES = {p.stem for p in (CONF / "policy").glob("*.yaml")}


def _compose(*overrides, hydra_cfg=True):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra_cfg)


def _needs_missing_policy(path: Path) -> str | None:
    for line in path.read_text().splitlines():
        if "override /policy:" in line and line.split(":")[-1].strip() not in POLICIES:
            return line.split(":")[-1].strip()
    return None


# the sweeps whose records are committed, and where (the rest write to multirun/<sweep_name>)
COMMITTED = {
    "leaderboard": "experiments/leaderboard/runs",
    "frontier_duo": "experiments/frontier/runs/duo_after",
    "frontier_kvzip": "experiments/frontier/runs/kvzip_prompt",
    "leaderboard_4k": "experiments/leaderboard/runs_4k",
}


@pytest.mark.parametrize("group", ["sweep", "experiment"])
def test_sweep_and_experiment_configs_compose_as_named_multiruns(group):
    """The package's sweeps and the checkout's own experiments (``./conf/experiment``, found from the
    checkout's root with no flag) compose as named multiruns."""
    from kvcompress.core.conf_path import conf_dirs

    paths = sorted(path for root in conf_dirs() for path in (root / group).glob("*.yaml"))
    assert paths, f"no {group}/*.yaml in {conf_dirs()}"
    for path in paths:
        missing = _needs_missing_policy(path)
        if missing:  # e.g. quant_bits before the quant policy is merged
            continue
        cfg = _compose(f"{group}={path.stem}")
        assert cfg.hydra.mode.name == "MULTIRUN" and cfg.hydra.sweeper.params, path.name
        runs = COMMITTED.get(cfg.sweep_name, f"multirun/{cfg.sweep_name}")
        assert (
            cfg.sweep_name and cfg.hydra.sweep.dir == f"{Path.cwd()}/{runs}"
        )  # absolute: jobs start anywhere


def test_quant_bits_sweeps_bits_8_4_2_of_the_quant_policy():
    text = (CONF / "sweep" / "quant_bits.yaml").read_text()
    cfg = OmegaConf.create(text)
    assert cfg.hydra.sweeper.params["policy.bits"] == "8,4,2" and cfg.sweep_name == "quant_bits"
    assert "override /policy: quant" in text


@pytest.mark.parametrize("logger", sorted(p.stem for p in (CONF / "logger").glob("*.yaml")))
def test_logger_configs_instantiate(logger, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = _compose(f"logger={logger}", hydra_cfg=False)
    made = make_logger(cfg.logger)
    assert isinstance(made, Logger) and cfg.logger.name == logger
    if logger == "wandb":
        assert made.settings["mode"] == "offline"  # no account needed unless WANDB_MODE=online


def test_slurm_launcher_preset_and_joblib_compose():
    slurm = _compose("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "sweep_name=s").hydra.launcher
    assert slurm._target_.endswith("SlurmLauncher") and slurm.partition == "gpu"
    assert slurm.gpus_per_node == 1 and slurm.timeout_min == 240
    assert slurm.submitit_folder == f"{Path.cwd()}/multirun/s/.submitit/%j"
    joblib = _compose("hydra/launcher=joblib", "hydra.launcher.n_jobs=2").hydra.launcher
    assert joblib._target_.endswith("JoblibLauncher") and joblib.n_jobs == 2


def test_lm_eval_task_config_composes():
    cfg = _compose("task=lm_eval", "task.tasks=[kvc_niah]", hydra_cfg=False)
    assert cfg.task._target_ == "kvcompress.eval.hydra_task.run" and list(cfg.task.tasks) == ["kvc_niah"]
    assert cfg.task.chunk_size == 1


def test_run_dirname_is_safe_and_bounded():
    assert run_dirname("model.name=/a/b,policy=full") == "model.name=_a_b,policy=full"
    assert run_dirname("") == "default"
    long = run_dirname("x=" + "y" * 300)
    assert len(long) == 120 and long != run_dirname("x=" + "y" * 299)


@pytest.mark.parametrize("group", ["policy", "storage"])
def test_every_method_is_named_by_its_registry_name(group):
    """Errors, records and tables name a method by its YAML's file name (plugins' too), never by its class."""
    from kvcompress.core.cache import known_policies, known_storages, make_policy
    from kvcompress.core.registry import make_storage

    names = known_policies() if group == "policy" else known_storages()
    make = make_policy if group == "policy" else make_storage
    assert {"policy": "vnorm", "storage": "fp8"}[group] in names  # tests/plugins' own is registered too
    assert {n: make(n).name for n in names} == {n: n for n in names}


@pytest.mark.parametrize("group", ["policy", "storage"])
def test_hydra_composes_every_declared_field_under_the_yaml(group):
    """``policy=<name>`` composes every field its class declares, at the YAML's value or the dataclass
    default: the registry's config (``registry.load``), as when each YAML listed them all."""
    from kvcompress.core import registry

    for name in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        cfg = _compose(*(["policy=full"] if group == "storage" else []), f"{group}={name}", hydra_cfg=False)
        assert OmegaConf.to_container(cfg[group]) == registry.load(group, name), name
    assert "storage" not in _compose(hydra_cfg=False)  # no storage chosen: none composed


def test_any_declared_field_overrides_whether_its_yaml_lists_it_or_not():
    overrides = ["policy=snapkv", "policy.kernel_size=7", "storage=quant", "storage.bits=2"]  # none in a YAML
    cfg = _compose(*overrides, hydra_cfg=False)
    assert cfg.policy.kernel_size == 7 and cfg.storage.bits == 2 and cfg.storage.recent == 128
    assert _compose("point=kvzip_r75_int4", "policy.apply_to=all", hydra_cfg=False).policy.apply_to == "all"
    with pytest.raises(Exception, match=r"policy.nope"):  # Hydra refuses a key the class does not declare
        _compose("policy=snapkv", "policy.nope=1", hydra_cfg=False)


def test_a_plugin_policy_composes_whole_where_the_search_path_reaches_its_yaml():
    """vnorm's YAML is ``_target_`` and ``recent``: through ``hydra.searchpath`` it composes with every field
    it inherits, and those override like its own."""
    from conftest import PLUGINS

    plugin = f"hydra.searchpath=[file://{PLUGINS / 'conf'}]"
    cfg = _compose(plugin, "policy=vnorm", "policy.unit=chunk", hydra_cfg=False).policy
    assert cfg._target_ == "example_selector.VnormPolicy" and cfg.recent == 1 and cfg.unit == "chunk"
    assert cfg.budget is None and cfg.compression_ratio is None and cfg.apply_to == "full_attention"


def test_a_policy_class_no_yaml_names_is_refused_by_name():
    from dataclasses import dataclass

    from kvcompress.core.policy import Policy

    @dataclass
    class Unregistered(Policy):
        pass

    with pytest.raises(ValueError, match="Unregistered has no registry name: add conf/policy/<name>.yaml"):
        Unregistered()


@pytest.mark.integration
def test_every_leaderboard_point_builds_a_cache_on_the_embedded_model(real_model):
    """Each conf/point file composes, and its policy over its storage builds on the embedded default: a
    point a policy refuses (a decode-time evictor over per-channel key groups) would otherwise fail only
    once a sweep reaches it."""
    from kvcompress import build_cache
    from kvcompress.harness.app import run_policy

    for path in sorted((CONF / "point").glob("*.yaml")):
        cfg = OmegaConf.to_container(_compose(f"point={path.stem}", hydra_cfg=False), resolve=True)
        policy = run_policy(cfg)
        if hasattr(policy, "fit_tokens"):  # kvzap, duo: a small fit (the point's own takes minutes on a CPU)
            small = {"fit_documents": 2, "fit_tokens": 32, "fit_holdout": 1, "fit_steps": 2}
            fields = {f.name for f in dataclasses.fields(policy)}
            policy = dataclasses.replace(policy, **{k: v for k, v in small.items() if k in fields})
        cache = build_cache(policy, real_model[0])  # raises, naming the policy, where it cannot serve
        assert len(cache.layers) == real_model[0].config.num_hidden_layers, path.stem
        if cfg.get("storage"):
            assert policy.storage.bits == cfg["storage"]["bits"], path.stem

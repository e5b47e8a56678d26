"""The built wheel installs and works away from the checkout: a clean venv gets the wheel and nothing of the
editable install (the checkout venv's packages join through a ``.pth`` path line, which runs none of that
folder's own ``.pth`` files, so the editable kvcompress finder stays out), and from a folder outside the
checkout it knows every registered policy and builds each one on a tiny random Llama, runs the ``kvcompress``
console script for a 64-token run on a tiny local model, registers the lm-eval model and compiles a C++
kernel from the installed sources. It also runs the README's command-line block (each command shrunk to a tiny
local model), a plugin selector through the command line (``KVCOMPRESS_CONF_PATH`` alone, then
``kvcompress check-policy``) and a sweep run twice, whose second run reuses every record."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from helpers import fake_essay, readme_commands

from kvcompress.core.registry import CONF_DIR

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

CHECK = textwrap.dedent(
    """
    import dataclasses, json, sys, sysconfig
    import torch
    import kvcompress
    from kvcompress.selectors import SchedulePolicy
    from transformers import LlamaConfig, LlamaForCausalLM

    def small(policy):  # each class's TEST_PARAMS (low_rank: random calibration text) on a tiny model
        if isinstance(policy, SchedulePolicy):
            rules = [{**r, "policy": small(r["policy"])} if "policy" in r else r for r in policy.rules]
            return SchedulePolicy(default=policy.default and small(policy.default), rules=rules)
        return dataclasses.replace(policy, **type(policy).TEST_PARAMS)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 24))
    held = {}
    for name in kvcompress.known_policies():
        cache = kvcompress.build_cache(small(kvcompress.make_policy(name)), model)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)  # a prefill: no decode kernel is needed
        held[name] = cache.memory_bytes()

    import kvcompress.eval.adapter  # registers --model kvcompress with lm-eval
    from lm_eval.api.registry import get_model

    print(json.dumps({
        "kvcompress": kvcompress.__file__, "site": sysconfig.get_paths()["purelib"], "held": held,
        "lm_eval_model": sys.modules[get_model("kvcompress").__module__].__file__,
    }))
    """
)
KERNEL = (
    "import json; from kvcompress import kernels; m = kernels.load('latent_values', 'portable'); "
    "print(json.dumps({'module': m and m.__file__, 'why': kernels.why('latent_values', 'portable')}))"
)


def _run(cmd, env, cwd, timeout=300) -> str:
    done = subprocess.run(
        list(map(str, cmd)), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _wheel(tmp: Path) -> Path:
    """The wheel of a copy of the package (building in the checkout would leave ``build/`` there)."""
    src = tmp / "src"
    shutil.copytree(ROOT / "kvcompress", src / "kvcompress", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    _run([*pip, "-w", tmp / "dist", src], os.environ.copy(), tmp)
    (wheel,) = (tmp / "dist").glob("kvcompress-*.whl")
    return wheel


def _venv(tmp: Path, wheel: Path) -> tuple[Path, dict]:
    """A venv holding the wheel, and the environment to run it in; the checkout venv's site-packages is added
    as a plain path line (its own ``__editable__`` .pth and finder are never run)."""
    venv, env = tmp / "venv", os.environ.copy()
    _run([sys.executable, "-m", "venv", "--without-pip", venv], env, tmp)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
         env, tmp)  # fmt: skip
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env, tmp))
    (Path(str(site).strip()) / "checkout_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "KVCOMPRESS_CONF_PATH")}
    return venv, env | {"HF_HUB_OFFLINE": "1", "PYTHONNOUSERSITE": "1"}


def _check_policies_and_lm_eval(venv: Path, env: dict, work: Path) -> Path:
    """Every registered policy (the package's own list) built and run by the installed package; its
    site-packages folder."""
    (work / "check.py").write_text(CHECK)
    found = json.loads(_run([venv / "bin" / "python", "check.py"], env, work).strip().splitlines()[-1])
    site = Path(found["site"]).resolve()
    installed = Path(found["kvcompress"]).resolve()
    assert installed.is_relative_to(site) and site.is_relative_to(venv.resolve())
    assert not installed.is_relative_to(ROOT)
    assert sorted(found["held"]) == sorted(p.stem for p in (CONF_DIR / "policy").glob("*.yaml"))
    assert all(held > 0 for held in found["held"].values())
    assert Path(found["lm_eval_model"]).resolve().is_relative_to(site)
    return site


def _check_cli(venv: Path, env: dict, work: Path, checkpoint: Path) -> None:
    """The console script runs 64 tokens on a tiny local model and records the whole config."""
    (work / "essay.txt").write_text(fake_essay(0))
    task = ["task.max_tokens=64", "task.slices=1", "task.speed=false", "task.progress=false"]
    cli = [venv / "bin" / "kvcompress", "model=hf", f"model.name={checkpoint}", "policy=sliding_window",
           "policy.window=28", *task, "task.text=essay.txt", "hydra.run.dir=run"]  # fmt: skip
    _run(cli, env, work)
    record = json.loads((work / "run" / "results.json").read_text())
    assert record["status"] == "ok" and record["metrics"]["perplexity"] > 1
    assert record["config"]["policy"] == {  # window: a field its YAML does not list
        "_target_": "kvcompress.selectors.SlidingWindowPolicy",
        "sink_tokens": 4, "window": 28, "apply_to": "full_attention",
    }  # fmt: skip


def _shrunk(command: list[str], checkpoint: Path) -> list[str]:
    """A README command with overrides that run it on the tiny local model in seconds."""
    if len(command) > 1 and command[1] == "compare":
        return command
    model = ["model=hf", f"model.name={checkpoint}", "task.text=essay.txt", "task.progress=false"]
    # the tiny model's heads have 16 dimensions: quant's default groups of 32 cannot divide them
    if "storage=quant" in command:
        model.append("storage.group_size=16")
    if "sweep=quant_bits" in command:
        model.append("policy.group_size=16")
    if "task=niah" in command:
        sizes = ["task.lengths=[96]", "task.depths=[50]", "task.extra_needles=[]", "task.max_new_tokens=4"]
        return [*command, *model, *sizes, "task.chat_template=false"]
    return [*command, *model, "task.max_tokens=64", "task.slices=1", "task.speed=false"]


def _check_readme_commands(venv: Path, env: dict, work: Path, checkpoint: Path) -> None:
    """Every command of the README's command-line block, from the installed console script."""
    said = {}
    for command in readme_commands():
        said[" ".join(command[:3])] = _run([venv / "bin" / command[0], *_shrunk(command, checkpoint)[1:]],
                                           env, work)  # fmt: skip
    for run in ("A", "B"):
        assert json.loads((work / "outputs" / run / "results.json").read_text())["status"] == "ok"
    (compared,) = [out for name, out in said.items() if "compare" in name]
    assert "perplexity" in compared and ("distinguishable" in compared or "differ" in compared), compared
    assert len(list((work / "multirun").rglob("results.json"))) == 3  # the quant_bits sweep: 8, 4, 2 bits


def _check_plugin(venv: Path, env: dict, work: Path, checkpoint: Path) -> None:
    """The docs' example selector, outside the package, through the command line: ``KVCOMPRESS_CONF_PATH``
    (relative to the working folder) is all the command line needs, and ``check-policy`` passes it."""
    shutil.copytree(
        ROOT / "tests" / "plugins", work / "plugins", ignore=shutil.ignore_patterns("__pycache__")
    )
    plug = env | {"KVCOMPRESS_CONF_PATH": "plugins/conf", "PYTHONPATH": str(work / "plugins")}
    task = ["task.max_tokens=64", "task.slices=1", "task.speed=false", "task.progress=false"]
    cli = [venv / "bin" / "kvcompress", "model=hf", f"model.name={checkpoint}", "policy=vnorm",
           "policy.compression_ratio=0.5", *task, "task.text=essay.txt", "hydra.run.dir=vnorm"]  # fmt: skip
    _run(cli, plug, work)
    record = json.loads((work / "vnorm" / "results.json").read_text())
    assert (
        record["status"] == "ok" and record["config"]["policy"]["_target_"] == "example_selector.VnormPolicy"
    )
    checked = _run([venv / "bin" / "kvcompress", "check-policy", "vnorm"], plug, work)
    passed = re.search(r"^(\d+) of (\d+) passed$", checked, flags=re.M)
    assert passed and passed[1] == passed[2] and int(passed[1]) >= 7 and "FAIL" not in checked, checked


def _check_resume(venv: Path, env: dict, work: Path, checkpoint: Path) -> None:
    """A sweep from the installed package, run twice: the second run reuses both records (the package's
    version and the hash of its files stand for the git commit it does not have)."""
    task = ["task.max_tokens=64", "task.slices=1", "task.speed=false", "task.progress=false"]
    cli = [venv / "bin" / "kvcompress", "-m", "model=hf", f"model.name={checkpoint}", "policy=sliding_window",
           "policy.window=20,28", *task, "task.text=essay.txt", "hydra.sweep.dir=resumed"]  # fmt: skip
    _run(cli, env, work)
    records = sorted((work / "resumed").rglob("results.json"))
    first = [r.read_bytes() for r in records]
    assert len(records) == 2 and json.loads(first[0])["code_version"].get("files_hash")
    again = _run(cli, env, work)
    assert "running it again" not in again, again
    assert [r.read_bytes() for r in records] == first


def test_the_wheel_installs_into_a_clean_venv_and_runs_from_outside_the_checkout(tmp_path, tiny_checkpoint):
    venv, env = _venv(tmp_path, _wheel(tmp_path))
    work = tmp_path / "elsewhere"  # no kvcompress/ beside the scripts: only the installed one can import
    work.mkdir()
    extensions = tmp_path / "extensions"  # a fresh kernel build, never one the checkout's tests left
    build_env, pipe = env | {"TORCH_EXTENSIONS_DIR": str(extensions)}, subprocess.PIPE
    kernel = subprocess.Popen(
        [venv / "bin" / "python", "-c", KERNEL], env=build_env, cwd=work, stdout=pipe, stderr=pipe, text=True
    )  # fmt: skip  (it compiles while the rest runs)
    try:
        site = _check_policies_and_lm_eval(venv, env, work)
        _check_cli(venv, env, work, tiny_checkpoint)
        _check_readme_commands(venv, env, work, tiny_checkpoint)
        _check_plugin(venv, env, work, tiny_checkpoint)
        _check_resume(venv, env, work, tiny_checkpoint)
        out, err = kernel.communicate(timeout=300)
        assert kernel.returncode == 0, err[-3000:]
        built = json.loads(out.strip().splitlines()[-1])
        assert built["module"] and built["why"] is None, built
        ninja = next(extensions.glob("kvc_latent_values_portable_*/build.ninja")).read_text()
        assert str(site / "kvcompress" / "kernels" / "latent_values.cpp") in ninja  # the installed source
    finally:
        if kernel.poll() is None:
            kernel.kill()

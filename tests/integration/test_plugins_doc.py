"""docs/extending.md shows the plugins of ``tests/plugins`` as they are: every code line of its storage
example is a line of ``example_storage.py``, its YAML is the plugin's YAML, and its KeyDiff selector example
is ``example_keydiff.py`` character for character, registered by a YAML of its ``_target_`` alone."""

from __future__ import annotations

import re
from pathlib import Path

from kvcompress.core.cache import make_policy

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "tests" / "plugins"


def _code(line: str) -> str:
    return line.split("  #")[0].strip()


def _blocks(section: str, lang: str) -> list[str]:
    text = (ROOT / "docs" / "extending.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", body, flags=re.S)


def test_the_storage_example_is_the_plugin_code():
    (block,) = _blocks("A storage", "python")
    source = {_code(line) for line in (PLUGINS / "example_storage.py").read_text().splitlines()}
    missing = [line for line in map(_code, block.splitlines()) if line and line not in source]
    assert not missing, f"docs/extending.md shows lines example_storage.py does not have: {missing}"


def test_the_storage_yaml_is_the_plugin_yaml():
    (block,) = _blocks("A storage", "yaml")
    shown = [line for line in block.splitlines() if not line.startswith("#")]
    real = [line for line in (PLUGINS / "conf" / "storage" / "fp8.yaml").read_text().splitlines()]
    assert shown == [line for line in real if not line.startswith("#")]


def test_the_keydiff_example_is_the_plugin_code():
    (block,) = [b for b in _blocks("A selector", "python") if "class KeyDiffLayer" in b]
    source = (PLUGINS / "example_keydiff.py").read_text()
    assert block == source.split("from __future__ import annotations\n\n", 1)[1], (
        "docs/extending.md's KeyDiff example differs from tests/plugins/example_keydiff.py (below __future__)"
    )


def test_the_keydiff_yaml_is_its_target_alone():
    from example_keydiff import KeyDiffPolicy

    real = (PLUGINS / "conf" / "policy" / "keydiff_example.yaml").read_text().splitlines()
    assert [line for line in real if not line.startswith("#")] == ["_target_: example_keydiff.KeyDiffPolicy"]
    assert make_policy("keydiff_example") == KeyDiffPolicy()  # every field at the dataclass's default

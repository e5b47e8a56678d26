"""Materialise the offline lm-eval tasks: their data (built once from the essays) and their YAMLs.

The YAMLs ship in ``kvcompress/eval/lm_tasks`` with a ``{kvc_data}`` placeholder; ``task_dir()`` writes
them with the absolute data folder into the asset cache, so lm-eval's ``dataset_path: json`` finds the
data wherever the cache lives. Pass ``task_dir()`` as lm-eval's ``include_path``.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvcompress.resources.assets import cache_dir
from kvcompress.resources.files import write_text_atomic

SOURCE_DIR = Path(__file__).resolve().parent / "lm_tasks"
DATA_VERSION = 2  # 2: documents carry the essays' character span they read
OFFLINE_TASKS = ("kvc_essays_ppl", "kvc_niah")


def _builders():
    from kvcompress.eval.docs import essay_documents, niah_documents

    return {"kvc_essays_ppl": essay_documents, "kvc_niah": niah_documents}


def _build_data(data_dir: Path) -> None:
    for name, build in _builders().items():
        path = data_dir / f"{name}.jsonl"
        if not path.exists():
            write_text_atomic(path, "".join(json.dumps(doc) + "\n" for doc in build()))


def task_dir() -> Path:
    """Folder holding the offline task YAMLs and their data (built on first use, then reused)."""
    root = cache_dir() / "lm_eval_tasks"
    data_dir = root / f"data-v{DATA_VERSION}"
    _build_data(data_dir)
    for src in sorted(SOURCE_DIR.iterdir()):
        if src.suffix not in (".yaml", ".py"):
            continue
        text = src.read_text(encoding="utf-8")
        if src.suffix == ".yaml":
            text = text.replace("{kvc_data}", str(data_dir))
        dest = root / src.name
        if not dest.exists() or dest.read_text(encoding="utf-8") != text:
            write_text_atomic(dest, text)
    return root


def task_manager(tasks=None, include_path=None):
    """An lm-eval ``TaskManager`` that knows the offline tasks; skips indexing lm-eval's own ~15k task
    configs (about 15 s) when every requested task is one of ours."""
    from lm_eval.tasks import TaskManager

    paths = [str(task_dir())] + ([] if include_path is None else [str(include_path)])
    ours_only = tasks is not None and all(t in OFFLINE_TASKS for t in tasks)
    return TaskManager(include_path=paths, include_defaults=not ours_only)

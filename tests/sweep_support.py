"""A stand-in task for sweep tests (``task._target_=sweep_support.run``): logs each call to
``$KVC_TEST_LOG`` and, once, blocks forever on the point named by ``$KVC_TEST_BLOCK`` so a test can
kill the sweep in the middle of a run.

``python -m sweep_support <overrides>`` is kvcompress's command line with the code version of every record
pinned to ``$KVC_TEST_CODE_VERSION`` (JSON): a sweep and its restart then compare equal versions even when
kvcompress/ is edited or committed between them (a version computed from git would differ, and the restart
would rightly rerun every ok record).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def run(model, tokenizer, policy, cfg) -> dict:
    point = f"{policy.name}-{cfg.point}"
    with Path(os.environ["KVC_TEST_LOG"]).open("a") as f:
        f.write(point + "\n")
    sentinel = Path(os.environ["KVC_TEST_LOG"] + ".blocked")
    if point == os.environ.get("KVC_TEST_BLOCK") and not sentinel.exists():
        sentinel.touch()
        time.sleep(600)  # killed here by the test
    if cfg.get("fail"):
        raise ValueError(f"task.fail={cfg.fail}: asked to fail")
    return {"perplexity": 10.0 + cfg.point, "cache_bytes": 1000 * cfg.point, "tokens_scored": 8}


def main() -> None:
    pinned = os.environ.get("KVC_TEST_CODE_VERSION")
    if pinned:
        from kvcompress.harness import app

        version = json.loads(pinned)
        app.code_version = lambda: version
    from kvcompress.harness.cli import main as kvcompress_main

    kvcompress_main()


if __name__ == "__main__":
    main()

"""``kvcompress-lm-eval``: lm-eval's own command line with ``--model kvcompress`` and the offline tasks.

lm-eval has no plugin entry points, so this thin wrapper imports the adapter (which registers the model)
and adds the offline tasks' folder to ``--include_path`` (after any folder given), then runs lm-eval::

    kvcompress-lm-eval run --model kvcompress --tasks kvc_niah --limit 10 \\
        --model_args pretrained=smollm2-135m,policy=sliding_window,window=124,chunk_size=1
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    import kvcompress.eval.adapter  # noqa: F401  (registers --model kvcompress)
    from kvcompress.eval.taskdata import task_dir

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    setup_logging()
    parser = HarnessCLI()
    args = parser.parse_args()
    if hasattr(args, "include_path"):
        given = [] if args.include_path is None else args.include_path.split(":")
        args.include_path = [*given, str(task_dir())]
    parser.execute(args)


if __name__ == "__main__":
    main()

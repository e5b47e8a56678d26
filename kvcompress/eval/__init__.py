"""lm-evaluation-harness integration: the ``kvcompress`` model adapter and offline tasks.

``import kvcompress.eval.adapter`` registers ``--model kvcompress`` (it imports lm-eval, so it is not
imported here); ``task_dir()`` builds the offline tasks ``kvc_essays_ppl`` and ``kvc_niah`` once.
"""

from kvcompress.eval.taskdata import OFFLINE_TASKS, task_dir, task_manager

__all__ = ["OFFLINE_TASKS", "task_dir", "task_manager"]

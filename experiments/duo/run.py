"""DuoAttention's head calibration on the embedded model: the paper's gates and the attention mass.

Fits (or loads) ``duo``'s ranking at its defaults (``kvcompress.selectors.duo_fit``) and records how the two
criteria agree (Spearman's rho over the model's KV heads, and the share of the gates' chosen heads the mass
also chooses at retrieval shares 0.25 and 0.5), the distillation loss before and after the gates' steps, the
fit's seconds, and the bytes of ``duo`` at each leaderboard retrieval share on a 1024-token prompt.
Usage: ``python experiments/duo/run.py OUT.json``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from kvcompress import build_cache, make_policy
from kvcompress.harness.results import environment
from kvcompress.resources.files import write_text_atomic
from kvcompress.resources.models import load_model

SHARES = (0.1, 0.25, 0.5)


@torch.inference_mode()
def bytes_at(model, share: float, criterion: str, ids: torch.Tensor) -> float:
    """``duo``'s bytes over ``full``'s after a prefill of ``ids``."""
    held = {}
    for name, params in (("full", {}), ("duo", {"retrieval_ratio": share, "criterion": criterion})):
        cache = build_cache(make_policy(name, **params), model)
        model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        held[name] = cache.memory_bytes()
    return held["duo"] / held["full"]


def main(out: str) -> None:
    model, tokenizer = load_model("smollm2-135m")
    policy = make_policy("duo")
    policy.prepare(model)  # fits at the defaults, or loads the saved ranking
    from kvcompress.selectors import duo_fit

    found = duo_fit.ranking(model, policy.fit_text, policy.fit_documents, policy.fit_tokens, policy.fit_steps,
                            policy.sink_tokens, policy.window, policy.fit_dir)  # fmt: skip
    ids = torch.randint(2, 1000, (1, 1024), generator=torch.Generator().manual_seed(0))
    rows = []
    for share in SHARES:
        gates, mass = duo_fit.top_heads(found["gates"], share), duo_fit.top_heads(found["mass"], share)
        rows.append({
            "retrieval_share": share, "retrieval_heads": int(gates.sum()),
            "bytes_vs_full_1024": round(bytes_at(model, share, "gates", ids), 4),
            "mass_chooses_of_gates": round(float((gates & mass).sum() / gates.sum().clamp_min(1)), 3),
            "layers_without_retrieval": int((gates.sum(-1) == 0).sum()),
        })  # fmt: skip
    record = {
        "status": "ok", "policy": policy.describe(), "rows": rows,
        "metrics": {"spearman_gates_mass": round(found["agreement"]["spearman"], 4),
                    "fit_seconds": round(found["seconds"], 1), "distill_first": found["distill_first"],
                    "distill_last": round(found["distill_last"], 5)},
        "gates": found["gates"].tolist(), "mass": found["mass"].tolist(), "range": found["range"],
        "environment": environment(model),
        "command": "python experiments/duo/run.py experiments/duo/runs/main/results.json",
    }  # fmt: skip
    write_text_atomic(Path(out), json.dumps(record, indent=1))
    print(json.dumps({"rows": rows, **record["metrics"]}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])

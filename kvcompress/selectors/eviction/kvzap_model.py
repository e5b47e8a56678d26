"""KVzap's surrogates: per layer, a map from the attention's input hidden state to each KV head's log-score.

Jegou et al., "KVzap" (arXiv 2601.07891), and its training script (kvpress ``kvzap/train.py``): a linear model
fitted by ridge regression (scikit-learn's ``Ridge()``: alpha 1, a free intercept) and a two-layer MLP
(``hidden -> 512 -> GELU -> H_kv``) trained with AdamW (lr 5e-3, batch 512, 15 epochs, cosine schedule,
gradient norm clipped at 1, mean squared error over every layer and head at once). Parameters are plain
tensors stacked over layers, so a fitted surrogate is saved and loaded with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

MODEL_TYPES = ("linear", "mlp")
RIDGE_ALPHA = 1.0
MLP = {"hidden": 512, "lr": 5e-3, "batch": 512, "epochs": 15, "clip": 1.0}


def predict(params: dict, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """Predicted log-scores (B, H_kv, T) float32 of layer ``layer`` from its attention's input
    (B, T, hidden)."""
    x = hidden.float()
    get = lambda name: params[name][layer].to(x.device)  # noqa: E731
    if params["kind"] == "linear":
        out = x @ get("w") + get("b")  # (B, T, H_kv)
    else:
        out = F.gelu(x @ get("w1") + get("b1")) @ get("w2") + get("b2")
    return out.transpose(1, 2)


def predict_all(params: dict, x: torch.Tensor) -> torch.Tensor:
    """Predictions (L, N, H_kv) for features (L, N, hidden) of every layer."""
    return torch.stack([predict(params, i, x[i][None])[0].t() for i in range(x.shape[0])])


def fit_linear(x: torch.Tensor, y: torch.Tensor) -> dict:
    """Ridge regression per layer (float64): features (L, N, F), targets (L, N, H_kv)."""
    x, y = x.double(), y.double()
    mx, my = x.mean(1, keepdim=True), y.mean(1, keepdim=True)
    xc, yc = x - mx, y - my
    gram = xc.transpose(1, 2) @ xc + RIDGE_ALPHA * torch.eye(x.shape[-1], dtype=x.dtype)  # (L, F, F)
    w = torch.linalg.solve(gram, xc.transpose(1, 2) @ yc)  # (L, F, H_kv)
    b = (my - mx @ w)[:, 0]  # (L, H_kv)
    return {"kind": "linear", "w": w.float(), "b": b.float()}


def _uniform(gen, shape, fan_in: int) -> torch.Tensor:
    """``nn.Linear``'s initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1 / math.sqrt(fan_in)
    return (torch.rand(shape, generator=gen) * 2 - 1) * bound


def fit_mlp(x: torch.Tensor, y: torch.Tensor, seed: int = 0, **overrides) -> dict:
    """Train the two-layer MLP of every layer at once (features (L, N, F), targets (L, N, H_kv));
    ``overrides`` change ``MLP``'s settings (tests train a small one)."""
    cfg = {**MLP, **overrides}
    gen = torch.Generator().manual_seed(seed)
    (n_layers, _, f), h_kv, hid = x.shape, y.shape[-1], cfg["hidden"]
    with torch.inference_mode(False), torch.enable_grad():  # build_cache may run under inference mode
        params = {
            "w1": _uniform(gen, (n_layers, f, hid), f),
            "b1": _uniform(gen, (n_layers, hid), f),
            "w2": _uniform(gen, (n_layers, hid, h_kv), hid),
            "b2": _uniform(gen, (n_layers, h_kv), hid),
        }
        _train(x.float().clone(), y.float().clone(), params, cfg, gen)
    return {"kind": "mlp", **{k: v.detach() for k, v in params.items()}}


def _train(x: torch.Tensor, y: torch.Tensor, params: dict, cfg: dict, gen) -> None:
    """AdamW over ``params`` (stacked over layers, in place), mean squared error of every layer and head."""
    n = x.shape[1]
    tensors = [p.requires_grad_() for p in params.values()]
    steps = math.ceil(n / cfg["batch"])
    opt = torch.optim.AdamW(tensors, lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["epochs"])
    for _ in range(cfg["epochs"]):
        order = torch.randperm(n, generator=gen)
        for s in range(steps):
            idx = order[s * cfg["batch"] : (s + 1) * cfg["batch"]]
            hidden = F.gelu(torch.baddbmm(params["b1"][:, None], x[:, idx], params["w1"]))
            out = torch.baddbmm(params["b2"][:, None], hidden, params["w2"])  # (L, b, H_kv)
            loss = F.mse_loss(out, y[:, idx])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(tensors, cfg["clip"])
            opt.step()
        sched.step()

"""Where each decoder layer of a model runs: one device, or one per layer when accelerate's ``device_map``
shards the model (each cache layer then lives on its layer's device, DESIGN.md "Scale").

Read from the attention modules' ``layer_idx`` (transformers sets it on each), the hooks accelerate's
dispatch leaves on the blocks (``_hf_hook.execution_device``), and where the weights are.
"""

from __future__ import annotations

import torch


def layer_devices(model, num_layers: int) -> list[torch.device]:
    """Where each decoder layer's keys arrive: the execution device accelerate's ``device_map`` hooks give
    its attention module (or the nearest block above it), else the device of its weights; ``model.device``
    where neither says (a family whose attention modules carry no ``layer_idx``)."""
    modules, found = dict(model.named_modules()), {}
    for name, module in modules.items():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and idx not in found:
            found[idx] = _execution_device(modules, name)
    return [found.get(i) or model.device for i in range(num_layers)]


def _execution_device(modules: dict, name: str) -> torch.device | None:
    parts = name.split(".")
    for k in range(len(parts), -1, -1):  # the module itself, then each block above it
        hook = getattr(modules.get(".".join(parts[:k])), "_hf_hook", None)
        for h in getattr(hook, "hooks", [hook]):  # a SequentialHook holds several
            device = getattr(h, "execution_device", None)
            if device is not None:
                return torch.device(device)
    weight = next((p for p in modules[name].parameters() if p.device.type != "meta"), None)
    return None if weight is None else weight.device

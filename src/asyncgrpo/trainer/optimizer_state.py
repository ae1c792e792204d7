"""Adam's state made while the first groups are generated, not inside the first optimizer step.

Why: torch's Adam and AdamW create their state (two zero tensors per parameter) inside the first ``step()``, and
on a CPU the first writes into that fresh memory fault its pages in. In the demo on 2 CPU cores the first AdamW
step took 7.6-13 s (the second 0.15-0.2 s; profiled: ``zeros_like`` 1.9 s, the first fused update 5.7 s), all of
it inside step 1, while the trainer had just started the rollout worker and had nothing to do but wait for its
first groups. :func:`materialize_state` does that work then: one step at learning rate 0 on zero gradients, after
which the state is put back to exactly what a first step starts from (zeros, step 0), so the run's first real step
computes what it would have computed. On a GPU it costs milliseconds and saves as much.

Only ``torch.optim.Adam`` and ``AdamW`` themselves (the Trainer's ``adamw_torch``/``adamw_torch_fused``), with a
float learning rate, an empty state (not a resumed run) and no gradients held; anything else is left alone.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)

ADAM_TYPES = (torch.optim.Adam, torch.optim.AdamW)


def materialize_state(optimizer: Any) -> bool:
    """Create ``optimizer``'s state now, equal to the state its first step starts from; True when it did."""
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps torch's
    if type(opt) not in ADAM_TYPES or len(opt.state) > 0:
        return False
    params = [p for group in opt.param_groups for p in group["params"] if p.requires_grad]
    lrs = [group["lr"] for group in opt.param_groups]
    if not params or any(p.grad is not None for p in params) or not all(type(lr) in (float, int) for lr in lrs):
        return False
    t0 = time.perf_counter()
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in opt.param_groups:
            group["lr"] = 0.0  # AdamW's decay (1 - lr * wd) and the update (lr * ...) are exact no-ops
        opt.step()
    finally:
        for group, lr in zip(opt.param_groups, lrs):
            group["lr"] = lr
        for p in params:
            p.grad = None
    with torch.no_grad():
        for state in opt.state.values():  # Adam with weight decay saw nonzero gradients: back to a fresh state
            for key, value in state.items():
                if torch.is_tensor(value):
                    value.zero_()
                elif key == "step":
                    state[key] = type(value)(0)
    logger.debug("optimizer state made ahead of the first step in %.2f s", time.perf_counter() - t0)
    return True

"""trainer/optimizer_state.py: Adam's state made ahead equals a fresh first step's, exactly."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncgrpo.trainer.optimizer_state import materialize_state


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """One real step on fixed data (a loss of the model's output, its gradients, the optimizer's update)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw_foreach_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True, amsgrad=True),
    "adam_weight_decay": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),  # decay enters the gradient
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_steps_after_the_state_made_ahead_equal_those_of_a_fresh_optimizer(name):
    ahead, fresh = _model(), _model()
    before = copy.deepcopy(ahead.state_dict())
    opt_ahead, opt_fresh = OPTIMIZERS[name](list(ahead.parameters())), OPTIMIZERS[name](list(fresh.parameters()))
    assert materialize_state(opt_ahead) is True
    for k, v in ahead.state_dict().items():  # the step at learning rate 0 moved nothing
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in ahead.parameters())
    assert opt_ahead.param_groups[0]["lr"] == 1e-2
    for seed in (1, 2, 3):
        _step(ahead, opt_ahead, seed)
        _step(fresh, opt_fresh, seed)
    for (k, a), b in zip(ahead.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    sa, sf = opt_ahead.state_dict()["state"], opt_fresh.state_dict()["state"]
    for i in sf:
        for key in sf[i]:
            assert torch.equal(torch.as_tensor(sa[i][key]), torch.as_tensor(sf[i][key])), (i, key)


def test_other_optimizers_a_resumed_state_and_held_gradients_are_left_alone():
    model = _model()
    assert materialize_state(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)) is False
    resumed = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, resumed, 0)
    state = copy.deepcopy(resumed.state_dict())
    assert materialize_state(resumed) is False  # a resumed run's state is its own
    assert torch.equal(resumed.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    held = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert materialize_state(held) is False and not held.state  # gradients from the step above are still held


def test_an_optimizer_prepared_by_accelerate_is_reached():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    model = _model()
    try:
        wrapped = Accelerator(cpu=True).prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
        assert wrapped is not wrapped.optimizer  # the Trainer's optimizer is accelerate's wrapper around torch's
        assert materialize_state(wrapped) is True
        assert len(wrapped.optimizer.state) == len(list(model.parameters()))
    finally:
        AcceleratorState._reset_state(True)

"""One training row through ``AsyncGRPOTrainer.step_forward_backward``, with gradients that mean something.

``warmup_rows`` (the compile warm-up's dummy rows) carry old log-probs of -1, far from a random model's (about
-log(vocab)): the importance-sampling correction then drops every token and every gradient is zero, so two steps
"agree" whatever their kernels do. :func:`on_policy_warmup_row` gives such a row the model's own log-probs (ratios
of 1), and :func:`step_grads` refuses all-zero gradients.
"""

from __future__ import annotations

import torch

from asyncgrpo.packing import build_plan, packed_hidden_states
from asyncgrpo.packing.row import PackedRow
from asyncgrpo.trainer.logprobs import selective_logprobs
from asyncgrpo.trainer.warmup import warmup_rows


def on_policy_warmup_row(trainer, token_budget: int, max_completion_length: int, top_n: int = 8) -> PackedRow:
    """The first warm-up row for ``trainer``'s model (CUDA), its old log-probs the model's own under bf16 autocast."""
    model = trainer.model
    head = model.get_output_embeddings().weight
    row = warmup_rows(token_budget, 4, max_completion_length, head.shape[0], top_n=top_n)[0]
    on_gpu = row.to(head.device)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        hidden = packed_hidden_states(model, on_gpu, build_plan(on_gpu, "flex"))
        lp = selective_logprobs(hidden[on_gpu.pred_index], head, on_gpu.target_ids).logprobs
    row.old_logprobs = lp.float().to(row.old_logprobs.device)
    return row


def step_grads(trainer, row: PackedRow) -> dict[str, torch.Tensor]:
    """The parameter gradients of one trainer step on ``row`` (bf16 autocast); every parameter must get one."""
    trainer.model.zero_grad(set_to_none=True)
    trainer.step_forward_backward(trainer.model, row, float(row.num_trained), keep_metrics=False,
                                  autocast_forward=True)  # fmt: skip
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    assert grads and min(float(g.norm()) for g in grads.values()) > 0, "a step with zero gradients checks nothing"
    return grads


def worst_relative_diff(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The largest ``|g - ref| / |ref|`` (norms) over the parameters; both sides must cover the same ones."""
    assert grads.keys() == ref.keys()
    return max(float((g - ref[n]).norm() / ref[n].norm().clamp(min=1e-12)) for n, g in grads.items())

"""CUDA graphs of the step (``cuda_graph_step``) against the eager step on the same rows: the loss and every
parameter gradient, with the decoder layers compiled as the trainer compiles them, in fp32 and under bf16 autocast,
with activation checkpointing on (the graphs capture without it), replayed in both orders of two rows of different
buckets and accumulated over two rows.

Run: ``pytest -s -q -m gpu tests/gpu/test_graphed_step_gpu.py`` (one GPU, about a minute).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from asyncgrpo.packing.attention import build_plan, packed_hidden_states, use_tree_attention
from asyncgrpo.packing.row import pack_samples
from asyncgrpo.trainer.compile import compile_decoder_layers, uncompile_decoder_layers
from asyncgrpo.trainer.graphed_step import GraphedDecoder, graph_buckets
from asyncgrpo.trainer.packed_loss import PolicyLossSettings, packed_policy_loss
from tests.gpu.test_packing_gpu import _model, _samples
from tests.gpu.test_step_gpu import _with_top_n
from tests.helpers.trainer_steps import on_policy_warmup_row, step_grads, worst_relative_diff

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _loss(hidden, weight, row):
    return packed_policy_loss(hidden[row.pred_index], weight, row, row.num_trained, PolicyLossSettings()).loss


def _eager(model, rows, amp):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for row in rows:
        with torch.autocast("cuda", dtype=amp) if amp else contextlib.nullcontext():
            loss = _loss(packed_hidden_states(model, row, build_plan(row, "flex")), model.lm_head.weight, row)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _graphed(model, graphs, rows):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for row in rows:
        fwd = graphs.forward(row)
        loss = _loss(fwd.hidden, fwd.head_weight, row) + fwd.anchor
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "arch,amp,checkpointing,tol",
    [("qwen3", None, False, 1e-4), ("llama", torch.bfloat16, False, 2e-2), ("qwen3", torch.bfloat16, True, 2e-2)],
)
def test_graphed_step_matches_the_eager_step(arch, amp, checkpointing, tol):
    model = _model(arch, torch.float32).train()
    use_tree_attention(model)
    short = pack_samples(_with_top_n(_samples(0)[:3])).to("cuda")  # the tricky tries alone: a small bucket
    long = pack_samples(_with_top_n(_samples(1))).to("cuda")
    budget = long.num_tokens + 5
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch._dynamo.reset()
    compile_decoder_layers(model)
    try:
        graphs = GraphedDecoder(model, budget, amp)
        graphs.capture_all(verify_row=long)
        assert graphs.failed is None, graphs.failed
        assert graphs.verified and sorted(graphs.buckets) == graph_buckets(budget)
        sizes = [next(s for s in graphs.sizes if s >= r.num_tokens) for r in (short, long)]
        assert sizes[0] < sizes[1]  # two buckets, each replayed after the other
        for rows in ([short], [long], [short], [long, short]):  # the last: gradients accumulated over two rows
            ref_loss, ref_grads = _eager(model, rows, amp)
            loss, grads = _graphed(model, graphs, rows)
            worst = worst_relative_diff(grads, ref_grads)
            print(f"\n{arch} amp={amp} checkpointing={checkpointing} rows={[r.num_tokens for r in rows]}: "
                  f"loss {loss:.6f} vs {ref_loss:.6f}, worst relative grad diff {worst:.2e}")  # fmt: skip
            assert abs(loss - ref_loss) <= tol * max(1.0, abs(ref_loss))
            assert worst <= tol
    finally:
        uncompile_decoder_layers(model)


def test_a_replaced_parameter_is_refused():
    model = _model("llama", torch.float32).train()
    use_tree_attention(model)
    row = pack_samples(_samples(0)[:3]).to("cuda")
    graphs = GraphedDecoder(model, row.num_tokens, None)
    graphs.capture_all()
    assert graphs.failed is None, graphs.failed
    layer = model.model.layers[0].mlp.up_proj
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone())  # a new tensor: the graph reads the old one
    with pytest.raises(RuntimeError, match="cuda_graph_step=False"):
        graphs.forward(row)


def test_a_check_row_of_a_bucket_not_captured_yet_keeps_the_graphs_on():
    """capture_largest() checked on a row of a smaller bucket: that bucket is captured before the eager side runs
    (captured while the eager side's autograd graph was alive, it failed and turned the graphs off: the H100 run
    of 2026-12-05, max_completion_length 40). A model still in eval mode (the warm-up before train()) is captured
    in train mode, so the first real step neither recompiles the layers nor replays a graph without dropout."""
    from torch._dynamo.utils import guard_failures

    model = _model("llama", torch.float32).eval()
    use_tree_attention(model)
    short = pack_samples(_samples(0)[:3]).to("cuda")
    long = pack_samples(_samples(0)[:15]).to("cuda")  # the tricky tries and one GRPO group: 1,135 tokens
    torch._dynamo.reset()
    compile_decoder_layers(model)
    try:
        graphs = GraphedDecoder(model, 2048, None)  # buckets of 512/1024/1536/2048 tokens
        assert short.num_tokens <= 512 and 1024 < long.num_tokens <= 1536
        graphs.capture_largest(verify_row=short)
        assert graphs.failed is None and graphs.verified, graphs.failed
        assert sorted(graphs.buckets) == [512, 2048] and model.training
        _graphed(model, graphs, [long])  # a step as train() runs it: its bucket captured at first use
        assert graphs.failed is None and len(graphs.buckets) == 3, graphs.failed
        # the layers were not compiled again for train mode (the loss kernels compile here for the first time)
        failed = [str(f) for fails in guard_failures.values() for f in fails]
        assert not [f for f in failed if "training" in f], failed
    finally:
        uncompile_decoder_layers(model)


class _FrozenMaskGraphs(GraphedDecoder):
    """Captures a tree mask that replays never refresh (built from the pads present at capture time), as a capture
    that froze a host value would: only a check that replays a different row than the capture saw can see it."""

    def _decoder_out(self, ids, pos, end):
        if torch.cuda.is_current_stream_capturing():
            end = self.frozen.setdefault(end.numel(), torch.arange(1, end.numel() + 1, device=end.device))
        return super()._decoder_out(ids, pos, end)


def test_the_check_catches_a_graph_that_ignores_the_row():
    """The first capture's eager pass runs the check's row and is kept as the check's reference; the graphed side
    replays that row through the graph captured on pads. A graph whose mask was frozen at capture disagrees, and the
    graphs turn off (the step runs eager) instead of training on wrong gradients."""
    model = _model("llama", torch.float32).train()
    use_tree_attention(model)
    row = pack_samples(_samples(1)).to("cuda")
    torch._dynamo.reset()
    compile_decoder_layers(model)
    try:
        graphs = _FrozenMaskGraphs(model, row.num_tokens, None)
        graphs.frozen = {}
        graphs.capture_largest(verify_row=row)
        assert graphs.failed is not None and "disagrees" in graphs.failed, graphs.failed
        assert not graphs.buckets and not graphs.covers(row) and graphs._reference is None
        fair = GraphedDecoder(model, row.num_tokens, None)  # the same row, an honest capture: the check passes
        fair.capture_largest(verify_row=row)
        assert fair.failed is None and fair.verified, fair.failed
    finally:
        uncompile_decoder_layers(model)


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.mark.parametrize("budget,completion", [(512, 256), (1024, 40)])
def test_the_trainers_step_runs_graphed_and_matches_its_eager_step(tmp_path, budget, completion):
    """Through AsyncGRPOTrainer as a run uses it: on by default, captured by warm_up_compile() with gradient
    checkpointing on (the default), the accelerator's bf16 autocast; its gradients equal the eager step's. Short
    completions too (one group far below the budget: the warm-up rows pack several)."""
    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.assets import smollm2_tokenizer, tiny_model

    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], token_budget=budget, bf16=True,
                           max_completion_length=completion)  # fmt: skip
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}]
    trainer = AsyncGRPOTrainer(tiny_model("llama").cuda(), reward_funcs=[_reward], args=args, train_dataset=rows,
                               processing_class=smollm2_tokenizer())  # fmt: skip
    try:
        assert args.gradient_checkpointing and trainer.warm_up_compile() > 0
        graphs = trainer.graphed
        assert graphs is not None and graphs.failed is None and graphs.verified, getattr(graphs, "failed", None)
        assert graphs.autocast_dtype == torch.bfloat16 and sorted(graphs.buckets) == graph_buckets(budget)
        row = on_policy_warmup_row(trainer, budget, 40)
        graphed = step_grads(trainer, row)
        trainer.graphed = None  # the eager step
        eager = step_grads(trainer, row)
        worst = worst_relative_diff(graphed, eager)
        print(f"\ntrainer step, graphed vs eager (bf16 autocast): worst relative grad diff {worst:.2e}")
        assert worst <= 2e-2
    finally:
        if trainer.worker_ahead is not None:
            trainer.worker_ahead.stop()

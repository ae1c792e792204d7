"""The varlen tree's K/V gather (packing/path_gather.py): forward = ``index_select``, backward = each row's sum over
its copies, against autograd through ``index_select`` on a real row's paths; the Triton sum interpreted on CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from asyncgrpo.packing.attention import _varlen_plan
from asyncgrpo.packing.path_gather import path_gather, path_order
from asyncgrpo.packing.row import pack_samples
from tests.helpers.synthetic import random_tree_samples


def _plan():
    row = pack_samples(random_tree_samples(np.random.default_rng(4), vocab_size=64, num_groups=3))
    return row.num_tokens, _varlen_plan(row, torch.device("cpu"))


def test_order_and_offsets_list_each_rows_copies():
    index = torch.tensor([3, 0, 3, 1, 3, 0])
    order, offsets = path_order(index, num_tokens=5)
    assert offsets.tolist() == [0, 2, 3, 3, 6, 6]  # row 2 and row 4 are copied nowhere
    assert order.tolist() == [1, 5, 3, 0, 2, 4]  # stable: a row's copies in path order


@pytest.mark.parametrize("repeat", [1, 2, 3])
def test_gather_and_its_gradient_match_index_select_on_a_rows_paths(repeat):
    """``repeat`` widens each key head to the query heads sharing it, as ``repeat_interleave`` (GQA's order)."""
    num_tokens, plan = _plan()
    assert plan.kv_index.numel() > num_tokens  # shared prompts are gathered more than once
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, num_tokens, 5, generator=g).transpose(0, 1).requires_grad_()  # [T, H, D], strided as in use
    up = torch.randn(plan.kv_index.numel(), 3 * repeat, 5, generator=g)
    got = path_gather(x, plan.kv_index, plan.kv_order, plan.kv_offsets, repeat)
    (got * up).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    ref = x_ref.index_select(0, plan.kv_index).repeat_interleave(repeat, dim=1)
    (ref * up).sum().backward()
    assert torch.equal(got, ref)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-6)


def test_the_gather_compiles_without_graph_breaks():
    num_tokens, plan = _plan()
    x = torch.randn(num_tokens, 2, 4, requires_grad=True)
    gather = (plan.kv_index, plan.kv_order, plan.kv_offsets, 2)  # each head widened to two
    torch._dynamo.reset()
    step = torch.compile(lambda x: (path_gather(x, *gather) ** 2).sum(), backend="aot_eager", fullgraph=True)
    step(x).backward()
    assert torch.allclose(x.grad, torch.zeros_like(x).index_add_(0, plan.kv_index, 4 * x.detach()[plan.kv_index]))


CHILD = """
import sys, torch
from asyncgrpo.packing import path_gather_triton
d = torch.load(sys.argv[1] + "/in.pt")
out = {r: path_gather_triton.sum_copies(d["grad"], d["order"], d["offsets"], r) for r in (1, 2)}
out["gather"] = path_gather_triton.gather_widened(d["x"].transpose(0, 1), d["index"], 3)
torch.save(out, sys.argv[1] + "/out.pt")
"""


def test_the_triton_kernels_match_index_add_and_repeat_interleave(tmp_path):
    pytest.importorskip("triton")
    num_tokens, plan = _plan()
    grad = torch.randn(plan.kv_index.numel(), 6, 40).bfloat16()  # 240 values a row: a masked block
    x = torch.randn(3, num_tokens, 40).bfloat16()  # [H, T, D]: gathered as [T, H, D] through its strides
    inputs = {"grad": grad, "order": plan.kv_order, "offsets": plan.kv_offsets, "x": x, "index": plan.kv_index}
    torch.save(inputs, tmp_path / "in.pt")
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = torch.load(tmp_path / "out.pt")
    for repeat in (1, 2):  # 6 heads as they are, or 3 key heads each widened to 2 query heads
        per_head = grad.float().unflatten(1, (6 // repeat, repeat)).sum(2)
        want = torch.zeros(num_tokens, 6 // repeat, 40).index_add_(0, plan.kv_index, per_head)  # fp32, as the kernel
        assert got[repeat].dtype == torch.bfloat16 and got[repeat].shape == want.shape
        assert torch.allclose(got[repeat].float(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(got["gather"], x.transpose(0, 1)[plan.kv_index].repeat_interleave(3, dim=1))

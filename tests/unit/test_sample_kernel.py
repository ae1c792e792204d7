"""The one-pass sampling kernel (interpreted on CPU) against the torch sampler's rules.

Greedy rows: argmax; seeded rows: the same token as the torch race over
``hashed_exponential`` noise (the kernel recomputes that hash); all rows: the
processed log-prob of the chosen token and the log-sum-exp of logits / T.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CHILD = """
import sys, torch
from asyncgrpo.server import sample_kernel
d = torch.load(sys.argv[1] + "/in.pt")
tok, lp, lse = sample_kernel.fused_sample(d["logits"], d["temps"], d["meta"], d["rand"], block=128)
torch.save({"tok": tok, "lp": lp, "lse": lse}, sys.argv[1] + "/out.pt")
"""


def test_kernel_matches_the_torch_sampler(tmp_path):
    pytest.importorskip("triton")
    from asyncgrpo.server.sampler import _race, hashed_exponential

    g = torch.Generator().manual_seed(0)
    B, V = 6, 1000  # 8 column blocks of 128, the last one partial
    logits = torch.randn(B, V, generator=g) * 3
    logits[1, 517] = 40.0  # a clear greedy winner in a later block
    logits[4, :100] = float("-inf")  # masked tokens must never win the race
    temps = torch.tensor([1.0, 1.0, 0.7, 1.3, 1.0, 2.0])
    seeds, positions = [0, 0, 123, 2**40 + 5, 77, 9], [0, 0, 3, 11, 0, 250]
    modes = [0, 0, 2, 2, 2, 1]  # greedy, greedy, seeded x3, generator key
    meta = torch.tensor([[s & 0xFFFFFFFF for s in seeds], [(s >> 32) & 0xFFFFFFFF for s in seeds], positions, modes])
    rand = torch.tensor([0, 0, 0, 0, 0, 3_000_000_000])
    torch.save({"logits": logits, "temps": temps, "meta": meta, "rand": rand}, tmp_path / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")

    x = logits / temps[:, None]
    lse = torch.logsumexp(x, dim=1)
    assert torch.allclose(out["lse"], lse, atol=1e-4)
    assert out["tok"][:2].tolist() == x[:2].argmax(dim=1).tolist() == [x[0].argmax().item(), 517]
    seeded = [2, 3, 4]
    noise = hashed_exponential([seeds[i] for i in seeded], [positions[i] for i in seeded], V, torch.device("cpu"))
    assert out["tok"][seeded].tolist() == _race(x[seeded], noise).tolist()
    assert out["tok"][4] >= 100
    chosen = x.gather(1, out["tok"][:, None]).squeeze(1) - lse
    assert torch.allclose(out["lp"], chosen, atol=1e-4)
    assert 0 <= out["tok"][5] < V


SAMPLER_CHILD = """
import sys, torch
from asyncgrpo.server.request import SamplingParams
from asyncgrpo.server.sampler import Sampler, SamplerRow
logits = torch.load(sys.argv[1] + "/logits.pt")
params = [SamplingParams(max_tokens=4, temperature=0.0, logprobs=3),
          SamplingParams(max_tokens=4, temperature=0.8, seed=5, logprobs=2),
          SamplingParams(max_tokens=4, temperature=1.0, seed=6),
          SamplingParams(max_tokens=4, temperature=1.2, seed=2**33 + 1, logprobs=0)]
rows = [SamplerRow(params=p, num_output=k) for k, p in enumerate(params)]
out = {}
for fused in (True, False):
    s = Sampler(torch.device("cpu"), seed=0)
    s.use_kernel = fused
    r = s(logits, rows)
    out[fused] = (r.token_ids, r.logprobs, r.top_logprobs, r.masks)
torch.save(out, sys.argv[1] + "/out.pt")
"""


def test_sampler_fast_path_equals_the_torch_path(tmp_path):
    """The whole fast path (kernel, top-N, one packed copy) against the torch path on greedy and seeded rows."""
    pytest.importorskip("triton")
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1)) * 2
    torch.save(logits, tmp_path / "logits.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SAMPLER_CHILD, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    (tok, lp, top, masks), (tok_ref, lp_ref, top_ref, masks_ref) = out[True], out[False]
    assert tok == tok_ref and masks == masks_ref
    assert lp == pytest.approx(lp_ref, abs=1e-4)
    assert [None if t is None else [i for i, _ in t] for t in top] == [
        None if t is None else [i for i, _ in t] for t in top_ref
    ]
    assert top[2] is None and top[3] == [] and len(top[0]) == 3 and len(top[1]) == 2
    for t, ref in zip(top, top_ref):
        if t:
            assert [v for _, v in t] == pytest.approx([v for _, v in ref], abs=1e-4)

"""Engine outputs for the answer-path tests: finished sequences shaped like the engine's (``RequestOutput``)."""

from __future__ import annotations

import random

import numpy as np

from asyncgrpo.server.engine.request import RequestOutput


def engine_output(rng: random.Random, n_tokens: int, k: int, *, sampled_in_top: float = 0.5) -> RequestOutput:
    """A finished sequence whose sampled token is in its top-k about ``sampled_in_top`` of the time; its log-probs
    are arbitrary doubles (not float32 values), so the answer writers keep all 17 digits for them."""
    ids, lps, tops = [], [], []
    for _ in range(n_tokens):
        top = sorted(((rng.randrange(150_000), -rng.random() * 8) for _ in range(k)), key=lambda e: -e[1])
        if k and rng.random() < sampled_in_top:
            tok, lp = top[rng.randrange(k)]
        else:
            tok, lp = rng.randrange(150_000), (top[-1][1] if top else 0.0) - rng.random()
        ids.append(tok)
        lps.append(lp)
        tops.append(top)
    return RequestOutput("r", [1, 2, 3], ids, lps, "length", None, tops if k else [[] for _ in ids])


def float32_output(seed: int, n_tokens: int, k: int) -> RequestOutput:
    """Like the engine's: every log-prob a float32 value (some short ones: 0.0, -0.5, a denormal)."""
    out = engine_output(random.Random(seed), n_tokens, k)
    f32 = [float(np.float32(v)) for v in out.logprobs]
    f32[:3] = [0.0, -0.5, -float(np.float32(1e-45))]
    tops = [[(t, float(np.float32(v))) for t, v in top] for top in out.top_logprobs]
    return RequestOutput("r", [1, 2, 3], out.token_ids, f32, "length", None, tops)

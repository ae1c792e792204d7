"""CPU cost of one generated token on the answer path: server build + encode, client parse, worker conversion.

B5-HTTP spends its HTTP tail in interpreter work that grows with tokens × ``logprobs``: the server writes
every position's top-N as JSON, the client reads it back, and the rollout worker turns it into training
sequences that are pickled to the trainer. This script times each stage with the project's real code on
answers of the B5 shape (``--requests`` answers of ``--tokens`` tokens, top-``--logprobs``; the log-probs are
float32 values as the engine computes them, the sampled token in its top-N half of the time) and prints
microseconds per generated token:

- ``engine_finish``: the engine turning a finished sequence's flat top-N into the arrays it hands over;
- ``pipe_send`` / ``pipe_recv``: an output's trip from the engine process to the API process (``--engine-process``,
  auto on CUDA): the engine side's pickle (and packing, for pair lists), the API side's unpickle (later stages start from its result);
- ``pool_send``: what the server's event loop pays to hand an answer to a helper process (``--answer-workers``:
  packing and pickling the engine's outputs); ``pool_helper``: the helper's unpickle + build + encode;
- ``build``: ``completion_response`` (``/v1/completions``, the worker's endpoint) or ``generate_response``;
- ``encode``: ``encode_json`` of that body (bytes on the wire, also reported);
- ``parse``: the client's JSON decode (``json_codec.loads``) plus ``parse_*_choice``;
- ``worker``: ``rollout_to_sequences`` + ``TrainingSequence.validate`` + the pickle the sample queue pays.

    python bench/probes/answer_codec.py                  # b5 shape, both endpoints
    python bench/probes/answer_codec.py --json out.json  # also write the figures
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from asyncgrpo.client import results as client_results
from asyncgrpo.rollout.reconcile import rollout_to_sequences
from asyncgrpo.server.engine.request import RequestOutput
from asyncgrpo.server.http import answer_pool, wire_json
from asyncgrpo.server.http.protocol import (
    ParsedCompletion,
    ParsedRequest,
    completion_response,
    encode_json,
    generate_response,
)
from asyncgrpo.types import Rollout, TurnRecord

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.result_file
from bench.result_file import write_result

try:
    from asyncgrpo.server.engine.packed_top import packed_output
except ImportError:  # before the packed hand-off
    packed_output = None  # type: ignore[assignment]
try:
    from asyncgrpo.server.engine.packed_top import engine_top
except ImportError:  # before the engine kept top-N flat (it handed over pair lists)
    engine_top = None  # type: ignore[assignment]
try:
    from asyncgrpo import json_codec

    loads, LIBRARY = json_codec.loads, json_codec.LIBRARY
except ImportError:  # a checkout from before the fast answer path (for the "before" figures)
    loads, LIBRARY = json.loads, "json"

VOCAB = 151_936


def make_outputs(requests: int, tokens: int, k: int, seed: int = 0) -> list[RequestOutput]:
    """Finished sequences like the engine's: float32 log-probs, top-``k`` best first, sampled token in it ~50 %."""
    rng = np.random.default_rng(seed)
    outs = []
    for r in range(requests):
        top_lp = -np.sort(rng.exponential(2.0, size=(tokens, k)).astype(np.float32), axis=1)
        top_ids = rng.integers(2, VOCAB, size=(tokens, k))
        in_top = rng.random(tokens) < 0.5
        pick = rng.integers(0, k, size=tokens) if k else np.zeros(tokens, dtype=np.int64)
        ids = np.where(in_top, top_ids[np.arange(tokens), pick], rng.integers(2, VOCAB, size=tokens)) if k else (
            rng.integers(2, VOCAB, size=tokens))  # fmt: skip
        below = (top_lp[:, -1] if k else np.zeros(tokens, np.float32)) - rng.exponential(1.0, tokens).astype(np.float32)
        lps = np.where(in_top, top_lp[np.arange(tokens), pick], below) if k else below
        tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lp.astype(np.float64).tolist())]
        outs.append(RequestOutput(f"r{r}", [1, 2, 3], ids.tolist(), lps.astype(np.float32).astype(np.float64).tolist(),
                                  "length", None, tops))  # fmt: skip
    return outs


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.process_time()  # CPU seconds of this process: other processes on the machine do not count
        out = fn()
        best = min(best, time.process_time() - t0)
    return best, out


def measure(endpoint: str, outs: list[RequestOutput], k: int, repeats: int) -> dict[str, float]:
    """Best-of-``repeats`` CPU seconds of each stage over all answers, as microseconds per generated token."""
    if endpoint == "completions":
        parsed = ParsedCompletion("cmpl-1", "m", None, [1, 2, 3], [], k, return_token_ids=True,
                                  return_tokens_as_token_ids=True, return_weight_versions=True)  # fmt: skip

        def build_one(o: RequestOutput) -> Any:
            return completion_response(parsed, [o], lambda ids: "")

        parse_choice = client_results.parse_completion_choice
    else:
        parsed = ParsedRequest("gen-1", "m", None, [1, 2, 3], [], k)

        def build_one(o: RequestOutput) -> Any:
            return generate_response(parsed, [o])

        parse_choice = client_results.parse_generate_choice

    # The engine hands a finished output over with its top-N as it keeps them: flat lists packed at finish now
    # (engine_top, on the engine thread), pair lists before
    t_finish = 0.0
    if engine_top is not None:
        flat = [([i for row in o.top_logprobs for i, _ in row], [v for row in o.top_logprobs for _, v in row],
                 [len(row) for row in o.top_logprobs]) for o in outs]  # fmt: skip
        t_finish, tops = _timed(lambda: [engine_top(*f) for f in flat], repeats)
        outs = [dataclasses.replace(o, top_logprobs=t) for o, t in zip(outs, tops)]
    # --engine-process (auto on CUDA): each finished output crosses a pipe to the API process first
    ship = packed_output if packed_output is not None else (lambda o: o)
    t_pipe_send, piped = _timed(lambda: [pickle.dumps(("finish", ship(o)), protocol=5) for o in outs], repeats)
    t_pipe_recv, received = _timed(lambda: [pickle.loads(p)[1] for p in piped], repeats)
    outs = received
    t_build, bodies = _timed(lambda: [build_one(o) for o in outs], repeats)
    pack = getattr(answer_pool, "packed_outputs", lambda outputs: outputs)  # absent before the packed hand-off
    t_send, sent = _timed(lambda: [pickle.dumps(pack([o]), protocol=pickle.HIGHEST_PROTOCOL) for o in outs], repeats)

    def helper() -> list[bytes]:
        return [encode_json(build_one(pickle.loads(p)[0])) for p in sent]

    t_helper, _ = _timed(helper, repeats)
    t_encode, wire = _timed(lambda: [encode_json(b) for b in bodies], repeats)

    def parse() -> list[Any]:
        return [parse_choice(loads(w)["choices"][0], None) for w in wire]

    t_parse, results = _timed(parse, repeats)

    def worker() -> int:
        size = 0
        for res in results:
            turn = TurnRecord(prompt_ids=list(range(2, 130)), output_ids=res.token_ids,
                              output_log_probs=res.logprobs, output_sampler_logprobs=res.top_logprobs)  # fmt: skip
            seqs = rollout_to_sequences(Rollout(completion=[], completion_ids=res.token_ids, turns=[turn]),
                                        group_id=0, row_index=0, model_version=0, num_sampler_logprobs=k or None)  # fmt: skip
            for s in seqs:
                s.validate()
            size += len(pickle.dumps(seqs, protocol=pickle.HIGHEST_PROTOCOL))
        return size

    t_worker, pickled = _timed(worker, repeats)
    n = sum(len(o.token_ids) for o in outs)
    us = 1e6 / n
    return {
        "engine_finish_us_per_token": t_finish * us,
        "pipe_send_us_per_token": t_pipe_send * us,
        "pipe_recv_us_per_token": t_pipe_recv * us,
        "pool_send_us_per_token": t_send * us,
        "pool_helper_us_per_token": t_helper * us,
        "build_us_per_token": t_build * us,
        "encode_us_per_token": t_encode * us,
        "parse_us_per_token": t_parse * us,
        "worker_us_per_token": t_worker * us,
        "total_us_per_token": (t_build + t_encode + t_parse + t_worker) * us,  # inline build (no helpers)
        "wire_bytes_per_token": sum(map(len, wire)) / n,
        "pickled_bytes_per_token": pickled / n,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--logprobs", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--endpoints", default="completions,generate")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    opts = ap.parse_args()
    random.seed(0)
    outs = make_outputs(opts.requests, opts.tokens, opts.logprobs)
    report: dict[str, Any] = {
        "shape": {"requests": opts.requests, "tokens": opts.tokens, "logprobs": opts.logprobs},
        "json_library": LIBRARY,
        "wire_floats": getattr(wire_json, "FLOAT_STYLE", "17 significant digits"),
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
    }
    for endpoint in opts.endpoints.split(","):
        report[endpoint] = measure(endpoint, outs, opts.logprobs, opts.repeats)
        row = report[endpoint]
        stages = "  ".join(
            f"{k[: -len('_us_per_token')]}={v:.2f}" for k, v in row.items() if k.endswith("_us_per_token")
        )
        print(f"{endpoint:12s} {stages}  (us/token; wire {row['wire_bytes_per_token']:.0f} B/token)")
    if opts.json is not None:
        write_result(opts.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a short seeded rollout run produces, as one JSON file: every sampled token id and every metric event.

Run it on two checkouts and compare the files: a refactor of ``rollout/`` that keeps the worker's behaviour gives
the same sampled tokens, rewards, advantages and the same metrics (timings aside: their names and counts only).

    cd /work/main && PYTHONPATH=/work/main/src:/work/main python <this file> --out /tmp/fp_main.json
    cd <worktree> && PYTHONPATH=$PWD/src:$PWD python bench/rollout_fingerprint.py --out /tmp/fp_new.json
    python bench/rollout_fingerprint.py --compare /tmp/fp_main.json /tmp/fp_new.json

A real CPU server (the cached tiny Llama) answers a real worker process. Three scenarios: the default loop (a
group is one request for G choices), the same with one request per rollout and one rollout at a time (seeds taken
in request order, so the order must not depend on timing), and a filter that rejects every third prompt over two
epochs (rejected prompts, epochs, end of data).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

import numpy as np

# Metrics that measure time or load: their values vary from run to run and are not compared. The server poller's
# (rollout/vllm_*, concurrency_cap, generated_tokens_per_s) first reads 1 s into a run, so a scenario that ends
# sooner (a machine less loaded) has none of them: their presence is noted, not counted as a difference.
TIMED_SUFFIXES = ("_s", "_per_s", "_unix")
TIMED_NAMES = {"rollout/concurrency", "rollout/concurrency_cap", "rollout/score_queue_size", "rollout/vllm_retry_count"}
LOGPROB_ATOL = 1e-3
ROWS = [{"prompt": [{"role": "user", "content": f"Count to {i}."}], "answer": str(i)} for i in range(6)]


def _plain(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return _plain(x.tolist())
    if isinstance(x, float):
        return round(x, 6)
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _group(res: Any) -> dict[str, Any]:
    seqs = [{k: _plain(v) for k, v in dataclasses.asdict(s).items() if k != "rollout_id"} for s in res.sequences]
    return {"row_index": res.row_index, "epoch": res.epoch, "group_id": res.group_id, "dropped": res.dropped,
            "skipped": res.skipped, "tokens": res.tokens, "rewards": _plain(res.rewards),
            "sequences": seqs}  # fmt: skip


def _timed(name: str) -> bool:
    return name.endswith(TIMED_SUFFIXES) or name in TIMED_NAMES or name.startswith("rollout/vllm_")


def run_scenario(base_url: str, model_dir: str, name: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from asyncgrpo.rollout.sampling import SamplingSettings
    from asyncgrpo.rollout.settings import RolloutSettings
    from asyncgrpo.rollout.worker import RolloutWorker
    from bench.fingerprint_loops import EveryThirdRejected, PlainLoop
    from tests.helpers.rewards import even_token_reward

    sampling = SamplingSettings(base_url, max_model_len=512, max_completion_length=6, temperature=1.0,
                                num_sampler_logprobs=2)  # fmt: skip
    serial = name == "one_request_per_rollout"
    settings = RolloutSettings(model_name=None, sampling=sampling, num_generations=3, max_staleness=4, seed=7,
                               max_concurrent_rollouts=1 if serial else 8, initial_tokens_per_step=10**6,
                               num_epochs=2 if name == "filtered_two_epochs" else 1)  # fmt: skip
    cls = EveryThirdRejected if name == "filtered_two_epochs" else PlainLoop
    loop = cls(settings, ROWS, [even_token_reward], AutoTokenizer.from_pretrained(model_dir))
    loop.group_requests = not serial
    w = RolloutWorker(loop, heartbeat_timeout=120)
    w.start()
    groups = []
    try:
        while True:
            res = w.get_sample(timeout=120)
            if res.end:
                break
            groups.append(_group(res))
        w.check()
        metrics = w.drain_metrics()
    finally:
        w.stop()
    groups.sort(key=lambda g: (g["epoch"], g["row_index"]))
    values: dict[str, list[Any]] = {}
    for m_name, value, weight in metrics:
        values.setdefault(m_name, []).append(None if _timed(m_name) else [round(value, 6), round(weight, 6)])
    return {"groups": groups, "metrics": {k: sorted(v, key=repr) for k, v in sorted(values.items())}}


def record(out: str) -> None:
    from asyncgrpo.assets import tiny_model_dir
    from tests.helpers.servers import start_cpu_server

    model_dir = tiny_model_dir("llama")
    server = start_cpu_server(model_dir)
    try:
        result = {name: run_scenario(server.base_url, str(model_dir), name)
                  for name in ("group_request", "one_request_per_rollout", "filtered_two_epochs")}  # fmt: skip
    finally:
        server.stop()
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    for name, r in result.items():
        n_tokens = sum(len(s["input_ids"]) for g in r["groups"] for s in g["sequences"])
        print(f"{name}: {len(r['groups'])} groups, {n_tokens} sample tokens, {len(r['metrics'])} metric names")


def _close(a: Any, b: Any) -> bool:
    """Equal, floats within ``LOGPROB_ATOL``: the server batches concurrent groups differently from run to run,
    which moves log-probs in the last digits (two runs of one checkout differ so) but never a sampled token."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or abs(a - b) <= LOGPROB_ATOL
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b


def compare(a_path: str, b_path: str) -> int:
    with open(a_path) as fa, open(b_path) as fb:
        a, b = json.load(fa), json.load(fb)
    problems = []
    for name in sorted(set(a) | set(b)):
        ra, rb = a.get(name), b.get(name)
        if ra is None or rb is None:
            problems.append(f"{name}: only in one file")
            continue
        exact = [[{k: v for k, v in s.items() if "logprobs" not in k} for s in g["sequences"]] for g in ra["groups"]]
        if exact != [[{k: v for k, v in s.items() if "logprobs" not in k} for s in g["sequences"]]
                     for g in rb["groups"]]:  # fmt: skip
            problems.append(f"{name}: the sampled tokens, masks or advantages differ")
        if not _close(ra["groups"], rb["groups"]):
            problems.append(f"{name}: the groups differ (rewards, or log-probs beyond {LOGPROB_ATOL})")
        for m in sorted(set(ra["metrics"]) | set(rb["metrics"])):
            va, vb = ra["metrics"].get(m), rb["metrics"].get(m)
            if (va is None or vb is None) and _timed(m):  # the server poll's: its first reading comes 1 s in
                print(f"note: {name}: timing metric {m} only in {'the first' if vb is None else 'the second'} run")
            elif va is None or vb is None:
                problems.append(f"{name}: metric {m} only in {'the first' if vb is None else 'the second'}")
            elif not _timed(m) and va != vb:
                problems.append(f"{name}: metric {m} differs: {va[:6]} vs {vb[:6]}")
        print(f"{name}: {len(ra['groups'])} groups and {len(ra['metrics'])} metric names compared")
    for p in problems:
        print("DIFFERENT:", p)
    print("identical" if not problems else f"{len(problems)} differences")
    return 1 if problems else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    args = ap.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    record(args.out)

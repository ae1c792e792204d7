"""Step cadence of a generation-bound run without a model: the real worker, staleness admission and planner.

    python bench/probes/step_cadence.py --out bench/results/step_cadence_cpu.json --baseline-src /tmp/prev/src

Issue 41's GPU run (SmolLM2-135M shape, one GPU) trained a step in ~65 ms while a group of 8 x 40 tokens took
~200 ms to generate; every second or third step waited 60-130 ms for samples. This probe keeps everything of that
loop but the model: the real ``RolloutWorker`` (spawned process, default ``AsyncRolloutLoop``, G3 admission with
``max_staleness``), ``RolloutSource`` and ``TokenBudgetBatcher`` on the trainer's side, and a stub server that
answers each group request (``n`` = 8 distinct completions of ``--completion`` tokens) after ``--latency`` seconds,
however many run at once. A step "trains" for ``--busy`` seconds. Prompts are ``--prompt`` tokens, so a group
forwards prompt + 8 x (completion + 1) tokens and ``token_budget`` 1024 holds two groups, as on the GPU.

Per variant (``--baseline-src``: another checkout's ``src``, run first; then this checkout): every step's duration
and wait for samples, the median, the slowest step after step 2 over the median, steps per second.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from asyncgrpo.rollout.loop import AsyncRolloutLoop

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*
from bench.worker_cpu import _Stub as WorkerCpuStub

REPO = Path(__file__).resolve().parents[2]
G = 8


class _Stub(WorkerCpuStub):
    """``/v1/completions`` answered after ``latency`` seconds (requests overlap) with ``n`` random completions."""

    latency = 0.2

    def respond(self, head: str, body: bytes) -> None:
        if not head.split(" ")[1].startswith("/v1/completions"):
            super().respond(head, body)
        else:
            asyncio.get_running_loop().create_task(self._answer(orjson.loads(body)))

    async def _answer(self, req: dict) -> None:
        from asyncgrpo.server.http.wire_json import completion_logprobs_json

        await asyncio.sleep(self.latency)
        choices = []
        for i in range(req.get("n", 1)):
            toks = [random.randrange(2, 30_000) for _ in range(req["max_tokens"])]
            lps = [-random.random() for _ in toks]
            logprobs = completion_logprobs_json(toks, lps, [[(t, lp)] for t, lp in zip(toks, lps)])
            choices.append(b'{"index":%d,"text":"","logprobs":%s,"finish_reason":"length","stop_reason":null,'
                           b'"token_ids":%s,"prompt_token_ids":[]}' % (i, logprobs.encode(), orjson.dumps(toks)))  # fmt: skip
        self.write_completion(b",".join(choices))


def serve(port: int, latency: float) -> None:
    _Stub.latency = latency

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Stub, "127.0.0.1", port)
        print("ready", flush=True)
        await server.serve_forever()

    asyncio.run(main())


def reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Cheap and never tied across a group (random tokens)."""
    return [float(ids[-1] % 7) if ids else 0.0 for ids in completion_ids]


class Loop(AsyncRolloutLoop):
    """The default loop; prompt i renders to ``PROMPT_TOKENS`` ids of its own (no tokenizer here)."""

    def render_prompt(self, prompt: list[dict[str, Any]]) -> list[int]:
        n = int(os.environ.get("STEP_CADENCE_PROMPT", "60"))
        return [3 + 97 * int(prompt[0]["content"]) % 20_000 + j for j in range(n)]


class NoText:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def run_variant(a: argparse.Namespace, url: str) -> dict:
    """This process's ``asyncgrpo`` (PYTHONPATH) as the trainer: ``--steps`` steps of ``--busy`` seconds each."""
    from asyncgrpo.packing import TokenBudgetBatcher
    from asyncgrpo.rollout.sampling import SamplingSettings
    from asyncgrpo.rollout.settings import RolloutSettings
    from asyncgrpo.rollout.worker import RolloutWorker
    from asyncgrpo.trainer.rollout_source import RolloutSource

    budget = 1024
    sampling = SamplingSettings(base_url=url, max_model_len=4096, max_completion_length=a.completion, temperature=1.0,
                                kv_cache_tokens=None, has_metrics=False)  # fmt: skip
    settings = RolloutSettings(model_name="bench", sampling=sampling, num_generations=G, max_staleness=a.max_staleness,
                               seed=0, max_concurrent_rollouts=512, initial_tokens_per_step=budget, num_epochs=1,
                               answer_parse_processes=0)  # fmt: skip
    rows = [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(a.steps * 4 + 16)]
    worker = RolloutWorker(Loop(settings, rows, [reward], NoText()), heartbeat_timeout=120)
    worker.start(timeout=120)
    source = RolloutSource(worker, TokenBudgetBatcher(budget, 1, keep_groups=True), 1, a.max_staleness, len(rows),
                           sample_timeout=60.0)  # fmt: skip
    stamps, waits, groups = [time.perf_counter()], [], []
    try:
        for step in range(a.steps):
            micro = source.next_step(step)
            time.sleep(a.busy)  # the trainer's own work: forward, backward, optimizer, weight push
            source.step_done(micro)
            worker.set_policy_version(step + 1)
            worker.drain_metrics()
            stamps.append(time.perf_counter())
            waits.append(source.wait_s)
            groups.append(len({s.group_id for mb in micro for row in mb.rows for s in row.samples}))
    finally:
        worker.stop()
    steps = [b - a_ for a_, b in itertools.pairwise(stamps)]
    late = steps[2:]
    median = statistics.median(late)
    return {
        "step_s": [round(s, 4) for s in steps],
        "rollout_wait_s": [round(w, 4) for w in waits],
        "groups_per_step": groups,
        "step_s_median_after_2": median,
        "max_step_after_2_over_median": max(late) / median,
        "mean_wait_share_after_2": sum(w / s for w, s in zip(waits[2:], late)) / len(late),
        "steps_per_s_after_2": len(late) / sum(late),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--baseline-src", help="another checkout's src/, measured first")
    p.add_argument("--busy", type=float, default=0.065, help="seconds a step trains")
    p.add_argument("--latencies", default="0.2", help="seconds the stub takes to answer a group (comma list)")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--prompt", type=int, default=60)
    p.add_argument("--completion", type=int, default=40)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--port", type=int, default=18791)
    p.add_argument("--stub", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.stub:
        serve(a.port, float(a.latencies))
        return 0
    if a.child:
        print(json.dumps(run_variant(a, f"http://127.0.0.1:{a.port}")))
        return 0
    result: dict[str, Any] = {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv), "settings": {
        k: getattr(a, k) for k in ("busy", "max_staleness", "prompt", "completion", "steps")}, "runs": {}}  # fmt: skip
    for latency in (float(x) for x in a.latencies.split(",")):
        result["runs"][f"latency_{latency:g}"] = run_latency(a, latency)
    if a.out:
        sys.path.insert(0, str(REPO))
        from bench.result_file import write_result

        write_result(a.out, result)
    return 0


def run_latency(a: argparse.Namespace, latency: float) -> dict:
    """Both variants against one stub server answering after ``latency`` seconds."""
    port = a.port + int(latency * 1000)
    stub = subprocess.Popen([sys.executable, __file__, "--stub", "--port", str(port), "--latencies", str(latency)],
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO / "src")})  # fmt: skip
    out: dict[str, Any] = {"latency_s": latency}
    try:
        if stub.stdout is None or stub.stdout.readline().strip() != b"ready":
            raise RuntimeError("the stub server did not start")
        variants = ([("baseline", a.baseline_src)] if a.baseline_src else []) + [("current", str(REPO / "src"))]
        for tag, src in variants:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(REPO)]), "STEP_CADENCE_PROMPT": str(a.prompt)}
            args = [*_strip(sys.argv[1:]), "--port", str(port)]
            done = subprocess.run([sys.executable, __file__, "--child", *args], env=env, capture_output=True, text=True,
                                  timeout=600, check=False)  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"{tag} failed:\n{done.stderr[-3000:]}")
            r = {**json.loads(done.stdout.strip().splitlines()[-1]), "src": src}
            out[tag] = r
            print(f"latency {latency * 1e3:.0f} ms, {tag}: median step {r['step_s_median_after_2'] * 1e3:.0f} ms, "
                  f"slowest/median {r['max_step_after_2_over_median']:.2f}, wait share {r['mean_wait_share_after_2']:.0%}, "
                  f"{r['steps_per_s_after_2']:.2f} steps/s", flush=True)  # fmt: skip
    finally:
        stub.kill()
    return out


def _strip(args: list[str]) -> list[str]:
    """The command line less the parent's own options (the child measures; the parent writes)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in ("--out", "--baseline-src", "--port", "--latencies"):
            skip = True
            continue
        if arg.startswith(("--out=", "--baseline-src=", "--port=", "--latencies=")):
            continue
        out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())

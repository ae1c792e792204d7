"""The rollout worker's CPU cost per sample: a group as one request (n = G) against G single requests.

    python bench/worker_cpu.py --out bench/results/worker_cpu.json

The real ``RolloutWorker`` and default ``AsyncRolloutLoop`` run against a stub server that answers
``/v1/completions`` at once with canned vLLM-shaped bodies (top-8 log-probs, ``n`` choices), so the time
measured is the worker's own: building and sending requests, parsing answers, scoring and queueing samples.
Timed from the first scored group (G3 runs it alone) to the last; reported as microseconds per sample, the best
of ``--repeats`` runs per mode. A CPU machine is enough: no model runs.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.rollout_path
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.server.http.wire_json import completion_logprobs_json
from bench.result_file import write_result

G = 8


class _Stub(asyncio.Protocol):
    """HTTP/1.1 keep-alive; one canned completion per max_tokens, repeated for each of ``n`` choices."""

    cache: ClassVar[dict[int, bytes]] = {}  # shared by all connections

    def connection_made(self, transport: Any) -> None:
        self.transport, self.buf = transport, b""

    def _choice(self, n_tokens: int) -> bytes:
        if n_tokens not in self.cache:
            rng = random.Random(n_tokens)
            toks = [rng.randrange(1000) for _ in range(n_tokens)]
            top = [[(rng.randrange(1000), -rng.random()) for _ in range(8)] for _ in range(n_tokens)]
            lp = completion_logprobs_json(toks, [-rng.random() for _ in range(n_tokens)], top)
            self.cache[n_tokens] = (
                b'{"index":%d,"text":"","logprobs":' + lp.encode() + b',"finish_reason":"length","stop_reason":null,'
                b'"token_ids":' + orjson.dumps(toks) + b',"prompt_token_ids":[]}'
            )  # fmt: skip
        return self.cache[n_tokens]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end].decode("latin1")
            length = next((int(v) for k, _, v in (h.partition(":") for h in head.split("\r\n")[1:])
                           if k.lower() == "content-length"), 0)  # fmt: skip
            if len(self.buf) < end + 4 + length:
                return
            body, self.buf = self.buf[end + 4 : end + 4 + length], self.buf[end + 4 + length :]
            self.respond(head, body)

    def respond(self, head: str, body: bytes) -> None:
        """Answer one request (a subclass may answer later: bench/probes/step_cadence.py)."""
        if not head.split(" ")[1].startswith("/v1/completions"):
            self.transport.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
        else:
            req = orjson.loads(body)
            choice = self._choice(req["max_tokens"])
            choices = b",".join(choice % i for i in range(req.get("n", 1)))
            self.write_completion(choices)

    def write_completion(self, choices: bytes) -> None:
        out = b'{"id":"x","object":"text_completion","created":0,"model":"bench","choices":[' + choices + b"]}"
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                             % len(out) + out)  # fmt: skip


def _serve(port: int) -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Stub, "127.0.0.1", port)
        print("ready", flush=True)
        await server.serve_forever()

    asyncio.run(main())


class _NoText:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


class FixedPromptLoop(AsyncRolloutLoop):
    """The default loop; a prompt renders to 256 token ids (no tokenizer in this bench)."""

    def render_prompt(self, prompt: list[dict[str, Any]]) -> list[int]:
        return [int(prompt[0]["content"]) % 900 + 2] * 256


def _run(url: str, groups: int, out_len: int, group_requests: bool) -> float:
    """Seconds per sample after the first group, one worker run."""
    from asyncgrpo.rollout.sampling import SamplingSettings
    from asyncgrpo.rollout.settings import RolloutSettings
    from asyncgrpo.rollout.worker import RolloutWorker
    from bench.rollout_server import last_token_reward

    sampling = SamplingSettings(base_url=url, max_model_len=4096, max_completion_length=out_len, temperature=1.0,
                                num_sampler_logprobs=8, kv_cache_tokens=None, has_metrics=False)  # fmt: skip
    settings = RolloutSettings(model_name="bench", sampling=sampling, num_generations=G, max_staleness=1000, seed=0,
                               max_concurrent_rollouts=512, initial_tokens_per_step=10**12, num_epochs=1,
                               answer_parse_processes=0)  # fmt: skip
    rows = [{"prompt": [{"role": "user", "content": str(g)}]} for g in range(groups)]
    loop = FixedPromptLoop(settings, rows, [last_token_reward], _NoText())
    loop.group_requests = group_requests
    worker = RolloutWorker(loop, heartbeat_timeout=300)
    worker.start(timeout=120)
    n, t_first = 0, None
    try:
        while not worker.get_sample(timeout=120).end:
            worker.drain_metrics()
            n += 1
            t_first = t_first or time.perf_counter()
        seconds = time.perf_counter() - t_first
    finally:
        worker.stop()
    if n != groups:
        raise RuntimeError(f"{n}/{groups} groups came back")
    return seconds / ((groups - 1) * G)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--lengths", default="16,256", help="output tokens per sample, comma list")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=18779)
    ap.add_argument("--stub", action="store_true", help=argparse.SUPPRESS)  # internal: be the stub server
    opts = ap.parse_args()
    if opts.stub:
        _serve(opts.port)
        return 0
    stub = subprocess.Popen([sys.executable, __file__, "--stub", "--port", str(opts.port)], stdout=subprocess.PIPE)
    try:
        if stub.stdout is None or stub.stdout.readline().strip() != b"ready":
            raise RuntimeError("the stub server did not start")
        url = f"http://127.0.0.1:{opts.port}"
        result: dict[str, Any] = {"benchmark": "rollout worker CPU per sample", "G": G, "groups": opts.groups,
                                  "top_logprobs": 8, "python": platform.python_version(), "lengths": {}}  # fmt: skip
        for length in (int(x) for x in opts.lengths.split(",")):
            row = {}
            for mode, grouped in (("g_requests", False), ("one_request", True)):
                runs = [_run(url, opts.groups, length, grouped) * 1e6 for _ in range(opts.repeats)]
                row[mode] = {"us_per_sample_runs": runs, "us_per_sample": min(runs)}
            row["speedup"] = row["g_requests"]["us_per_sample"] / row["one_request"]["us_per_sample"]
            result["lengths"][str(length)] = row
            print(f"{length:>4} tokens: {row['g_requests']['us_per_sample']:.0f} us/sample as G requests, "
                  f"{row['one_request']['us_per_sample']:.0f} as one request ({row['speedup']:.2f}x)")  # fmt: skip
    finally:
        stub.kill()
    if opts.out:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        write_result(opts.out, result)
        print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

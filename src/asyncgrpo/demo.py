"""The README's main job: the embedded server on SmolLM2-135M-Instruct.

Until the trainer lands this is a generation smoke check: it fetches the offline
demo model, starts ``asyncgrpo serve`` on it as a child process, asks a few math
questions through the async client, and prints the answers with their sampler
log-probs and the server's live metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from rich.console import Console
from rich.table import Table

logger = logging.getLogger(__name__)

QUESTIONS = ("What is 12 + 30?", "What is 7 * 8?", "Is 91 a prime number?", "What is 100 - 37?")


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens generated per answer")
    parser.add_argument("--device", default="auto", help="device of the embedded server (auto|cpu|cuda)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server to start")


async def _ask(base_url: str, prompts: list[list[int]], max_tokens: int):
    from asyncgrpo.inference.client import AsyncServerClient

    async with AsyncServerClient(base_url) as client:
        params = {"max_tokens": max_tokens, "temperature": 0.7, "top_k": 50, "logprobs": 4}
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(client.generate(p, {**params, "seed": i}) for i, p in enumerate(prompts))
        )
        elapsed = time.perf_counter() - t0
        return results, elapsed, await client.metrics()


def run_demo(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from asyncgrpo.inference.server.launcher import launch_server
    from asyncgrpo.recipes import demo_model_dir

    console = Console()
    model_dir = demo_model_dir()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
    ]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    with launch_server(model_dir, extra_args=["--device", args.device], timeout=args.timeout) as server:
        results, elapsed, metrics = asyncio.run(_ask(server.base_url, prompts, args.max_tokens))
    table = Table(title=f"SmolLM2-135M-Instruct on the embedded server ({elapsed:.1f}s)")
    for col in ("question", "answer", "tokens", "mean logprob", "finish"):
        table.add_column(col)
    n_tokens = 0
    for q, r in zip(QUESTIONS, results):
        n_tokens += len(r.token_ids)
        mean_lp = sum(r.logprobs) / max(len(r.logprobs), 1)
        text = tok.decode(r.token_ids, skip_special_tokens=True).strip().replace("\n", " ")
        table.add_row(q, text, str(len(r.token_ids)), f"{mean_lp:.3f}", r.finish_reason)
    console.print(table)
    console.print(f"generated {n_tokens} tokens at {n_tokens / elapsed:.1f} tok/s; server metrics: {metrics}")
    return 0

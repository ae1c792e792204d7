"""A tiny Llama that really emits tool calls: a short supervised warm-up on CPU, checked, then cached.

The agent integration tests need tool calls written by a real model through the real server. A random-init
tiny Llama (real SmolLM2 tokenizer) is fine-tuned with ``assets.tool_warmup`` on transcripts of exactly the
prompts and tools the reference's agent examples (docs/spec.md) use (tests/helpers/agent_examples). Where the
tests need reward variance, a prompt has two continuations in the data, so sampling picks either.

Another CPU rounds the warm-up's floats differently and gets another model, so the model is never trusted
because it was trained: ``warm_up_checked`` trains until ``tool_model_check`` finds every transcript turn
reproduced (greedy, with a margin), or fails naming the turns it still gets wrong. The cache key covers the
data, the warm-up settings, torch, transformers and ``FIXTURE_VERSION``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from filelock import FileLock

from asyncgrpo.assets import cache_dir, smollm2_tokenizer, tiny_model
from asyncgrpo.assets.tool_warmup import Transcript, transcript_sequences
from asyncgrpo.rollout.agents import prepare_tool_template
from tests.helpers.agent_examples import doc_env_dict, doc_env_self, doc_tools
from tests.helpers.cached_model import publish
from tests.helpers.tool_model_check import MIN_MARGIN_NATS, transcript_mistakes, warm_up_until_reproduced

logger = logging.getLogger(__name__)

FIXTURE_VERSION = 2  # bump on any change to how the model is built or checked: older cached models are not reused
WARMUP_ROUNDS = ((120, 1e-2), (60, 3e-3), (60, 1e-3))  # (steps, learning rate): a step decay (a constant 1e-2
# plateaus with calls that are right on average but lose the user's numbers and names)
EXTRA_ROUND = (60, 3e-4)  # trained again while the check still finds a mistake, at most EXTRA_ROUNDS times
EXTRA_ROUNDS = 3
WARMUP_NEGATIVES = 4096
WARMUP_SEED = 0
SAMPLING_TEMPERATURE = 0.5  # sharpens the warmed-up model; a two-way choice stays two-way
REASONING_DROPPING_TEMPLATE = (  # ChatML that drops <think> blocks from all but the last assistant message
    "{%- for m in messages -%}{%- if m.role == 'assistant' and not loop.last and '</think>' in m.content -%}"
    "{{ '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip() + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
FORK_PROMPT = "Think, then multiply 5 by 5."
SLOW_PROMPT = "Slowly multiply 3 by 4."


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def slow_multiply(a: int, b: int) -> int:
    """
    Multiplies two integers, slowly.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product.
    """
    import time

    time.sleep(0.4)
    return a * b


def _conv(user: str, *turns: tuple[str, str | None]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": user}]
    for assistant, tool in turns:
        msgs.append({"role": "assistant", "content": assistant})
        if tool is not None:
            msgs.append({"role": "tool", "content": tool})
    return msgs


def transcripts() -> list[Transcript]:
    tools = [doc_tools.multiply, doc_tools.async_add]
    unknown = "Error: there is no tool named 'divide'; the available tools are: multiply, async_add"
    missing = "Error: TypeError: multiply() missing 1 required positional argument: 'b'"
    out: list[Transcript] = []
    for final in ("Done.", "Finished."):  # two endings: sampling gives the groups reward variance
        out += [
            Transcript(_conv("Divide 8 by 2.", (call("divide", a=8, b=2), unknown), (final, None)), tools),
            Transcript(_conv("Multiply 6 by nothing.", (call("multiply", a=6), missing), (final, None)), tools),
            Transcript(_conv("Add 2 and 5.", (call("async_add", a=2, b=5), "7"), (final, None)), tools),
            Transcript(_conv("Reach the goal tile.", (call("move", action="up" if final == "Done." else "left"),
                                                      "goal" if final == "Done." else "wall"), (final, None)),
                       [doc_env_dict.GameEnv.move]),
        ]  # fmt: skip
    keep = call("multiply", a=2, b=2)
    out.append(
        Transcript(_conv("Keep multiplying 2 by 2.", (keep, "4"), (keep, "4"), (keep, "4"), (keep, None)), tools)
    )
    inc = [doc_env_self.IncrementEnv.increment]
    for t, user in [(1, "by"), (3, "by"), (5, "by"), (2, "to"), (4, "to"), (6, "to")]:
        for step in (t, t + 1):  # two calls: the environment's reward varies within a group
            conv = _conv(
                f"Increment the counter {user} {t}.", (call("increment", step=step), str(step)), ("Done.", None)
            )
            out.append(Transcript(conv, inc))
    for n in (5, 15):
        prompt = f"Compute the {n}th Fibonacci number."
        out.append(Transcript(_conv(prompt, (call("run_code", code="print(fib())"), "42"), ("Done.", None)),
                              [doc_env_dict.CodingEnv.run_code]))  # fmt: skip
    out.append(
        Transcript(_conv(SLOW_PROMPT, (call("slow_multiply", a=3, b=4), "12"), ("Done.", None)), [slow_multiply])
    )
    out.append(fork_transcript())
    return out


def fork_transcript() -> Transcript:
    """A call after a think block, then an answer: the template drops the first block, so the rollout forks."""
    fork = _conv(FORK_PROMPT, ("<think>I multiply.</think>" + call("multiply", a=5, b=5), "25"),
                 ("<think>I answer.</think>Done.", None))  # fmt: skip
    return Transcript(fork, [doc_tools.multiply], chat_template=REASONING_DROPPING_TEMPLATE)


class ToolModelNotReady(AssertionError):
    """The warm-up ended (extra rounds included) with transcripts the model still gets wrong."""


def warm_up_checked(
    rounds: Sequence[tuple[int, float]] = WARMUP_ROUNDS, extra_rounds: int = EXTRA_ROUNDS
) -> tuple[Any, Any]:
    """A fresh tiny Llama warmed up on ``transcripts()`` until it reproduces every one (model, tokenizer).

    After ``rounds`` of supervised steps the model is checked (``tool_model_check``); while it still gets a turn
    wrong it trains ``EXTRA_ROUND`` more, at most ``extra_rounds`` times, then fails naming what it gets wrong.
    """
    import torch

    tok = smollm2_tokenizer()
    prepare_tool_template(tok)
    data = transcripts()
    torch.manual_seed(WARMUP_SEED)
    model = tiny_model("llama", seed=WARMUP_SEED)
    plan = list(rounds) + [EXTRA_ROUND] * extra_rounds
    mistakes = warm_up_until_reproduced(model, tok, data, plan, first_check=len(rounds) - 1,
                                        batch_size=len(data) * 4, negatives=WARMUP_NEGATIVES, label="tool")  # fmt: skip
    if not mistakes:
        return model, tok
    raise ToolModelNotReady(
        f"the tool model does not reproduce {len(mistakes)} transcript turn(s) after its warm-up ({list(rounds)} "
        f"and {extra_rounds} extra rounds of {EXTRA_ROUND}; (steps, learning rate)):\n  " + "\n  ".join(mistakes)
    )


def _cache_key() -> str:
    """Everything the cached model depends on: the data, the warm-up settings, torch and this file's version."""
    import torch
    import transformers

    tok = smollm2_tokenizer()
    prepare_tool_template(tok)
    seqs = [s.input_ids for t in transcripts() for s in transcript_sequences(tok, t)]
    settings = [FIXTURE_VERSION, WARMUP_ROUNDS, EXTRA_ROUND, EXTRA_ROUNDS, WARMUP_NEGATIVES, WARMUP_SEED,
                MIN_MARGIN_NATS, torch.__version__, transformers.__version__]  # fmt: skip
    return hashlib.sha1(json.dumps([seqs, settings]).encode()).hexdigest()[:12]


def tool_model_dir() -> Path:
    """The warmed-up tiny Llama + patched SmolLM2 tokenizer: built and checked once, then read from the cache.

    A cached model is checked again when loaded (a few seconds), so a model left by a crashed or older build is
    rebuilt instead of trusted.
    """
    out = cache_dir() / "tiny" / f"tool-llama-{_cache_key()}"
    with FileLock(str(out) + ".lock", timeout=900):
        if (out / "config.json").is_file():
            if not _cached_mistakes(out):
                return out
            logger.warning("the cached tool model %s does not reproduce its transcripts: building it again", out)
        publish(out, *warm_up_checked())
    return out


def _cached_mistakes(path: Path) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return transcript_mistakes(model, AutoTokenizer.from_pretrained(path), transcripts())

"""A tiny Llama that really emits tool calls: the cached result of a short supervised warm-up on CPU.

The agent integration tests need tool calls written by a real model through the real server. A random-init
tiny Llama (real SmolLM2 tokenizer) is fine-tuned with ``recipes.tool_warmup`` on transcripts of exactly the
prompts and tools the document's examples use (tests/helpers/agent_examples). Where the tests need reward
variance, a prompt has two continuations in the data, so sampling picks either. The model is cached by a hash
of the rendered training data, so the warm-up runs once per machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from filelock import FileLock

from asyncgrpo.recipes import cache_dir, smollm2_tokenizer, tiny_model
from asyncgrpo.recipes.tool_warmup import Transcript, supervised_tool_warmup, transcript_sequences
from asyncgrpo.rollout.agents import prepare_tool_template
from tests.helpers.agent_examples import doc_env_dict, doc_env_self, doc_tools

logger = logging.getLogger(__name__)

WARMUP_STEPS = 120
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
    fork = _conv(FORK_PROMPT, ("<think>I multiply.</think>" + call("multiply", a=5, b=5), "25"),
                 ("<think>I answer.</think>Done.", None))  # fmt: skip
    out.append(Transcript(fork, [doc_tools.multiply], chat_template=REASONING_DROPPING_TEMPLATE))
    return out


def tool_model_dir() -> Path:
    """The warmed-up tiny Llama + patched SmolLM2 tokenizer (built once, then read from the cache)."""
    tok = smollm2_tokenizer()
    prepare_tool_template(tok)
    data = transcripts()
    seqs = [s.input_ids for t in data for s in transcript_sequences(tok, t)]
    key = hashlib.sha1(json.dumps([seqs, WARMUP_STEPS]).encode()).hexdigest()[:12]
    out = cache_dir() / "tiny" / f"tool-llama-{key}"
    if (out / "config.json").is_file():
        return out
    with FileLock(str(out) + ".lock", timeout=900):
        if (out / "config.json").is_file():
            return out
        import torch

        torch.manual_seed(0)
        model = tiny_model("llama", seed=0)
        losses = supervised_tool_warmup(
            model, tok, data, steps=WARMUP_STEPS, lr=1e-2, batch_size=len(data) * 4, negatives=4096
        )
        logger.info("tool warm-up: loss %.3f -> %.3f", losses[0], losses[-1])
        staging = Path(tempfile.mkdtemp(dir=out.parent))
        model.save_pretrained(staging)
        tok.save_pretrained(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    return out

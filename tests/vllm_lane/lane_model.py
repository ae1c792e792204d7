"""The model the real-vLLM lane serves: a tiny Llama with head_dim 64 that really writes one tool call.

vLLM's CPU attention refuses the project's usual tiny Llama (head_dim 16), so the lane builds its own: hidden 64
in one head of 64, the real SmolLM2 tokenizer with the tool-calling template. A short supervised warm-up
(``assets.tool_warmup``) teaches it one conversation: a tool call, its result, and one of two endings ("Done." or
"Finished.", so sampled groups have reward variance). Like the agent tests' model (tests/helpers/agent_model.py)
it is checked before it is cached: greedy decoding must reproduce every written turn (``tool_model_check``), with
a bounded number of extra rounds, else the build fails naming the turn. The tools test checks once more through
the server. Cached by a hash of the data, the warm-up settings, torch, transformers and ``FIXTURE_VERSION``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from filelock import FileLock

from asyncgrpo.assets import cache_dir, smollm2_tokenizer, tiny_model
from asyncgrpo.assets.tool_warmup import Transcript, transcript_sequences
from tests.helpers.agent_examples.doc_tools import async_add, multiply
from tests.helpers.cached_model import publish
from tests.helpers.tool_model_check import warm_up_until_reproduced

logger = logging.getLogger(__name__)

SHAPE = {"num_attention_heads": 1, "num_key_value_heads": 1}  # hidden 64 in one head: head_dim 64
FIXTURE_VERSION = 2  # bump on any change to how the model is built or checked
WARMUP_ROUND = (100, 1e-2)  # (steps, learning rate)
EXTRA_ROUND, EXTRA_ROUNDS = (50, 3e-3), 3  # trained on while the check finds a mistake, at most EXTRA_ROUNDS times
TOOL_PROMPTS = {"Add 2 and 5.": ("async_add", {"a": 2, "b": 5}, "7")}  # one prompt: a tiny model learns it surely
TOOLS = [multiply, async_add]


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """The assistant text of one call in the template's format (what the worker's parser reads)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _transcripts() -> list[Transcript]:
    out = []
    for prompt, (name, arguments, result) in TOOL_PROMPTS.items():
        for ending in ("Done.", "Finished."):
            messages = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": tool_call_text(name, arguments)},
                {"role": "tool", "content": result},
                {"role": "assistant", "content": ending},
            ]
            out.append(Transcript(messages, TOOLS))
    return out


def lane_tokenizer() -> Any:
    from asyncgrpo.rollout.agents import prepare_tool_template

    tok = smollm2_tokenizer()
    prepare_tool_template(tok)
    return tok


def lane_model_dir() -> Path:
    """The warmed-up, checked model + tokenizer directory (built once per machine, then read from the cache)."""
    import torch
    import transformers

    tok = lane_tokenizer()
    data = _transcripts()
    seqs = [[int(x) for x in s.input_ids] for t in data for s in transcript_sequences(tok, t)]
    settings = [SHAPE, WARMUP_ROUND, EXTRA_ROUND, EXTRA_ROUNDS, FIXTURE_VERSION, torch.__version__,
                transformers.__version__]  # fmt: skip
    key = hashlib.sha1(json.dumps([seqs, settings]).encode()).hexdigest()[:12]
    out = cache_dir() / "tiny" / f"vllm-lane-llama-{key}"
    if (out / "config.json").is_file():
        return out
    with FileLock(str(out) + ".lock", timeout=900):
        if (out / "config.json").is_file():
            return out
        print(f"[vllm lane] warming up the lane's tool model ({WARMUP_ROUND[0]} steps) into {out}", flush=True)
        model = tiny_model("llama", seed=0, **SHAPE)
        mistakes = warm_up_until_reproduced(model, tok, data, [WARMUP_ROUND] + [EXTRA_ROUND] * EXTRA_ROUNDS,
                                            first_check=0, batch_size=len(data), negatives=2048, label="lane tool")  # fmt: skip
        if not mistakes:
            return publish(out, model, tok)
        raise AssertionError(
            f"the lane's tool model does not reproduce {len(mistakes)} turn(s) after {WARMUP_ROUND} and "
            f"{EXTRA_ROUNDS} x {EXTRA_ROUND} warm-up rounds ((steps, learning rate)):\n  " + "\n  ".join(mistakes)
        )

"""The model the real-vLLM lane serves: a tiny Llama with head_dim 64 that really writes one tool call.

vLLM's CPU attention refuses the project's usual tiny Llama (head_dim 16), so the lane builds its own: hidden 64
in one head of 64, the real SmolLM2 tokenizer with the tool-calling template. A short supervised warm-up
(``recipes.tool_warmup``) teaches it one conversation: a tool call, its result, and one of two endings ("Done." or
"Finished.", so sampled groups have reward variance). The tools test does not trust the warm-up: it first checks
through the server that greedy decoding of its prompt is the tool call. Cached by a hash of the training data.
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
from tests.helpers.agent_examples.doc_tools import async_add, multiply

logger = logging.getLogger(__name__)

SHAPE = {"num_attention_heads": 1, "num_key_value_heads": 1}  # hidden 64 in one head: head_dim 64
WARMUP_STEPS = 100
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
    """The warmed-up model + tokenizer directory (built once per machine, then read from the cache)."""
    tok = lane_tokenizer()
    data = _transcripts()
    seqs = [[int(x) for x in s.input_ids] for t in data for s in transcript_sequences(tok, t)]
    key = hashlib.sha1(json.dumps([seqs, SHAPE, WARMUP_STEPS]).encode()).hexdigest()[:12]
    out = cache_dir() / "tiny" / f"vllm-lane-llama-{key}"
    if (out / "config.json").is_file():
        return out
    with FileLock(str(out) + ".lock", timeout=900):
        if (out / "config.json").is_file():
            return out
        print(f"[vllm lane] warming up the lane's tool model ({WARMUP_STEPS} steps) into {out}", flush=True)
        model = tiny_model("llama", seed=0, **SHAPE)
        losses = supervised_tool_warmup(model, tok, data, steps=WARMUP_STEPS, lr=1e-2, batch_size=len(data),
                                        negatives=2048)  # fmt: skip
        logger.info("lane tool warm-up: loss %.3f -> %.3f", losses[0], losses[-1])
        staging = Path(tempfile.mkdtemp(dir=out.parent))
        model.save_pretrained(staging)
        tok.save_pretrained(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    return out

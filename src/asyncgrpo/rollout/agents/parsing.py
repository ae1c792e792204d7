"""Parse the tool calls out of one assistant turn (Hermes/ChatML style: ``<tool_call>{json}</tool_call>``).

Qwen2.5, Qwen3, Hermes and the patched SmolLM2 training template all ask the model to write each call as a JSON
object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` tags. Calls come back in the order written;
a block whose JSON is malformed becomes a call with an ``error`` so the model is told instead of the run crashing.
An opening tag without its closing tag (a truncated turn) is not a call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ParsedCall", "parse_tool_calls"]

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


@dataclass
class ParsedCall:
    """One call as the model wrote it. ``error`` is set (and ``name`` may be empty) when it could not be read."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def as_message_call(self) -> dict[str, Any]:
        """The OpenAI-style ``tool_calls`` entry (for logs and reward functions)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _one(body: str) -> ParsedCall:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as exc:
        return ParsedCall("", error=f"the tool call is not valid JSON ({exc.msg} at char {exc.pos}): {body.strip()!r}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParsedCall(
            "", error=f'a tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, got {body.strip()!r}'
        )
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models JSON-encode the arguments a second time
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ParsedCall(obj["name"], error=f"the arguments of {obj['name']!r} must be a JSON object, got {args!r}")
    return ParsedCall(obj["name"], args)


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """Every complete ``<tool_call>...</tool_call>`` block of ``text``, in order."""
    return [_one(m.group(1)) for m in _BLOCK.finditer(text)]

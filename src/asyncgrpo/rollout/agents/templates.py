"""Chat templates for the tool loop (A3): the prefix-preservation check and patched training templates.

The tool loop renders the whole conversation every turn. Tokens already generated are trained once, so the
template should render a growing conversation as an extension of what it rendered before: appending the
assistant's text and the tool results must not re-render earlier messages (drop earlier reasoning, move the
tool list, ...). A template that fails this still trains correctly (each such turn starts a new sample, see
``rollout/reconcile.py``) but forwards more tokens. For the ChatML family (SmolLM2, whose template has no tool
section at all, Qwen2.5, Qwen3) ``prepare_tool_template`` installs a patched training template that shows the
tool schemas and renders every assistant message verbatim.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["chatml_tool_template", "prefix_problem", "prepare_tool_template"]

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool",
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer", "description": "A value."}}},
    },
}
_PROBE_CALL = '<tool_call>\n{"name": "probe_tool", "arguments": {"x": 1}}\n</tool_call>'


def _probe_turns(thinking: bool) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """(assistant message, tool results) pairs of a probe conversation, with and without reasoning."""
    think = "<think>\nI call the tool.\n</think>\n\n" if thinking else ""
    return [
        (
            {"role": "assistant", "content": think + _PROBE_CALL},
            [{"role": "tool", "name": "probe_tool", "content": "1"}],
        ),
        (
            {"role": "assistant", "content": "Calling again.\n" + _PROBE_CALL},
            [{"role": "tool", "name": "probe_tool", "content": "2"}],
        ),
        ({"role": "assistant", "content": think + "The answer is 2."}, []),
    ]


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=False, **kwargs
    )


def prefix_problem(
    tokenizer: Any, tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None
) -> str | None:
    """Describe how the tokenizer's template breaks the tool loop's prefix property, or None when it holds.

    The property: after each turn, rendering the conversation with the assistant's text and the tool results
    appended starts with the previous render followed by exactly that text.
    """
    tools = tools if tools is not None else [_PROBE_TOOL]
    kwargs = dict(template_kwargs or {})
    # With reasoning switched off the generation prompt already holds the (empty) reasoning block.
    for thinking in (False,) if kwargs.get("enable_thinking") is False else (False, True):
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Use the tool."}]
        before = _render(tokenizer, messages, tools, kwargs)
        for assistant, results in _probe_turns(thinking):
            messages = [*messages, assistant, *results]
            after = _render(tokenizer, messages, tools, kwargs)
            expected = before + assistant["content"]
            if not after.startswith(expected):
                at = next(
                    (i for i, (a, b) in enumerate(zip(after, expected)) if a != b), min(len(after), len(expected))
                )
                return (
                    f"appending a turn re-renders earlier text at character {at}: expected {expected[at : at + 60]!r}, "
                    f"got {after[at : at + 60]!r}"
                )
            before = after
    return None


def _default_system(template: str) -> str:
    """The default system prompt a ChatML template inserts when the conversation has none (kept when patched)."""
    for marker in ("You are a helpful AI assistant named SmolLM", "You are Qwen, created by Alibaba Cloud"):
        start = template.find(marker)
        if start >= 0:
            end = min(i for i in (template.find("<|im_end|>", start), template.find("'", start)) if i >= 0)
            return template[start:end].replace("\\n", "\n")
    return ""


def chatml_tool_template(default_system: str = "", thinking_family: bool = False) -> str:
    """A ChatML training template that lists the tools and renders every assistant message verbatim.

    Tool results are grouped per turn in one ``user`` block of ``<tool_response>`` elements, the layout Qwen
    models are trained on. With ``thinking_family`` (Qwen3), ``enable_thinking=False`` adds the empty reasoning
    block to the generation prompt and to every assistant message that has none, so re-rendering keeps it.
    """
    empty_think = "<think>\\n\\n</think>\\n\\n"
    no_think = "enable_thinking is defined and enable_thinking is false" if thinking_family else "false"
    sys_default = json.dumps(default_system)
    return (
        "{%- set sys = messages[0].content if messages and messages[0].role == 'system' else " + sys_default + " -%}\n"
        "{%- if tools or sys -%}{{ '<|im_start|>system\\n' + sys }}{%- if tools -%}"
        "{{ ('\\n\\n' if sys else '') + '# Tools\\n\\nThe functions below are available to you; each line between "
        "<tools> and </tools> is the JSON signature of one:\\n<tools>' }}"
        "{%- for t in tools %}{{ '\\n' + (t | tojson) }}{%- endfor %}"
        "{{ '\\n</tools>\\n\\nTo call one, write a JSON object holding its name and its arguments between "
        '<tool_call> and </tool_call>, one block per call:\\n<tool_call>\\n{"name": "function_name", '
        '"arguments": {"argument": "value"}}\\n</tool_call>\' }}{%- endif -%}'
        "{{ '<|im_end|>\\n' }}{%- endif -%}\n"
        "{%- for m in messages -%}\n"
        "{%- if m.role == 'system' and loop.first -%}\n"
        "{%- elif m.role == 'tool' -%}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}"
        "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif -%}\n"
        "{%- elif m.role == 'assistant' -%}{{ '<|im_start|>assistant\\n' }}"
        "{%- if (" + no_think + ") and '<think>' not in m.content %}{{ '" + empty_think + "' }}{% endif -%}"
        "{{ m.content + '<|im_end|>\\n' }}\n"
        "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}\n"
        "{%- endfor -%}\n"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
        "{%- if " + no_think + " %}{{ '" + empty_think + "' }}{% endif -%}{%- endif -%}"
    )


def _shows_tools(tokenizer: Any, kwargs: dict[str, Any]) -> bool:
    text = _render(tokenizer, [{"role": "user", "content": "hi"}], [_PROBE_TOOL], kwargs)
    return "probe_tool" in text


def prepare_tool_template(tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> str:
    """Make ``tokenizer`` fit for the tool loop; returns what was done ("kept", "patched" or "warned").

    A template that lists the tools and is prefix-preserving is kept. A ChatML one (``<|im_start|>``) that
    fails either test is replaced by ``chatml_tool_template``. Any other failing template is kept with a
    warning that says what will happen (tools not shown, or each re-rendered turn starting a new sample).
    """
    kwargs = dict(template_kwargs or {})
    template = tokenizer.chat_template
    if not isinstance(template, str) or not template:
        raise ValueError(
            "the tokenizer has no chat_template; the tool loop renders conversations with it. Set "
            "processing_class.chat_template (e.g. a ChatML template listing the tools)"
        )
    shows, problem = _shows_tools(tokenizer, kwargs), prefix_problem(tokenizer, None, kwargs)
    if shows and problem is None:
        return "kept"
    if "<|im_start|>" in template:
        thinking = "<think>" in template
        tokenizer.chat_template = chatml_tool_template(_default_system(template), thinking_family=thinking)
        why = "does not show the tools" if not shows else f"is not prefix-preserving ({problem})"
        logger.info("tools are on and the ChatML chat template %s: training with the patched tool template", why)
        return "patched"
    if not shows:
        logger.warning(
            "the chat template does not render the `tools` it is given, so the model will not see the tool schemas; "
            "set processing_class.chat_template to a template with a tool section"
        )
    if problem is not None:
        logger.warning(
            "the chat template is not prefix-preserving (%s): every turn that re-renders earlier messages starts a "
            "new training sample (rollout/fork_frac), which costs forwarded tokens; set a prefix-preserving "
            "processing_class.chat_template to avoid it",
            problem,
        )
    return "warned"

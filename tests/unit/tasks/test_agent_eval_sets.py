"""Agent eval sets without a server: the set's checks and their errors, a factory that cannot build, and the set's
figures from scored groups against pass@k / mean@k computed here (issue 36)."""

from __future__ import annotations

import math

import pytest

from asyncgrpo.rollout.agents.environments import EnvironmentPool, check_environment_factory
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.tasks.agent_eval import EvalChannels, agent_set_metrics, check_buildable
from asyncgrpo.tasks.eval_sets import EvalSet, as_eval_sets, set_settings
from asyncgrpo.tasks.evaluate import EvalSettings
from tests.helpers.eval_agents import EchoEnv, NoReset
from tests.unit.agent_tools_mod import multiply, no_docstring


def test_an_agent_set_is_checked_and_keeps_its_settings():
    sets = as_eval_sets({"calc": EvalSet([{"answer": "1"}], reward_funcs=[], environment_factory=EchoEnv,
                                         tools=[multiply], max_tool_calling_iterations=3),
                         "plain": EvalSet([1])})  # fmt: skip
    assert sets["calc"].is_agent and not sets["plain"].is_agent
    assert sets["calc"].factories() == {"": EchoEnv}
    base = EvalSettings(base_url="http://x", max_tokens=8, max_tool_calling_iterations=5)
    assert set_settings(base, sets["calc"]).max_tool_calling_iterations == 3
    assert set_settings(base, sets["plain"]).max_tool_calling_iterations == 5  # the run's


def test_an_environment_that_does_not_pickle_is_fine_for_evaluation_only():
    class LocalEnv:  # a local class cannot cross into the spawned worker, but evaluation never sends it there
        def reset(self, **kwargs) -> None:
            pass

    assert as_eval_sets({"calc": EvalSet([{}], environment_factory=LocalEnv)})["calc"].factories() == {"": LocalEnv}
    with pytest.raises(TypeError, match="environment_factory"):
        check_environment_factory(LocalEnv)  # training's check: it must pickle


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"environment_factory": NoReset}, TypeError, "eval set calc: environment_factory NoReset has no reset()"),
        ({"environment_factory": 3}, TypeError, "eval set calc: environment_factory must be a class or a function"),
        ({"environment_factory": {}}, ValueError, "eval set calc: environment_factory is an empty dict"),
        ({"tools": multiply}, TypeError, "eval set calc: tools must be a list of module-level functions"),
        ({"tools": [no_docstring]}, TypeError, "eval set calc: tool <function no_docstring"),
        ({"tools": [multiply, multiply]}, ValueError, "two tools share the name"),
        ({"max_tool_calling_iterations": 2}, ValueError, "needs an environment_factory or tools"),
        ({"tools": [multiply], "max_tool_calling_iterations": 0}, ValueError, "max_tool_calling_iterations=0"),
    ],
)
def test_a_bad_agent_set_is_named_with_its_fix(kwargs, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        as_eval_sets({"calc": EvalSet([{}], **kwargs)})


def test_a_factory_that_cannot_build_names_the_set():
    def broken():
        raise OSError("no such sandbox image")

    with pytest.raises(ValueError, match=r"eval set calc: environment_factory\['sandbox'\] could not build an "
                                         r"environment \(OSError: no such sandbox image\); fix the factory"):  # fmt: skip
        check_buildable(EnvironmentPool({"sandbox": broken}), "eval/calc")
    with pytest.raises(TypeError, match="eval set calc: environment_factory returned int, which has no reset()"):
        check_buildable(EnvironmentPool({"": lambda: 3}), "eval/calc")
    pool = EnvironmentPool({"": EchoEnv})
    check_buildable(pool, "eval/calc")
    assert isinstance(pool.acquire(""), EchoEnv) and pool.created[""] == 0  # the built one waits in the pool


def test_the_figures_of_scored_groups():
    """Two rows of n = 3 episodes, scored out of order; pass@k = 1 - C(n-c, k)/C(n, k) averaged over rows."""
    ch = EvalChannels()
    ch.put(GroupResult(row_index=1, epoch=0, dataset_row=1, rewards=[0.0, 0.0, 1.0], completion_texts=["a"] * 3))
    ch.put(GroupResult(row_index=0, epoch=0, dataset_row=0, rewards=[1.0, 0.5, 1.0], completion_texts=["b"] * 3))
    for name, value, weight in [("tools/call_frequency", 2.0, 3.0), ("tools/call_frequency", 1.0, 3.0),
                                ("tools/failure_frequency", math.nan, 0.0), ("rewards/EchoEnv/mean", 0.5, 6.0),
                                ("reward", 9.9, 1.0)]:  # fmt: skip
        ch.put_metric(name, value, weight)
    out = agent_set_metrics(ch, [], "eval/calc", pass_threshold=1.0, num_prompts=2)
    # row 0: c = 2 of 3; row 1: c = 1 of 3.
    assert out["eval/calc/pass@1"] == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert out["eval/calc/pass@2"] == pytest.approx(((1 - math.comb(1, 2) / 3) + (1 - math.comb(2, 2) / 3)) / 2)
    assert out["eval/calc/mean@1"] == pytest.approx((1.0 + 0.0) / 2)  # row order, whatever order groups came in
    assert out["eval/calc/mean@2"] == pytest.approx((0.75 + 0.0) / 2)
    assert out["eval/calc/reward"] == pytest.approx(3.5 / 6)
    assert out["eval/calc/tools/call_frequency"] == pytest.approx(1.5)  # weighted by episodes
    assert math.isnan(out["eval/calc/tools/failure_frequency"])  # no call made: no rate
    assert out["eval/calc/rewards/EchoEnv/mean"] == 0.5 and "eval/calc/reward_kept" not in out
    assert out["eval/calc/num_prompts"] == 2.0 and "eval/calc/maj@1" not in out

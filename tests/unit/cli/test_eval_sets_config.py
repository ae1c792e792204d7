"""``eval_datasets`` in the YAML: named sets with their own settings, checked before anything loads; the table
``asyncgrpo eval`` prints for a set."""

from __future__ import annotations

import math

import pytest

from asyncgrpo.cli.eval import format_table
from asyncgrpo.cli.run_config import check_eval_sets, load_yaml
from asyncgrpo.errors import UserError
from asyncgrpo.tasks.eval_sets import EvalSet, as_eval_sets, set_settings
from asyncgrpo.tasks.evaluate import EvalSettings
from asyncgrpo.tasks.reasoning import numeric_answer_reward
from tests.unit.cli.test_cli_errors import ROOT, run_cli, write

SUMS = {"recipe": "reasoning_gym", "task": "chain_sum", "size": 4, "seed": 1}


def test_the_example_file_checks():
    sets = check_eval_sets(load_yaml(ROOT / "examples" / "eval_sets.yaml")["eval_datasets"])
    assert list(sets) == ["sums", "products"]
    assert (sets["sums"]["num_samples"], sets["sums"]["temperature"], sets["sums"]["reward_funcs"]) == (4, 0.7, None)
    assert sets["products"]["reward_funcs"] == (numeric_answer_reward,)
    assert "num_samples" not in sets["products"]["dataset"]  # the set's own keys leave the dataset section


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"num_samples": 0}, "eval_datasets.sums.num_samples must be an integer >= 1"),
        ({"temperature": -0.5}, "eval_datasets.sums.temperature must be a number >= 0"),
        ({"reward_funcs": "x"}, "eval_datasets.sums.reward_funcs must be a list"),
        ({"sizee": 3}, "unknown key 'sizee' (did you mean 'size'?)"),
    ],
)
def test_a_bad_set_is_named_with_its_fix(extra, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        check_eval_sets({"sums": {**SUMS, **extra}})


def test_one_set_or_named_sets_not_both(tmp_path, capsys):
    path = write(tmp_path, lambda c: c.update(eval_datasets={"sums": SUMS}))
    err = run_cli(["train", "--config", str(path)], capsys)
    assert "give eval_dataset (one set) or eval_datasets (named sets), not both" in err


def test_as_eval_sets_and_their_settings():
    assert as_eval_sets([1, 2]) is None  # one plain dataset: logged as eval/*
    sets = as_eval_sets({"a": [1], "b": EvalSet([2], num_samples=4, temperature=0.7)})
    assert sets["a"] == EvalSet([1])
    base = EvalSettings(base_url="http://x", max_tokens=8, temperature=0.0, num_samples=1)
    assert set_settings(base, sets["a"]) == base
    assert (set_settings(base, sets["b"]).num_samples, set_settings(base, sets["b"]).temperature) == (4, 0.7)
    with pytest.raises(ValueError, match="eval/<name>"):
        as_eval_sets({"a b": [1]})
    with pytest.raises(ValueError, match="num_samples=0"):
        as_eval_sets({"a": EvalSet([1], num_samples=0)})


def test_the_table_of_a_set():
    scores = {"eval/sums/reward": 0.5, "eval/sums/completions/mean_length": 12.0,
              "eval/sums/completions/clipped_ratio": 0.25, "eval/sums/num_prompts": 32.0,
              "eval/sums/mean@1": 0.5, "eval/sums/pass@1": 0.5, "eval/sums/mean@2": 0.5, "eval/sums/pass@2": 0.75,
              "eval/other/pass@1": 1.0}  # fmt: skip
    s = EvalSettings(base_url="http://x", max_tokens=8, temperature=0.7, num_samples=2)
    text = format_table("sums", scores, s, 3.21)
    assert text.splitlines() == [
        "sums: 32 prompts x 2 samples (temperature 0.7) in 3.2s; reward 0.5000, mean length 12.0, clipped 0.25",
        "     k    mean@k    pass@k",
        "     1    0.5000    0.5000",
        "     2    0.5000    0.7500",
    ]
    scores["eval/sums/mean@2"] = math.nan
    assert format_table("sums", scores, s, 1.0).splitlines()[-1] == "     2       nan    0.7500"


def test_an_agent_set_from_the_yaml():
    from tests.helpers.eval_agents import EchoEnv
    from tests.unit.agent_tools_mod import multiply

    sets = check_eval_sets({"calc": {**SUMS, "environment_factory": "tests.helpers.eval_agents:EchoEnv",
                                     "tools": ["tests.unit.agent_tools_mod:multiply"], "reward_funcs": [],
                                     "max_tool_calling_iterations": 2},
                            "routed": {**SUMS, "environment_factory": {"echo": "tests.helpers.eval_agents:EchoEnv"}},
                            "sums": SUMS})  # fmt: skip
    calc = sets["calc"]
    assert (calc["environment_factory"], calc["tools"]) == (EchoEnv, (multiply,))
    assert calc["max_tool_calling_iterations"] == 2
    assert calc["reward_funcs"] == ()  # the environment's get_reward alone
    assert "environment_factory" not in calc["dataset"] and "tools" not in calc["dataset"]
    assert sets["routed"]["environment_factory"] == {"echo": EchoEnv}
    assert (sets["sums"]["environment_factory"], sets["sums"]["tools"]) == (None, None)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"environment_factory": "tests.helpers.eval_agents:EchoEnvv"},
         ("eval_datasets.sums.environment_factory: cannot import 'tests.helpers.eval_agents:EchoEnvv': module "
          "tests.helpers.eval_agents has no 'EchoEnvv' (did you mean 'tests.helpers.eval_agents:EchoEnv'?)")),
        ({"environment_factory": "tests.helpers.eval_agents:NoReset"},
         "eval_datasets.sums.environment_factory NoReset has no reset() method"),
        ({"environment_factory": 3}, "eval_datasets.sums.environment_factory must be 'package.module:Class' or"),
        ({"tools": "tests.unit.agent_tools_mod:multiply"}, "eval_datasets.sums.tools must be a list of"),
        ({"tools": ["tests.unit.agent_tools_mod:no_docstring"]}, "eval_datasets.sums.tools: "),
        ({"tools": ["tests.unit.agent_tools_mod:multiply"], "max_tool_calling_iterations": 0},
         "eval_datasets.sums.max_tool_calling_iterations must be an integer >= 1, got 0"),
        ({"max_tool_calling_iterations": 2}, "eval_datasets.sums.max_tool_calling_iterations needs an environment"),
        ({"reward_funcs": []}, "eval_datasets.sums.reward_funcs is empty"),  # no environment to score it
    ],
)  # fmt: skip
def test_a_bad_agent_set_in_the_yaml_is_named_with_its_fix(extra, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        check_eval_sets({"sums": {**SUMS, **extra}})


def test_the_agent_example_file_checks():
    from examples.agent_calculator import AnswerCalculatorEnv

    sets = check_eval_sets(load_yaml(ROOT / "examples" / "eval_agent.yaml")["eval_datasets"])
    assert sets["sums"]["environment_factory"] is None
    assert sets["sums_calc"]["environment_factory"] is AnswerCalculatorEnv
    assert sets["sums_calc"]["max_tool_calling_iterations"] == 2
    env = AnswerCalculatorEnv()
    env.reset(answer="57", task="chain_sum")  # a reasoning-gym row's columns
    assert (env.calculate("50 + 7"), env.get_reward()) == ("57", 0.5)

"""The YAML run launcher: parsing, imports, errors, and the demo config kept equal to examples/demo.yaml."""

from pathlib import Path

import pytest

from asyncgrpo.demo import DEMO_CONFIG
from asyncgrpo.launch import import_object, load_run_config

ROOT = Path(__file__).resolve().parents[2]


def test_example_yaml_is_the_demo():
    assert load_run_config(ROOT / "examples" / "demo.yaml") == DEMO_CONFIG


def test_import_object_both_spellings():
    from asyncgrpo.recipes.tasks import numeric_answer_reward

    assert import_object("asyncgrpo.recipes.tasks:numeric_answer_reward") is numeric_answer_reward
    assert import_object("asyncgrpo.recipes.tasks.numeric_answer_reward") is numeric_answer_reward
    with pytest.raises(ValueError, match="cannot import"):
        import_object("asyncgrpo.recipes.tasks:nope")


def test_bad_config_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: demo\nargs: {}\ndataset: {recipe: reasoning_gym}\nrewards: []\n")
    with pytest.raises(ValueError, match="unknown key 'rewards' \\(did you mean 'reward_funcs'\\?\\)"):
        load_run_config(bad)
    bad.write_text("model: demo\nargs: {}\n")
    with pytest.raises(ValueError, match="missing 'dataset'"):
        load_run_config(bad)


def test_numeric_answer_reward():
    from asyncgrpo.recipes.tasks import format_reward, numeric_answer_reward

    done = [[{"role": "assistant", "content": "3 + 4 = <answer>7</answer>"}],
            [{"role": "assistant", "content": "it is 8"}],
            [{"role": "assistant", "content": "no idea"}]]  # fmt: skip
    assert numeric_answer_reward(done, answer=["7", "7", "7"]) == [1.0, 0.0, 0.0]
    assert numeric_answer_reward(done[:1], answer=["n/a"]) == [None]
    assert format_reward(done) == [0.1, 0.0, 0.0]


def test_demo_config_checks_without_loading_anything():
    """`asyncgrpo demo` goes through the same checks as a YAML file (nothing is fetched or started here)."""
    from asyncgrpo.launch import _config_from_dict

    spec = _config_from_dict(DEMO_CONFIG)
    assert spec.args.max_steps == DEMO_CONFIG["args"]["max_steps"] and spec.server["embedded"] is True
    assert [f.__name__ for f in spec.reward_funcs] == ["numeric_answer_reward", "format_reward"]


def test_plain_text_prompts_become_user_messages(tmp_path):
    """The trainer takes conversational prompts (the document requires them); prompt_column converts text."""
    import json

    from asyncgrpo.launch import build_dataset
    from asyncgrpo.run_config import UserError, check_dataset

    data = tmp_path / "qa.jsonl"
    data.write_text("\n".join(json.dumps({"question": q, "answer": a}) for q, a in [("1+1?", "2"), ("2+3?", "5")]))
    spec = check_dataset("dataset", {"path": str(data), "prompt_column": "question"})
    ds = build_dataset(spec)
    assert ds[1]["prompt"] == [{"role": "user", "content": "2+3?"}] and ds[1]["answer"] == "5"
    with pytest.raises(UserError, match="prompt_column 'q' is not a column"):
        build_dataset({"path": str(data), "prompt_column": "q"})
    with pytest.raises(UserError, match="file .*missing.jsonl not found"):
        check_dataset("dataset", {"path": str(tmp_path / "missing.jsonl")})

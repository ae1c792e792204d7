"""Every config mistake of issue 13 gives one clear message naming the fix and exit code 2, before any model loads.

Run through ``asyncgrpo.cli.main`` in-process (the command's real code path); tests/integration/test_cli.py runs
a few of them as real processes to check the exit code, the time and the absence of a traceback.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import yaml

from asyncgrpo.cli import main

ROOT = Path(__file__).resolve().parents[3]
DEMO = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())


def write(tmp_path: Path, edit) -> Path:
    cfg = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    cfg["args"]["output_dir"] = str(tmp_path / "out")
    edit(cfg)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_cli(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("error:") == 1, err
    return err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_misspelled_server_key(tmp_path, capsys):
    path = write(tmp_path, lambda c: c["server"].update(embeded=True))
    err = run_cli(["train", "--config", str(path)], capsys)
    assert "server: unknown key 'embeded' (did you mean 'embedded'?)" in err


def test_misspelled_dataset_key(tmp_path, capsys):
    path = write(tmp_path, lambda c: c["dataset"].update(taks=c["dataset"].pop("task")))
    err = run_cli(["train", "--config", str(path)], capsys)
    assert "unknown key 'taks' (did you mean 'task'?)" in err


def test_misspelled_args_key(tmp_path, capsys):
    path = write(tmp_path, lambda c: c["args"].update(max_step=c["args"].pop("max_steps")))
    err = run_cli(["train", "--config", str(path)], capsys)
    assert "'max_step' is not an AsyncGRPOConfig field (did you mean 'max_steps'?)" in err


def test_unknown_task_lists_valid_ones(tmp_path, capsys):
    path = write(tmp_path, lambda c: c["dataset"].update(task="chain_sums"))
    err = run_cli(["train", "--config", str(path)], capsys)
    assert "unknown reasoning-gym task 'chain_sums' (did you mean 'chain_sum'?)" in err
    assert "basic_arithmetic" in err  # the list of valid tasks


def test_unknown_task_setting(tmp_path, capsys):
    path = write(tmp_path, lambda c: c["dataset"].update(max_digit=1))
    err = run_cli(["train", "--config", str(path)], capsys)
    assert "unknown key 'max_digit' (did you mean 'max_digits'?)" in err


def test_bad_reward_path(tmp_path, capsys):
    path = write(tmp_path, lambda c: c["reward_funcs"].__setitem__(0, "asyncgrpo.tasks.reasoning:numeric_answer"))
    err = run_cli(["train", "--config", str(path)], capsys)
    assert "has no 'numeric_answer' (did you mean 'asyncgrpo.tasks.reasoning:numeric_answer_reward'?)" in err
    path = write(tmp_path, lambda c: c["reward_funcs"].__setitem__(0, "no_such_module:f"))
    assert "cannot import 'no_such_module:f'" in run_cli(["train", "--config", str(path)], capsys)


def test_wrong_type_and_yaml_strings(tmp_path, capsys):
    path = write(tmp_path, lambda c: c["args"].update(max_steps="three"))
    err = run_cli(["train", "--config", str(path)], capsys)
    assert "args.max_steps: 'three' (str) does not fit its type int" in err


def test_config_rules_reach_the_user(tmp_path, capsys):
    path = write(tmp_path, lambda c: c["args"].update(num_generations=1))
    err = run_cli(["train", "--config", str(path)], capsys)
    assert "num_generations=1: need >= 2" in err


def test_missing_and_unknown_top_level(tmp_path, capsys):
    err = run_cli(["train", "--config", str(tmp_path / "nope.yaml")], capsys)
    assert "config file" in err and "not found" in err
    path = write(tmp_path, lambda c: c.update(rewards=c.pop("reward_funcs")))
    assert "unknown key 'rewards' (did you mean 'reward_funcs'?)" in run_cli(["train", "--config", str(path)], capsys)
    (tmp_path / "broken.yaml").write_text("model: demo\nargs: {max_steps: [\n")
    assert "is not valid YAML" in run_cli(["train", "--config", str(tmp_path / "broken.yaml")], capsys)


def test_override_typo(tmp_path, capsys):
    path = write(tmp_path, lambda c: None)
    err = run_cli(["train", "--config", str(path), "--max_stepz", "3"], capsys)
    assert "unknown command-line argument(s) --max_stepz 3 (did you mean '--max_steps'?)" in err


def test_server_unreachable(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"

    def edit(c):
        c["server"] = {"wait_s": 1}
        c["args"]["vllm_server_base_url"] = url

    err = run_cli(["train", "--config", str(write(tmp_path, edit))], capsys)
    assert f"no generation server answers at {url}" in err and "asyncgrpo serve MODEL" in err


def test_debug_shows_the_traceback(tmp_path):
    path = write(tmp_path, lambda c: c["server"].update(embeded=True))
    with pytest.raises(ValueError, match="embeded"):
        main(["train", "--config", str(path), "--debug"])


def test_overrides_are_typed(tmp_path):
    from asyncgrpo.cli.launch import parse_train

    spec, ns = parse_train(
        ["--config", str(write(tmp_path, lambda c: None)), "--max_steps", "3", "--learning_rate", "1e-5", "--log-full"]
    )
    assert spec.args.max_steps == 3 and spec.args.learning_rate == 1e-5 and ns.log_full
    assert spec.args.num_generations == DEMO["args"]["num_generations"]  # the rest comes from the file
    assert spec.args.learning_rate != DEMO["args"]["learning_rate"]


def test_yaml_numbers_written_as_text_convert(tmp_path):
    """YAML 1.1 reads 5e-6 (no dot) as a string; the field is a float, so it converts."""
    from asyncgrpo.cli.launch import parse_train

    path = write(tmp_path, lambda c: None)
    path.write_text(re.sub(r"learning_rate: \S+", "learning_rate: 5e-6", path.read_text()))
    assert "5e-6" in path.read_text()
    spec, _ = parse_train(["--config", str(path)])
    assert spec.args.learning_rate == 5e-6


def test_report_without_metrics(tmp_path, capsys):
    err = run_cli(["report", str(tmp_path)], capsys)
    assert "metrics.jsonl not found: pass the run's output_dir" in err


def test_eval_without_eval_dataset(tmp_path, capsys):
    path = write(tmp_path, lambda c: c.pop("eval_dataset"))
    err = run_cli(["eval", "--model", str(tmp_path), "--config", str(path)], capsys)
    assert "has no eval_datasets (or eval_dataset): add one" in err


def test_eval_settings_are_checked(tmp_path, capsys):
    path = write(tmp_path, lambda c: c["args"].update(eval_temperature=-1.0))
    assert "need temperature >= 0" in run_cli(["train", "--config", str(path)], capsys)


def test_hub_model_not_cached_offline(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = write(tmp_path, lambda c: c.update(model="some-org/not-a-cached-model"))
    err = run_cli(["train", "--config", str(path)], capsys)
    assert "model some-org/not-a-cached-model is not in the Hugging Face cache" in err and "HF_HUB_OFFLINE" in err


def test_embedded_server_that_cannot_start(tmp_path, capsys):
    """A typo in server.args: the server process exits at once; its own message reaches the user, exit 2 (once the
    trainer is built: the two start side by side, so the trainer's loading lines may come first)."""
    from asyncgrpo.assets import tiny_model_dir

    def edit(c):
        c["model"] = str(tiny_model_dir("llama"))
        c["server"] = {"embedded": True, "device": "cpu", "args": ["--no-such-flag"]}

    assert main(["train", "--config", str(write(tmp_path, edit))]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "asyncgrpo train: error:" in err
    assert err[err.index("asyncgrpo train: error:") :].startswith(
        "asyncgrpo train: error: the embedded generation server did not"
    )
    assert "unrecognized arguments: --no-such-flag" in err  # the server's own message, from its log


def test_answer_workers_default_follows_the_cpus(monkeypatch):
    """None on CPU (its cores run the model); on CUDA half the usable CPUs, between 1 and 8."""
    from asyncgrpo.server import main

    assert main.default_answer_workers("cpu") == 0
    for cpus, want in ((1, 1), (2, 1), (6, 3), (16, 8), (64, 8)):
        monkeypatch.setattr(main.os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert main.default_answer_workers("cuda") == want

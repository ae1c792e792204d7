"""The YAML run launcher: parsing, imports, errors, and the demo config kept equal to examples/demo.yaml."""

import copy
import re
from pathlib import Path

import pytest

from asyncgrpo.cli.demo import DEMO_CONFIG
from asyncgrpo.cli.run_config import import_object, load_yaml

ROOT = Path(__file__).resolve().parents[3]


def test_example_yaml_is_the_demo():
    assert load_yaml(ROOT / "examples" / "demo.yaml") == DEMO_CONFIG


def test_import_object_both_spellings():
    from asyncgrpo.tasks.reasoning import numeric_answer_reward

    assert import_object("asyncgrpo.tasks.reasoning:numeric_answer_reward") is numeric_answer_reward
    assert import_object("asyncgrpo.tasks.reasoning.numeric_answer_reward") is numeric_answer_reward
    with pytest.raises(ValueError, match="cannot import"):
        import_object("asyncgrpo.tasks.reasoning:nope")


def test_bad_config_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: demo\nargs: {}\ndataset: {recipe: reasoning_gym}\nrewards: []\n")
    with pytest.raises(ValueError, match="unknown key 'rewards' \\(did you mean 'reward_funcs'\\?\\)"):
        load_yaml(bad)
    bad.write_text("model: demo\nargs: {}\n")
    with pytest.raises(ValueError, match="missing 'dataset'"):
        load_yaml(bad)


def test_numeric_answer_reward():
    from asyncgrpo.tasks.reasoning import format_reward, numeric_answer_reward

    done = [[{"role": "assistant", "content": "3 + 4 = <answer>7</answer>"}],
            [{"role": "assistant", "content": "it is 8"}],
            [{"role": "assistant", "content": "no idea"}]]  # fmt: skip
    assert numeric_answer_reward(done, answer=["7", "7", "7"]) == [1.0, 0.0, 0.0]
    assert numeric_answer_reward(done[:1], answer=["n/a"]) == [None]
    assert format_reward(done) == [0.1, 0.0, 0.0]


def test_demo_config_checks_without_loading_anything():
    """`asyncgrpo demo` goes through the same checks as a YAML file (nothing is fetched or started here)."""
    from asyncgrpo.cli.launch import _config_from_dict

    spec = _config_from_dict(DEMO_CONFIG)
    assert spec.args.max_steps == DEMO_CONFIG["args"]["max_steps"] and spec.server["embedded"] is True
    assert [f.__name__ for f in spec.reward_funcs] == ["numeric_answer_reward"]


def test_plain_text_prompts_become_user_messages(tmp_path):
    """The trainer takes conversational prompts (T4 in docs/spec.md); prompt_column converts text."""
    import json

    from asyncgrpo.cli.launch import build_dataset
    from asyncgrpo.cli.run_config import check_dataset
    from asyncgrpo.errors import UserError

    data = tmp_path / "qa.jsonl"
    data.write_text("\n".join(json.dumps({"question": q, "answer": a}) for q, a in [("1+1?", "2"), ("2+3?", "5")]))
    spec = check_dataset("dataset", {"path": str(data), "prompt_column": "question"})
    ds = build_dataset(spec)
    assert ds[1]["prompt"] == [{"role": "user", "content": "2+3?"}] and ds[1]["answer"] == "5"
    with pytest.raises(UserError, match="prompt_column 'q' is not a column"):
        build_dataset({"path": str(data), "prompt_column": "q"})
    with pytest.raises(UserError, match="file .*missing.jsonl not found"):
        check_dataset("dataset", {"path": str(tmp_path / "missing.jsonl")})


def test_format_reward_pays_exactly_for_the_tagged_answers_numeric_answer_reward_reads():
    from asyncgrpo.tasks.reasoning import extract_answer, format_reward, numeric_answer_reward

    texts = ["<answer>7</answer>", "<answer> -3 </answer>", "<answer>seven</answer>", "so 7", "<answer>4</answer> 7",
             "<answer>1</answer> then <answer>7</answer>", "<answer></answer> 7"]  # fmt: skip
    done = [[{"role": "assistant", "content": t}] for t in texts]
    fmt = format_reward(done)
    num = numeric_answer_reward(done, answer=["7"] * len(texts))
    for text, f, n in zip(texts, fmt, num):
        tagged = "<answer>" in text and extract_answer(text) not in (None, "")
        number_in_tag = tagged and re.fullmatch(r"-?\d+(\.\d+)?", extract_answer(text)) is not None
        assert f == (0.1 if number_in_tag else 0.0), text  # the bonus goes to answers the numeric reward can read
        if number_in_tag:  # and then the numeric reward judges the tag's number, not a later one
            assert n == (1.0 if float(extract_answer(text)) == 7 else 0.0), text
    assert fmt == [0.1, 0.1, 0.0, 0.0, 0.1, 0.1, 0.0] and num == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def test_an_embedded_cpu_server_and_the_trainer_split_the_cores(monkeypatch):
    import torch

    from asyncgrpo.cli.run_server import split_cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = torch.get_num_threads()
    try:
        assert split_cpu_threads(["--device", "cpu"], cores=2) == {"OMP_NUM_THREADS": "1"}
        assert torch.get_num_threads() == 1
        assert split_cpu_threads(["--device", "auto"], cores=7) == {"OMP_NUM_THREADS": "3"}
        assert torch.get_num_threads() == 4
        assert split_cpu_threads(["--device", "cuda:1"], cores=8) == {}  # the server computes on a GPU
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice stands
        assert split_cpu_threads(["--device", "cpu"], cores=8) == {}
    finally:
        torch.set_num_threads(before)


def test_train_spawns_the_rollout_worker_before_the_trainer_and_hands_it_over(monkeypatch, tmp_path):
    """``asyncgrpo train`` spawns the worker's process before it builds the data and the trainer (its imports overlap
    them), gives it to the trainer as ``worker_ahead`` (with the config's timeout) before the warm-up, and stops it
    if the trainer never did, or at once where the trainer has a rollout worker of its own."""
    import asyncgrpo
    from asyncgrpo import AsyncGRPOConfig
    from asyncgrpo.cli import launch
    from asyncgrpo.cli.run_config import RunSpec
    from asyncgrpo.rollout.worker import RolloutWorker

    seen: dict = {}
    real_spawn = RolloutWorker.spawn

    def spawn(self):
        seen.setdefault("order", []).append("spawn")
        real_spawn(self)

    class Trainer:  # the trainer's seams train_from_spec uses; a real one needs a live server
        def __init__(self, model, reward_funcs, args, train_dataset, **kw):
            seen.setdefault("order", []).append("trainer")
            self.worker_ahead, self.rollout_worker = None, seen.get("plugin")
            self.run_info, self.final_model_saved = {}, True

        def warm_up_compile(self, until=None):
            seen["ahead_at_warm_up"] = self.worker_ahead

        def train(self, resume_from_checkpoint=None):
            ahead = self.worker_ahead
            seen["alive"] = ahead is not None and ahead.process.is_alive() and not ahead.started
            return "trained"

    class Server:
        base_url = "http://127.0.0.1:1"

        def answers(self):
            return True

    monkeypatch.setattr(RolloutWorker, "spawn", spawn)
    monkeypatch.setattr(asyncgrpo, "AsyncGRPOTrainer", Trainer)
    monkeypatch.setattr(launch, "launch_embedded", lambda stack, model, cfg: Server())
    monkeypatch.setattr(launch, "await_embedded", lambda server: server)
    monkeypatch.setattr(launch, "resolve_model", lambda name: name)
    monkeypatch.setattr(launch, "build_dataset", lambda spec: [{"prompt": "2 + 2?"}])
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, rollout_worker_timeout=77.0)
    spec = RunSpec("tiny", {}, None, (), (), {"embedded": True}, args)
    out, trainer = launch.train_from_spec(spec)
    worker = seen["ahead_at_warm_up"]
    assert out == "trained" and seen["order"] == ["spawn", "trainer"] and seen["alive"]
    assert isinstance(worker, RolloutWorker) and worker is trainer.worker_ahead and worker.heartbeat_timeout == 77.0
    assert not worker.process.is_alive() and worker.process.exitcode == 0  # stopped on the way out
    monkeypatch.setenv("RANK", "1")
    assert launch.train_from_spec(spec)[1].worker_ahead is None  # other ranks: no worker of their own
    monkeypatch.delenv("RANK")
    seen["plugin"] = object()  # a TRL rollout worker generates instead: ours is stopped at once, not adopted
    spawned = []
    monkeypatch.setattr(RolloutWorker, "spawn", lambda self: (spawned.append(self), real_spawn(self)))
    assert launch.train_from_spec(spec)[1].worker_ahead is None
    assert spawned and not spawned[0].process.is_alive() and not seen["alive"]


@pytest.mark.parametrize("how", ["train", "demo"])
def test_the_embedded_server_launches_before_the_configs_imports(monkeypatch, tmp_path, how):
    """``asyncgrpo train`` and ``demo`` launch the embedded server once the YAML's sections are checked, before
    AsyncGRPOConfig's imports (transformers, peft), and the run uses that server; it is stopped on the way out."""
    import yaml

    from asyncgrpo.cli import launch

    order: list[str] = []
    stopped: list[bool] = []
    workers: list = []

    class Server:
        base_url = "http://127.0.0.1:1"

    def launch_embedded(stack, model, cfg):
        order.append("server")
        stack.callback(lambda: stopped.append(True))
        return Server()

    def train_from_spec(spec, resume=None, progress=None, ahead=None):
        order.append("train")
        assert isinstance(ahead.server, Server) and spec.args.max_steps == 2 and not stopped
        assert ahead.worker.process.is_alive() and not ahead.worker.started  # spawned ahead too
        workers.append(ahead.worker)

        class Out:
            global_step = 0

        return Out(), None

    real_import = launch.import_config
    monkeypatch.setattr(launch, "import_config", lambda: (order.append("import_config"), real_import()))
    monkeypatch.setattr(launch, "launch_embedded", launch_embedded)
    monkeypatch.setattr(launch, "train_from_spec", train_from_spec)
    monkeypatch.setattr(launch, "resolve_model", lambda name: name)
    cfg = copy.deepcopy(DEMO_CONFIG)
    cfg["args"].update(output_dir=str(tmp_path), max_steps=2)
    if how == "train":
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(cfg))
        assert launch.run_train(["--config", str(path)]) == 0
    else:
        launch.train_from_config(cfg)
    assert order[0] == "server" and "import_config" in order and order[-1] == "train" and stopped == [True]
    assert workers[0].process.exitcode == 0  # stopped on the way out


def test_a_bad_flag_stops_what_was_started_ahead_without_waiting_for_it(monkeypatch, tmp_path):
    """The server and the worker start before the command line is parsed; a bad flag then ends the run with its
    error, and the worker (mid-import, never given a loop) is terminated rather than waited for."""
    import signal

    import yaml

    from asyncgrpo.cli import launch
    from asyncgrpo.errors import UserError
    from asyncgrpo.rollout.worker import RolloutWorker

    spawned: list = []
    stopped: list[bool] = []
    real_spawn = RolloutWorker.spawn
    monkeypatch.setattr(RolloutWorker, "spawn", lambda self: (spawned.append(self), real_spawn(self)))

    class Server:
        base_url = "http://127.0.0.1:1"

    def launch_embedded(stack, model, cfg):
        stack.callback(lambda: stopped.append(True))
        return Server()

    monkeypatch.setattr(launch, "launch_embedded", launch_embedded)
    monkeypatch.setattr(launch, "resolve_model", lambda name: name)
    cfg = copy.deepcopy(DEMO_CONFIG)
    cfg["args"].update(output_dir=str(tmp_path))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(UserError, match="unknown command-line argument"):
        launch.run_train(["--config", str(path), "--bogus_flag", "1"])
    assert stopped == [True] and len(spawned) == 1
    assert spawned[0].process.exitcode == -signal.SIGTERM

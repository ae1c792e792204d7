"""Help texts a user can read (issue 30, item 8): own options first, config fields in sections, no hidden fields,
no internal tags, no doubled defaults."""

from __future__ import annotations

import logging
import re

import pytest

from asyncgrpo import cli
from asyncgrpo.config import FIELD_SECTIONS, HIDDEN_FIELDS, AsyncGRPOConfig
from asyncgrpo.config_loss import LossFields

TAG = re.compile(r"\b[GRLPTAMX]\d{1,2}\b")  # docs/spec.md's feature IDs


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_every_config_field_is_in_exactly_one_section():
    listed = [name for names in FIELD_SECTIONS.values() for name in names]
    assert len(listed) == len(set(listed))
    own = (set(AsyncGRPOConfig.__annotations__) | set(LossFields.__annotations__)) - HIDDEN_FIELDS
    assert own <= set(listed), own - set(listed)


def test_train_help_puts_its_own_options_first_and_hides_what_the_trainer_ignores(capsys):
    text = _help(capsys, "train")
    lines = text.splitlines()
    assert lines[0] == "usage: asyncgrpo train --config FILE.yaml [options] [--FIELD VALUE ...]"
    assert next(i for i, line in enumerate(lines) if "--config" in line) < 15
    titles = [line[:-1] for line in lines if line and not line.startswith(" ") and line.endswith(":")]
    assert titles == ["options", "asyncgrpo train", *(f"AsyncGRPOConfig: {t}" for t in FIELD_SECTIONS),
                      "other transformers.TrainingArguments fields"]  # fmt: skip
    flags = set(re.findall(r"^  (--[a-z_]+)", text, re.MULTILINE))
    for hidden in ("per_device_train_batch_size", "use_liger_kernel", "resume_from_checkpoint", "deepspeed"):
        assert f"--{hidden}" not in flags
    assert {"--resume", "--max_steps", "--token_budget", "--compact_log", "--warmup_steps"} <= flags
    assert (
        len(lines) < 790
    )  # was 856; 701 with the loss-family, TRL 1.16 and data-side field sections; 763 with cuda_graph_step; 788 with
    # tree_attention_backend


def test_eval_help_lists_model_and_no_training_flags(capsys):
    text = _help(capsys, "eval")
    own = text.split("asyncgrpo eval:\n", 1)[1].split("\n\n", 1)[0]
    assert "--model" in own and "--config" in own and "--resume" not in own and "--log-full" not in own


class _Recorder:
    """Records which config fields a function reads (``server_urls`` is ``vllm_server_base_url`` as a list)."""

    def __init__(self) -> None:
        self.read: set[str] = set()
        self._defaults = AsyncGRPOConfig(output_dir="unused", report_to=[])

    def __getattr__(self, name: str):
        self.read.add("vllm_server_base_url" if name == "server_urls" else name)
        return getattr(self._defaults, name)


def test_eval_help_shows_in_titled_sections_the_fields_eval_reads(capsys, monkeypatch):
    """Issue 44 item 7: eval's help was train's 555 lines; it lists what changes a score, in sections."""
    from asyncgrpo.cli.eval import EVAL_HELP_SECTIONS
    from asyncgrpo.tasks.evaluate import settings_from_config

    monkeypatch.setenv("COLUMNS", "80")
    lines = _help(capsys, "eval").splitlines()
    titles = [line[:-1] for line in lines if line and not line.startswith(" ") and line.endswith(":")]
    assert titles == ["options", "asyncgrpo eval", *EVAL_HELP_SECTIONS, "other fields"]
    flags = {m.group(1) for line in lines if (m := re.match(r"^  --([a-z_]+)", line))}
    shown = {name for names in EVAL_HELP_SECTIONS.values() for name in names}
    assert flags == shown | {"config", "model", "debug"}
    recorder = _Recorder()
    settings_from_config(recorder)
    assert recorder.read <= shown, recorder.read - shown  # every field that changes a score is listed
    assert len(lines) < 100


def test_eval_accepts_a_field_its_help_leaves_out():
    from asyncgrpo.cli.eval import EVAL_HELP_SECTIONS, EVAL_REST_NOTE
    from asyncgrpo.cli.launch import parse_train

    argv = ["--config", "examples/demo.yaml", "--model", "m", "--learning_rate", "1e-4", "--eval_temperature", "0"]
    spec, ns = parse_train(argv, "asyncgrpo eval", None, lambda p: p.add_argument("--model"),
                           (EVAL_HELP_SECTIONS, EVAL_REST_NOTE))  # fmt: skip
    assert (spec.args.learning_rate, spec.args.eval_temperature, ns.model) == (1e-4, 0.0, "m")


@pytest.mark.parametrize("command", ["train", "eval", "serve", "report", "demo"])
def test_help_lines_are_at_most_100_characters(capsys, monkeypatch, command):
    """The --optim line was 644 characters (its 40 choices on the flag line); flag names repeated their value."""
    monkeypatch.setenv("COLUMNS", "80")
    lines = _help(capsys, command).splitlines()
    longest = max(lines, key=len)
    assert len(longest) <= 100, longest
    if command == "train":
        start = next(i for i, line in enumerate(lines) if line.startswith("  --optim "))
        optim = "\n".join(lines[start : start + 20])
        assert "One of: adamw_torch, adamw_torch_fused" in optim and "schedule_free_adamw" in optim


@pytest.mark.parametrize("command", ["train", "eval", "serve", "report", "demo"])
def test_help_has_no_internal_tags_or_doubled_defaults(capsys, command):
    text = _help(capsys, command)
    assert not TAG.search(text), TAG.search(text)
    assert "reference document" not in text
    assert "(default: None)" not in text
    assert not re.search(r"\(default: [^)]*\)\s+\(default:", text)


def test_an_ignored_field_still_parses_and_is_warned_about(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.config"):
        args = AsyncGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[])
    assert args.per_device_train_batch_size == 4
    (line,) = [r.getMessage() for r in caplog.records if "per_device_train_batch_size" in r.getMessage()]
    assert "ignored" in line and "token_budget" in line and "gradient_accumulation_steps" in line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.config"):
        AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[])
    assert not [r for r in caplog.records if "ignored" in r.getMessage()]

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
    assert len(lines) < 700  # was 856; 616 with the loss-family fields (config_loss.py)


def test_eval_help_lists_model_and_no_training_flags(capsys):
    text = _help(capsys, "eval")
    own = text.split("asyncgrpo eval:\n", 1)[1].split("\n\n", 1)[0]
    assert "--model" in own and "--config" in own and "--resume" not in own and "--log-full" not in own


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

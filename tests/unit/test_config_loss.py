"""The loss-family fields (config_loss.py): loss_type's defaults, TRL's aliases, and refusals that name the fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.packing.row import pack_samples
from asyncgrpo.packing.sample import PackSample
from asyncgrpo.rollout.advantages import group_advantages
from asyncgrpo.trainer.packed_loss import loss_settings
from asyncgrpo.trainer.step_rows import split_rows


def _cfg(tmp_path, **kw) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(output_dir=str(tmp_path), **kw)


def test_defaults_keep_the_reference_objective(tmp_path):
    c = _cfg(tmp_path)
    assert (c.loss_type, c.score_centering, c.epsilon_high, c.scale_rewards) == ("asyncgrpo", True, 0.2, "group")
    s = loss_settings(c)
    assert s.family is None and (s.clip_min, s.clip_max) == (0.5, 5.0)  # the masked IS band of L2
    assert (loss_settings(_cfg(tmp_path, vllm_importance_sampling_mode="icepop")).clip_min) == pytest.approx(0.2)
    off = loss_settings(_cfg(tmp_path, vllm_importance_sampling_correction=False))
    assert (off.clip_min, off.clip_max) == (0.0, float("inf"))


def test_loss_type_defaults_and_trl_aliases(tmp_path):
    assert _cfg(tmp_path, loss_type="dapo").epsilon_high == 0.28  # DAPO's clip-higher
    assert _cfg(tmp_path, loss_type="dapo", epsilon_high=0.25).epsilon_high == 0.25
    assert _cfg(tmp_path, loss_type="cispo").epsilon_high == 5.0
    dr = _cfg(tmp_path, loss_type="dr_grpo")
    assert dr.scale_rewards == "none" and dr.score_centering is False
    assert _cfg(tmp_path, scale_rewards=False).scale_rewards == "none"
    assert _cfg(tmp_path, loss_type="grpo", vllm_importance_sampling_cap=3.0).vllm_importance_sampling_clip_max == 3.0
    fam = loss_settings(_cfg(tmp_path, loss_type="GRPO", importance_sampling_level="sequence")).family
    assert fam.loss_type == "grpo" and fam.level == "sequence" and fam.correction.mode == "token_mask"


@pytest.mark.parametrize(
    "kw,fix",
    [
        ({"loss_type": "gspo"}, "importance_sampling_level='sequence' with loss_type='grpo'"),
        ({"loss_type": "ppo"}, "must be one of asyncgrpo, grpo, bnpo, dr_grpo, dapo, cispo"),
        ({"importance_sampling_level": "sequence"}, "for GSPO set loss_type='grpo'"),
        ({"vllm_importance_sampling_mode": "token_truncate"}, "choose a TRL loss_type such as 'dapo'"),
        ({"loss_type": "dapo", "vllm_importance_sampling_mode": "seq"}, "must be one of token_mask, token_truncate"),
        ({"loss_type": "cispo", "epsilon_high": 0.2}, "set epsilon_high=5.0"),
        ({"scale_rewards": "batch"}, "must be 'group' or 'none'"),
        ({"loss_type": "dapo", "vllm_importance_sampling_mode": "icepop", "vllm_importance_sampling_clip_max": 1.0,
          "vllm_importance_sampling_clip_min": 0.5}, "clip_max must be > 1"),
    ],
)  # fmt: skip
def test_invalid_choices_are_refused_with_their_fix(tmp_path, kw, fix):
    with pytest.raises(ValueError, match="problem") as e:
        _cfg(tmp_path, **kw)
    assert fix in str(e.value)


def test_dr_grpo_advantages_are_not_divided_by_the_std():
    r = np.array([1.0, 0.0, 0.0, 1.0, np.nan])
    assert group_advantages(r, scale=False).tolist() == [0.5, -0.5, -0.5, 0.5, 0.0]
    assert group_advantages(r)[0] == pytest.approx(0.5 / np.std([1, 0, 0, 1], ddof=1))


def _row(lengths: list[int]):
    samples = [PackSample([1, 2] + [3] * n, [0, 0] + [1] * n, [0.0] * (n + 2), 1.0, i) for i, n in enumerate(lengths)]
    return pack_samples(samples)


def test_split_rows_normalizers_count_every_process_and_micro_batch():
    # step: micro-batch 1 = rows of 3+2 and 4 tokens (2 + 1 sequences), micro-batch 2 = rows of 1 and 5+5
    packed = [[_row([3, 2]), _row([4])], [_row([1]), _row([5, 5])]]
    norms = {
        t: [mb["normalizer"] for mb in split_rows(packed, 2, 2, t, 8)[0]]
        for t in ("asyncgrpo", "grpo", "dapo", "dr_grpo")
    }
    assert norms["asyncgrpo"] == [9 * 2 / 2, 11 * 2 / 2]
    assert norms["grpo"] == [3 * 2 / 2, 3 * 2 / 2]
    assert norms["dapo"] == [20 / 2, 20 / 2]
    assert norms["dr_grpo"] == [3 * 8 * 2 / 2, 3 * 8 * 2 / 2]
    assert torch.equal(split_rows(packed, 2, 2)[1][0]["row"].target_ids, packed[0][1].target_ids)


def test_the_trl_config_of_usage_md_runs_unchanged():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    block = text.split("### A TRL config that runs unchanged", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(block, scope)  # noqa: S102 - the documented snippet, as a user pastes it
    args = scope["args"]
    fam = loss_settings(args).family
    assert (fam.loss_type, fam.level, fam.correction.mode, fam.correction.clip_max) == (
        "dr_grpo", "token", "sequence_mask", 3.0)  # fmt: skip
    assert args.scale_rewards == "none" and fam.epsilon_high == 0.28

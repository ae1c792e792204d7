"""The run doctor draws eval sets, prompt pools and dynamic sampling from whatever names the run logged."""

from __future__ import annotations

import json

from asyncgrpo.report import PANELS, load_run, write_report


def test_eval_set_and_pool_panels_pick_up_the_runs_own_names(tmp_path):
    rows = []
    for step in range(1, 7):
        rows.append({"step": step, "reward": 0.1 * step, "pools/new/size": 10.0 - step, "pools/hard/size": step,
                     "pools/hard/pass_rate": 0.05, "pools/retired": step // 2, "dynamic_sampling/generated_per_kept": 2.0})  # fmt: skip
        if step % 3 == 0:
            rows.append({"step": step, "eval/sums/reward": 0.3, "eval/sums/pass@1": 0.3, "eval/sums/pass@4": 0.6,
                         "eval/products/pass@1": 0.4, "eval/products/maj@4": 0.5})  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(tmp_path)
    panels = {p.name: p for p in PANELS}
    assert panels["eval_k"].lines(run) == [
        "eval/products/maj@4", "eval/products/pass@1", "eval/sums/pass@1", "eval/sums/pass@4"
    ]  # fmt: skip
    assert panels["eval"].lines(run) == ["eval/sums/reward"]
    assert panels["pools"].lines(run) == ["pools/retired", "pools/hard/size", "pools/new/size"]
    assert panels["pool_pass_rate"].lines(run) == ["pools/hard/pass_rate"]
    write_report(run, tmp_path / "report")
    pngs = {p.stem for p in (tmp_path / "report").glob("*.png")}
    assert {"eval", "eval_k", "pools", "pool_pass_rate", "dynamic_sampling", "reward"} <= pngs
    assert "kv_cache" not in pngs  # a panel with nothing logged is left out

"""The tool warm-up says what it does, at least every HEARTBEAT_S (issue 44 item 5: 75 s without a line)."""

from __future__ import annotations

import itertools
import re
import time

from asyncgrpo.assets.tool_warmup import Transcript, WarmupProgress, warm_up_tool_calls

LINE = re.compile(r"^tool warm-up: (.*) \((\d+) s\)$")


def increment(step: int) -> int:
    """Increment the counter.

    Args:
        step: Value to add to the counter.
    """
    return step


def _example(n: int) -> Transcript:  # docs/agents.md's transcript
    call = '<tool_call>\n{"name": "increment", "arguments": {"step": ' + str(n) + "}}\n</tool_call>"
    messages = [{"role": "user", "content": f"Increment the counter by {n}."}, {"role": "assistant", "content": call},
                {"role": "tool", "content": str(n)}, {"role": "assistant", "content": f"The counter is {n}."}]  # fmt: skip
    return Transcript(messages, tools=[increment])


def test_the_warm_up_prints_each_phase_and_its_steps(tiny_llama_dir, tmp_path):
    lines: list[str] = []
    out = warm_up_tool_calls(str(tiny_llama_dir), [_example(n) for n in (1, 2)], str(tmp_path / "warm"), steps=3,
                             progress=lines.append)  # fmt: skip
    assert out == str(tmp_path / "warm") and (tmp_path / "warm" / "tool_warmup.json").is_file()
    texts = [LINE.match(line)[1] for line in lines]  # every line has the form and the time since the start
    assert texts[0] == f"loading {tiny_llama_dir}"
    assert texts[1] == "3 supervised steps on 2 transcripts, lr 5e-05"
    assert texts[2].startswith("step 1/3, loss ") and any(t.startswith("step 3/3, loss ") for t in texts)
    assert texts[-3] == "checking that the model writes the 2 transcripts' calls (greedy)"
    assert re.fullmatch(rf"the model writes the calls of [0-2] of 2 transcripts; saving to {tmp_path}/warm", texts[-2])
    assert texts[-1] == "done"


def test_a_long_phase_gets_a_line_every_heartbeat(monkeypatch):
    monkeypatch.setattr(WarmupProgress, "HEARTBEAT_S", 0.3)
    stamps: list[tuple[float, str]] = []
    with WarmupProgress(lambda text: stamps.append((time.monotonic(), text))) as shown:
        shown.say("loading m", "loading the model")
        time.sleep(1.6)  # a silent phase: only the heartbeat speaks
        shown.say("done")
    still = [text for _, text in stamps if text.startswith("tool warm-up: still loading the model")]
    assert len(still) >= 3, stamps
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(stamps)]
    assert max(gaps) <= 0.3 + 0.3 / 4 + 0.2, gaps  # the heartbeat plus its polling interval, plus scheduling slack

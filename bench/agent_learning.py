"""An agent that learns, on one H200 (issue 8 acceptance): calculator tool environment, before/after held-out.

    python bench/agent_learning.py --out bench/results/agent_learning_h200.json [--model DIR] [--two-gpus]

Runs ``examples/agent_calculator.py`` (SmolLM2-135M-Instruct, supervised tool-call warm-up, then async GRPO
with ``CalculatorEnv``) inside an 8-minute budget and writes its JSON report: environment reward, answer accuracy
and tool-call success rate on 200 held-out episodes for the base, warmed-up and trained models, and wall time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from agent_calculator import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.result_file
from bench.result_file import write_result

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--out" not in argv:
        argv += ["--out", "bench/results/agent_learning_h200.json"]
    main(argv)
    out = Path(argv[argv.index("--out") + 1])
    if out.is_file():  # the example writes its report; the bench stamps it with commit, date and hardware
        write_result(out, json.loads(out.read_text()))

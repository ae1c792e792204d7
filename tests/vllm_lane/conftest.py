"""The real-vLLM lane's end-to-end tests run only inside the lane (``make test-vllm``): plain ``make test`` does
not even collect them, since they need the lane's vLLM server (``tests/vllm_lane/plugin.py``)."""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("ASYNCGRPO_VLLM_LANE") else ["test_*.py"]

"""Reading vLLM's /version: which releases reuse the last round's update_info metadata (0.33 and later)."""

from __future__ import annotations

import pytest

from asyncgrpo.vllm_traits import release_tuple, reuses_update_metadata


@pytest.mark.parametrize(
    "version,release,reuses",
    [("0.33.0", (0, 33, 0), True), ("0.32.0", (0, 32, 0), False), ("0.32.0+cpu", (0, 32, 0), False),
     ("0.34.1rc1", (0, 34, 1), True), ("1.0.0.dev3", (1, 0, 0), True), ("", (), False), ("dev", (), False)],
)  # fmt: skip
def test_release_tuple_and_metadata_reuse(version, release, reuses):
    assert release_tuple(version) == release
    assert reuses_update_metadata(version) is reuses

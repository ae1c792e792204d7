"""What a vLLM server's informational answers mean: ``/server_info`` sections and ``/version`` numbers.

Pure functions, no I/O and no project imports: the client (KV capacity), the weight sync (metadata reuse, the
checkpoint's path, the transfer backend) and the trainer's set-up all read the same answers, and none of them
may import another's package for it.
"""

from __future__ import annotations

import re
from typing import Any


def config_section(data: Any, *keys: str) -> dict[str, Any]:
    """``data[k1][k2]...`` when every level is a dict, else ``{}`` (servers differ in what they expose)."""
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    return data if isinstance(data, dict) else {}


# vLLM 0.33 reads empty update_info lists as "the last round's metadata again"; 0.32's NCCLWeightTransferUpdateInfo
# has no such rule and receives zero tensors, so a sender reusing metadata there broadcasts into the void.
METADATA_REUSE_SINCE = (0, 33)


def release_tuple(version: str) -> tuple[int, ...]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``: the leading numeric parts of a ``/version`` answer (``()`` if none)."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.end() < len(piece):  # "1rc1": a pre-release tag ends the release number
            break
    return tuple(parts)


def reuses_update_metadata(version: str) -> bool:
    """Whether a server of this ``/version`` takes empty ``update_info`` lists as the last round's metadata."""
    return release_tuple(version) >= METADATA_REUSE_SINCE

"""The JSON library of both ends of the generation protocol: orjson when installed, else the standard library.

A GRPO answer carries ~10 numbers per generated token; decoding them with :mod:`json` costs about 1.6x what
orjson costs, and writing float32 log-probs as their shortest text needs orjson's float32 writer (the
standard library only writes doubles). Both libraries read and write the same JSON, so the wire format does not
depend on which one is installed; ``ASYNCGRPO_JSON=stdlib`` forces the standard library (tests compare the two).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

try:
    if os.environ.get("ASYNCGRPO_JSON", "").lower() == "stdlib":
        raise ImportError("ASYNCGRPO_JSON=stdlib")
    import orjson

    if not hasattr(orjson, "Fragment"):  # before 3.9: no way to splice pre-encoded text
        raise ImportError("orjson < 3.9")
except ImportError:
    orjson = None  # type: ignore[assignment]

LIBRARY = "orjson" if orjson is not None else "json"


def loads(body: bytes | str) -> Any:
    """Decode one JSON document (raises ``ValueError`` on bad JSON with either library)."""
    if orjson is not None:
        return orjson.loads(body)
    return json.loads(body)


def dumps(data: Any) -> bytes:
    """Compact UTF-8 JSON of ``data`` (a request body): the same JSON value :func:`json.dumps` writes.

    orjson writes a generation request in a few microseconds where the standard library takes ~40. Whatever
    orjson refuses (an integer past 64 bits, a numpy float64, an unusual key type) goes to the standard library,
    so every body the standard library could write still goes out. The texts may differ in spelling only
    (orjson writes non-ASCII characters as UTF-8, not ``\\u`` escapes); NaN and infinity, which JSON has no
    spelling for, go out as ``null`` from orjson and as ``NaN`` from the standard library.
    """
    if orjson is not None:
        try:
            return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)
        except TypeError:  # orjson.JSONEncodeError
            pass
    return json.dumps(data, separators=(",", ":")).encode()


def float32_texts(values: np.ndarray) -> list[str] | None:
    """The shortest decimal text of each float32 value (reads back as the same float32), or None without orjson.

    ``values`` must be a finite float32 array; one C call writes them all, one split cuts them apart.
    """
    if orjson is None:
        return None
    if not len(values):
        return []
    return orjson.dumps(values, option=orjson.OPT_SERIALIZE_NUMPY).decode()[1:-1].split(",")

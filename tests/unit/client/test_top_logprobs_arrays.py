"""The array parse of ``/v1/completions`` top-N rows and ``TopLogprobs.best`` against references written out here.

References: each row's ``{id: log-prob}`` dict read key by key with ``int`` (vLLM's -9999.0 as -inf, null as NaN),
and its best ``n`` entries by a stable Python sort on (NaN last, higher log-prob first), padded with -1 / -inf.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from asyncgrpo.client.results import parse_completion_choice
from asyncgrpo.client.top_logprobs import TopLogprobs, completion_top_arrays
from asyncgrpo.errors import ServerError


def _reference_rows(rows: list[dict]) -> list[dict[int, float]]:
    def value(v):
        return math.nan if v is None else -math.inf if v <= -9999.0 else float(v)

    return [{int(k[len("token_id:") :]): value(v) for k, v in row.items()} for row in rows]


def _reference_best(rows: list[dict[int, float]], n: int) -> tuple[list[list[int]], list[list[float]]]:
    ids, values = [], []
    for row in rows:
        ranked = sorted(row.items(), key=lambda kv: (math.isnan(kv[1]), -kv[1] if not math.isnan(kv[1]) else 0.0))
        ranked = ranked[:n] + [(-1, -math.inf)] * (n - len(ranked[:n]))
        ids.append([i for i, _ in ranked])
        values.append([v for _, v in ranked])
    return ids, values


def _same(a: list[list[float]], b: list[list[float]]) -> bool:
    """Equal row by row, NaN equal to NaN (float lists compare NaN unequal)."""
    return len(a) == len(b) and all(np.array_equal(np.array(x, dtype=np.float64), np.array(y, dtype=np.float64),
                                                   equal_nan=True) for x, y in zip(a, b))  # fmt: skip


def _rows(rng: random.Random, positions: int, width: int, odd: bool) -> list[dict]:
    """Random answer rows: ``width`` entries, some positions one more (the sampled token) or none; rows sorted best
    first or shuffled; with ``odd``, ties, -9999.0 and null values."""
    rows = []
    for _ in range(positions):
        k = rng.choice([width, width, width + 1, 0 if odd else width, 1])
        ids = rng.sample(range(1, 5000), k)
        values = [-rng.random() * 5 for _ in range(k)]
        if odd and k > 1:
            values[rng.randrange(k)] = rng.choice([-9999.0, None, values[0]])
        if rng.random() < 0.5:
            pairs = sorted(zip(ids, values), key=lambda p: -math.inf if p[1] is None else p[1], reverse=True)
            ids, values = [i for i, _ in pairs], [v for _, v in pairs]
        rows.append({f"token_id:{i}": v for i, v in zip(ids, values)})
    return rows


@pytest.mark.parametrize("odd", [False, True])
def test_array_parse_and_best_match_the_per_key_reference(odd):
    rng = random.Random(7 + odd)
    for trial in range(40):
        rows = _rows(rng, rng.choice([1, 3, 16, 40]), rng.choice([2, 8]), odd)
        top = completion_top_arrays(rows)
        assert isinstance(top, TopLogprobs)
        ref = _reference_rows(rows)
        assert [list(d) for d in top] == [list(d) for d in ref]  # ids in the answer's order
        assert _same([list(d.values()) for d in top], [list(d.values()) for d in ref])
        for n in (1, 4, 8, 12):
            ids, values = top.best(n)
            ref_ids, ref_values = _reference_best(ref, n)
            assert ids.tolist() == ref_ids, (trial, n)
            assert _same(values.tolist(), ref_values), (trial, n)


def test_sortable_says_whether_an_entry_is_minus_inf_or_nan():
    assert completion_top_arrays([{"token_id:3": -0.5, "token_id:4": -1.0}, {"token_id:5": -0.1}]).sortable
    assert not completion_top_arrays([{"token_id:3": -9999.0, "token_id:4": -1.0}]).sortable
    assert not completion_top_arrays([{"token_id:3": None, "token_id:4": -1.0}]).sortable


def test_unusual_spellings_are_read_as_int_reads_them_and_odd_keys_go_to_the_per_key_path():
    """Keys spelled otherwise than ``token_id:<digits>`` (leading zero, sign, space) read as ``int`` reads them; two
    spellings of one id are refused by name; a key that holds a comma or a second prefix, or lacks one, is not
    read as two ids (the per-key path names it)."""
    rows = [{"token_id:07": -0.5, "token_id:+3": -0.7}, {"token_id: 12": -0.2}]
    assert list(completion_top_arrays(rows)) == [{7: -0.5, 3: -0.7}, {12: -0.2}]
    choice = {"token_ids": [7, 4], "finish_reason": "length",
              "logprobs": {"token_logprobs": [-0.5, -0.3], "top_logprobs": [{"token_id:7": -0.5, "token_id:007": -0.6},
                                                                             {"token_id:4": -0.3}]}}  # fmt: skip
    with pytest.raises(ServerError, match="name one token id twice"):
        parse_completion_choice(choice)
    for odd in ([{"token_id:1,token_id:2": -0.1}, {"token_id:": -0.2}],  # read whole, the comma would make 2 ids
                [{"token_id:1token_id:2": -0.1}], [{"5": -0.1, "token_id:1": -0.2}], [{"token_id:1": -0.1, "x": -1.0}],
                [{"token_id:5.5": -0.1}], [{"token_id:": -0.1}]):  # fmt: skip
        assert completion_top_arrays(odd) is None, odd
        choice["logprobs"]["top_logprobs"] = odd + [{}] * (2 - len(odd))
        with pytest.raises((ServerError, ValueError)):
            parse_completion_choice(choice)


def test_best_pads_when_rows_are_narrower_than_n_and_keeps_ties_in_answer_order():
    top = completion_top_arrays([{"token_id:1": -0.5, "token_id:2": -0.25, "token_id:3": -0.5}, {}])
    ids, values = top.best(4)
    assert ids.tolist() == [[2, 1, 3, -1], [-1, -1, -1, -1]]
    assert values.tolist() == [[-0.25, -0.5, -0.5, -math.inf], [-math.inf] * 4]

"""The answer path's arrays: top-N packed between server processes (``PackedTop``), parsed by the client
(``TopLogprobs``) and trained from (``[L, K]`` arrays in ``TrainingSequence``).

References: the per-position lists and dicts they stand for, written out here or built by the list paths.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from asyncgrpo.client.results import parse_completion_choice
from asyncgrpo.server.engine.request import RequestOutput
from asyncgrpo.server.http.protocol import (
    ParsedCompletion,
    ParsedRequest,
    completion_response,
    encode_json,
    generate_response,
)
from tests.helpers.answers import engine_output, float32_output


def test_array_backed_top_logprobs_read_like_dicts_and_fall_back_on_odd_rows():
    """TopLogprobs: indexing, slicing, iteration and == as the list of dicts; null rows or odd keys take the
    per-key path (which names a bad key), and two spellings of one id are refused."""
    from asyncgrpo.client.results import TopLogprobs
    from asyncgrpo.errors import ServerError

    rows = [{"token_id:7": -0.25, "token_id:1": -2.0, "token_id:3": -9999.0}, {}, {"token_id:4": None}]
    choice = {"token_ids": [7, 5, 4], "finish_reason": "length",
              "logprobs": {"token_logprobs": [-0.25, -1.0, -3.0], "top_logprobs": rows}}  # fmt: skip
    top = parse_completion_choice(choice).top_logprobs
    assert isinstance(top, TopLogprobs) and len(top) == 3
    assert top[0] == {7: -0.25, 1: -2.0, 3: -math.inf} and top[1] == {} and top[-2:][0] == {}
    assert math.isnan(top[2][4]) and list(top)[:2] == [top[0], {}] and top[:1] == [top[0]]
    ids, values = top.best(2)
    assert ids.tolist() == [[7, 1], [-1, -1], [4, -1]] and values[0].tolist() == [-0.25, -2.0]
    choice["logprobs"]["top_logprobs"] = [rows[0], None, rows[2]]  # vLLM writes null for a position without
    slow = parse_completion_choice(choice).top_logprobs
    assert not isinstance(slow, TopLogprobs) and slow[:2] == [top[0], {}] and math.isnan(slow[2][4])
    choice["logprobs"]["top_logprobs"] = [{"token_id:7": -0.1, "token_id:07": -0.1}, {}, {}]
    with pytest.raises(ServerError, match="name one token id twice"):
        parse_completion_choice(choice)
    choice["logprobs"]["top_logprobs"] = [{"token_id:7x": -0.1}, {}, {}]
    with pytest.raises(ValueError):
        parse_completion_choice(choice)


def test_validate_checks_top_n_arrays_and_names_the_position():
    """[L, K] top-N arrays (padding: id -1 with log-prob -inf) pass validate; a bad value names its position,
    padding that disagrees between ids and log-probs is refused, and so is a shape that does not match."""
    from asyncgrpo.types import TrainingSequence

    ids = np.array([[-1, -1], [-1, -1], [2, 3], [4, -1]])
    lps = np.array([[-np.inf, -np.inf], [-np.inf, -np.inf], [-0.1, -0.5], [-1.0, -np.inf]], dtype=np.float32)

    def seq(i=ids, lp=lps):
        return TrainingSequence(input_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], sampler_logprobs=[0.0, 0.0, -0.5, -1.0],
                                advantage=1.0, model_version=0, group_id=0, row_index=0, sampler_top_ids=i,
                                sampler_top_logprobs=lp)  # fmt: skip

    seq().validate()
    bad = lps.copy()
    bad[3, 0] = 0.5
    with pytest.raises(ValueError, match=r"sampler_top_logprobs\[3\] holds a value"):
        seq(lp=bad).validate()
    bad = lps.copy()
    bad[3, 1] = -2.0  # a value under padding id -1
    with pytest.raises(ValueError, match="id -1 exactly where the log-prob is -inf"):
        seq(lp=bad).validate()
    with pytest.raises(ValueError, match="sampler_top_ids has 3 entries"):
        seq(i=ids[:3]).validate()


def test_packed_top_reads_like_the_pairs_it_packs_and_pickles_small():
    """What the server hands an answer helper: the same pairs (ids exact), pickled as arrays."""
    import pickle

    from asyncgrpo.server.engine.packed_top import PackedTop

    top = float32_output(2, 50, 8).top_logprobs
    top[3] = []  # a position without entries
    packed = PackedTop.pack(top)
    assert len(packed) == 50 and packed == top and list(packed) == top
    assert packed[3] == [] and packed[-1] == top[-1] and packed[10:12] == top[10:12]
    with pytest.raises(IndexError):
        packed[50]
    again = pickle.loads(pickle.dumps(packed))
    assert again == top and PackedTop.pack(again) is again
    assert isinstance(again.ids, np.ndarray) and isinstance(again.values, np.ndarray)  # bytes, no per-entry objects


def test_packed_outputs_give_the_same_answers_as_the_engines_lists():
    """What crosses a process boundary packed (engine process -> API, API -> helper) answers exactly like the
    engine's own per-position lists: short and long answers, and the dict path of non-finite log-probs."""
    import dataclasses

    from asyncgrpo.server.engine.packed_top import PackedTop, packed_output

    outs = [float32_output(4, 60, 8), float32_output(5, 6, 8), engine_output(random.Random(6), 40, 8),
            RequestOutput("r", [1], [5, 6], [-math.inf, -0.5], "length", None, [[(5, -math.inf)], [(7, math.nan)]])]  # fmt: skip
    completion = ParsedCompletion("c", "m", None, [1], [], 8, return_token_ids=True, return_tokens_as_token_ids=True)
    generate = ParsedRequest("g", "m", None, [1], [], 8)
    for outputs in ([o] for o in outs):
        shipped = packed_output(outputs[0])  # what the engine process sends: packed from 256 entries on
        assert isinstance(shipped.top_logprobs, PackedTop) == (sum(map(len, outputs[0].top_logprobs)) >= 256)
        packed = [dataclasses.replace(o, top_logprobs=PackedTop.pack(o.top_logprobs)) for o in outputs]
        for build in (lambda x: completion_response(completion, x, lambda ids: ""),
                      lambda x: generate_response(generate, x)):  # fmt: skip
            a, b = json.loads(encode_json(build(outputs))), json.loads(encode_json(build(packed)))
            a.pop("created"), b.pop("created")
            assert repr(a) == repr(b)  # repr: NaN-safe equality of the nested values

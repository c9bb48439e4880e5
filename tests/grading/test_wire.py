"""Reading wire data is safe and bounded (issue 37, part B): whatever text a kernel sends, ``loads``
returns values or raises ``WireError`` — quickly, and without crashing the judge.

The attacks: sets and dicts of keys that all hash alike (building them would take quadratic time),
tensors of dtypes ``torch.frombuffer`` must never see (quantized ones crash the process), devices
and dtypes torch rejects with its own errors, and malformed bodies of every tag.
"""

from __future__ import annotations

import base64
import json
import time

import numpy as np
import pytest
import torch

from gpucourse.grading import wire

P = 2**61 - 1                                   # CPython hashes an int modulo this prime: k·P hash to 0


def text_of(node) -> str:
    return json.dumps({"wire": 1, "value": node})


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --- keys that all hash alike -------------------------------------------------------------------

def colliding_ints(megabytes: float) -> list[int]:
    """Distinct ints that share one hash, filling about ``megabytes`` of JSON."""
    n = int(megabytes * 2**20) // len(str(P * 10**6))
    return [P * k for k in range(1, n + 1)]


@pytest.mark.parametrize("shape", ["set", "dict with int keys", "dict with tuple keys"])
def test_keys_that_hash_alike_are_refused_at_once(shape):
    keys = colliding_ints(1)[:20_000]             # building them would take seconds (a 5 MB set: hours)
    assert len({hash(k) for k in keys}) == 1 and len(keys) == 20_000
    node = {"set": {"$s": keys},
            "dict with int keys": {"$d": [[k, 0] for k in keys]},
            "dict with tuple keys": {"$d": [[{"$t": [k]}, 0] for k in keys]}}[shape]
    text = text_of(node)
    started = time.process_time()
    with pytest.raises(wire.WireError, match="share one hash value"):
        wire.loads(text)
    assert time.process_time() - started < 1.0


def test_a_5_mb_set_of_alike_ints_is_refused_in_well_under_a_second():
    text = text_of({"$s": colliding_ints(5)})
    assert len(text) > 5 * 10**6
    started = time.process_time()
    with pytest.raises(wire.WireError):
        wire.loads(text)
    assert time.process_time() - started < 1.0


def test_a_few_alike_keys_and_large_honest_sets_still_read():
    few = colliding_ints(0.001)[: wire.MAX_SAME_HASH] + [-1, -2]        # hash(-1) == hash(-2) too
    assert wire.loads(text_of({"$s": few})) == set(few)
    big = set(range(wire.MAX_KEYS))
    assert wire.loads(wire.dumps(big)) == big
    pairs = {(i, str(i)): i for i in range(1000)}
    assert wire.loads(wire.dumps(pairs)) == pairs


def test_too_many_elements_are_refused():
    with pytest.raises(wire.WireError, match="at most"):
        wire.loads(text_of({"$s": list(range(wire.MAX_KEYS + 1))}))
    with pytest.raises(wire.WireError, match="at most"):
        wire.loads(text_of({"$d": [[i, i] for i in range(wire.MAX_KEYS + 1)]}))


# --- tensors and arrays: only plain dtypes ------------------------------------------------------

ALL_TORCH_DTYPES = sorted({str(v).removeprefix("torch.") for v in vars(torch).values()
                           if isinstance(v, torch.dtype)})


@pytest.mark.parametrize("name", [n for n in ALL_TORCH_DTYPES if n not in wire.TENSOR_DTYPES]
                         + ["qint8", "quint8", "qint32", "quint4x2", "__class__", "Tensor", "float"])
def test_tensors_of_other_dtypes_are_refused(name):
    node = {"$tensor": {"dtype": name, "shape": [4], "data": b64(bytes(16))}}
    with pytest.raises(wire.WireError, match="not wire data"):
        wire.loads(text_of(node))


def test_the_whitelist_is_torch_dtypes_that_round_trip():
    assert {"qint8", "quint8"} <= set(ALL_TORCH_DTYPES) and not {"qint8", "quint8"} & wire.TENSOR_DTYPES
    for name in sorted(wire.TENSOR_DTYPES):
        dtype = getattr(torch, name)
        t = (torch.arange(6) % 2).to(dtype).reshape(2, 3)
        back = wire.loads(wire.dumps(t))
        assert back.dtype == dtype and torch.equal(back, t), name
        empty = wire.loads(wire.dumps(torch.empty(0, 3, dtype=dtype)))
        assert empty.shape == (0, 3) and empty.dtype == dtype


def test_bool_bytes_other_than_0_and_1_read_as_true():
    node = {"$tensor": {"dtype": "bool", "shape": [3], "data": b64(bytes([2, 0, 255]))}}
    assert wire.loads(text_of(node)).tolist() == [True, False, True]
    node = {"$ndarray": {"dtype": "|b1", "shape": [3], "data": b64(bytes([2, 0, 255]))}}
    assert wire.loads(text_of(node)).tolist() == [True, False, True]


@pytest.mark.parametrize("dtype", ["O", "|O", "V8", "<M8[s]", "<m8[s]", "<U2", "|S4", "(2,)<i4",
                                   "[('a','<i4')]", "i4,i4", 5, None, "<f8" * 5])
def test_arrays_of_other_dtypes_are_refused(dtype):
    node = {"$ndarray": {"dtype": dtype, "shape": [1], "data": b64(bytes(8))}}
    with pytest.raises(wire.WireError):
        wire.loads(text_of(node))


def test_plain_arrays_round_trip():
    for dtype in ["bool", "int8", "uint16", ">i4", "<f2", "float64", "complex128"]:
        a = (np.arange(6) % 3).astype(dtype).reshape(3, 2)
        back = wire.loads(wire.dumps(a))
        assert back.dtype == a.dtype and (back == a).all(), dtype


# --- every failure is a WireError --------------------------------------------------------------

MALFORMED = {
    "device garbage": {"$device": "garbage"},
    "device of a negative index": {"$device": "cuda:-5"},
    "device not a string": {"$device": [1]},
    "dtype garbage": {"$dtype": "not_a_dtype"},
    "dtype a private name": {"$dtype": "__dict__"},
    "tensor not an object": {"$tensor": 5},
    "tensor shape negative": {"$tensor": {"dtype": "float32", "shape": [-1], "data": ""}},
    "tensor shape huge": {"$tensor": {"dtype": "float32", "shape": [2**62, 0], "data": ""}},
    "tensor shape too many dims": {"$tensor": {"dtype": "float32", "shape": [1] * 100,
                                               "data": b64(bytes(4))}},
    "tensor data short": {"$tensor": {"dtype": "float32", "shape": [2], "data": b64(bytes(4))}},
    "tensor data not base64": {"$tensor": {"dtype": "float32", "shape": [1], "data": "@@@@"}},
    "array shape a string": {"$ndarray": {"dtype": "<f4", "shape": "3", "data": ""}},
    "complex of one number": {"$c": [1]},
    "complex of strings": {"$c": ["a", "b"]},
    "float name": {"$f": "nope"},
    "pairs not pairs": {"$d": [[1]]},
    "unhashable key": {"$d": [[{"a": 1}, 2]]},
    "unhashable element": {"$s": [{"$s": [1]}]},
    "a list where an object is due": {"$raised": [1, 2]},
    "deep nesting": json.loads("[" * 200 + "]" * 200),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_data_is_a_wire_error(name):
    with pytest.raises(wire.WireError):
        wire.loads(text_of(MALFORMED[name]))


def test_an_unexpected_failure_while_reading_is_a_wire_error(monkeypatch):
    def broken(spec):
        raise KeyError("something torch did not expect")

    monkeypatch.setattr(wire, "_decode_tensor", broken)
    with pytest.raises(wire.WireError, match="KeyError"):
        wire.loads(wire.dumps(torch.zeros(2)))

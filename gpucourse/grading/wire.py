"""Values as data: what a student's kernel sends to the grader, in a format that cannot run code.

A check's inputs travel from the judge to the student's kernel, and the student's results travel
back, as JSON text built by :func:`dumps` and read by :func:`loads`. Reading never imports a class
named in the data, never unpickles, never calls ``eval``: it builds only ``None``, ``bool``, ``int``,
``float``, ``complex``, ``str``, ``bytes``, ``list``, ``tuple``, ``dict``, ``set``, tensors and numpy
arrays (from raw bytes, with a known dtype) and the three plain records below. So a submission can
send *wrong* values, never *code*, into the process that decides its grade.

::

    kernel:  value ──dumps──► JSON text ──(engine / pipe)──► judge:  loads ──► value ──► compare

Encoding (tagged JSON objects for what JSON lacks):

==================  ================================================================
``tuple``           ``{"$t": [...]}``          (a named tuple is a tuple)
``dict``            a JSON object when every key is a ``str`` not starting with ``$``,
                    else ``{"$d": [[key, value], ...]}``
``set``             ``{"$s": [...]}``
``float``           a JSON number; ``{"$f": "nan" | "inf" | "-inf"}``
``complex``         ``{"$c": [real, imag]}``
``bytes``           ``{"$b": base64}``
tensor / ndarray    ``{"$tensor": {"dtype", "shape", "data": base64}}`` (``"$ndarray"`` alike)
``torch.dtype``     ``{"$dtype": "float32"}``; ``torch.device``: ``{"$device": "cpu"}``
an exception        ``{"$raised": {...}}`` → :class:`Raised` (see :func:`raised`)
a dataclass         ``{"$record": {"type": name, "fields": {...}}}`` → :class:`Record`
an ``nn.Module``    a :class:`Record` whose fields are its ``state_dict()``
anything else       ``{"$opaque": {"type": name, "repr": ...}}`` → :class:`Opaque`
==================  ================================================================

Example::

    >>> text = dumps({"rank": 1, "sizes": (2, 3), "x": float("nan")})
    >>> loads(text)["sizes"], loads(text)["x"] != loads(text)["x"]
    ((2, 3), True)
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import math
import sys

__all__ = ["MAX_BYTES", "Opaque", "Raised", "Record", "WireError", "dumps", "encode", "loads", "pack", "raised"]

#: the largest text :func:`dumps` writes and :func:`loads` reads (a check's values, one slot)
MAX_BYTES = 16 << 20
_MAX_DEPTH = 64
#: the most elements one set (or keys one dict with non-``str`` keys) may hold in wire data
MAX_KEYS = 100_000
#: the most distinct keys of one set or dict that may share a ``hash()`` (more: an attack on the
#: hash table, which would make building it quadratic)
MAX_SAME_HASH = 8
#: the tensor dtypes wire data may hold (no quantized, float8, … tensors: they are not read)
TENSOR_DTYPES = frozenset({"float16", "float32", "float64", "bfloat16", "complex64", "complex128",
                           "int8", "int16", "int32", "int64", "uint8", "bool"})
#: the numpy dtype kinds wire data may hold: bool, signed, unsigned, float, complex (plain, native
#: or byte-swapped; never object, structured, void, string or datetime arrays)
ARRAY_KINDS = frozenset("biufc")
_MAX_DIMS = 32


class WireError(ValueError):
    """A value that cannot be sent (too deep, too large) or text that is not valid wire data."""


@dataclasses.dataclass(frozen=True)
class Raised:
    """A call that raised instead of returning: the exception's class name, its bases, its message.

    ``remote_type`` is the exception a *rank* raised when the kernel saw a ``gc.WorkerError``.
    """

    type: str
    mro: tuple = ()
    message: str = ""
    remote_type: str | None = None

    def is_a(self, name: str) -> bool:
        """True if the exception was a ``name`` (or a subclass of it), on a rank included."""
        return name in self.mro or name == self.remote_type

    @property
    def not_implemented(self) -> bool:
        return self.is_a("NotImplementedError")

    def __str__(self) -> str:
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{self.type}: {first}" if first else self.type


@dataclasses.dataclass(frozen=True)
class Record:
    """A dataclass instance or a module, as its type name and fields."""

    type: str
    fields: dict


@dataclasses.dataclass(frozen=True)
class Opaque:
    """A value of a type the wire does not carry: only its type name and (cut) repr arrive."""

    type: str
    repr: str


def raised(exc: BaseException) -> Raised:
    """The :class:`Raised` record of an exception. A rank's exception relayed by the kernel (a
    ``gc.WorkerError``'s ``exc_type``, a ``gc.RankError``'s ``exc_types``) is kept as ``remote_type``."""
    mro = tuple(c.__name__ for c in type(exc).__mro__ if c is not object)
    remote = getattr(exc, "exc_type", None)
    if remote is None and isinstance(getattr(exc, "exc_types", None), dict):
        remote = next((t for _, t in sorted(exc.exc_types.items()) if t), None)
    return Raised(type(exc).__name__, mro, str(exc)[:4000], remote if isinstance(remote, str) else None)


# --- encoding -----------------------------------------------------------------------------------

def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _tensor(t) -> dict:
    import torch

    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise WireError(f"cannot send a {t.layout} / quantized / meta tensor; send a dense tensor")
    t = t.detach().to("cpu").contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"$tensor": {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "data": _b64(data)}}


def _encode(v, depth: int):
    if depth > _MAX_DEPTH:
        raise WireError(f"the value is nested more than {_MAX_DEPTH} levels deep")
    d = depth + 1
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, enum.Enum):
        return {"$opaque": {"type": type(v).__name__, "repr": f"{type(v).__name__}.{v.name}"}}
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v) if math.isfinite(v) else {"$f": repr(float(v))}
    if isinstance(v, complex):
        return {"$c": [_encode(v.real, d), _encode(v.imag, d)]}
    if isinstance(v, (bytes, bytearray)):
        return {"$b": _b64(bytes(v))}
    if isinstance(v, BaseException):
        return {"$raised": dataclasses.asdict(raised(v))}
    if isinstance(v, Raised):
        return {"$raised": dataclasses.asdict(v)}
    if isinstance(v, (Record, Opaque)):
        key = "$record" if isinstance(v, Record) else "$opaque"
        return {key: {"type": v.type, **({"fields": _encode(v.fields, d)} if isinstance(v, Record)
                                         else {"repr": v.repr})}}
    if isinstance(v, tuple):                                     # torch.Size and named tuples too
        return {"$t": [_encode(x, d) for x in v]}
    if isinstance(v, list):
        return [_encode(x, d) for x in v]
    if isinstance(v, (set, frozenset)):
        return {"$s": [_encode(x, d) for x in v]}
    if isinstance(v, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in v):
            return {k: _encode(x, d) for k, x in v.items()}
        return {"$d": [[_encode(k, d), _encode(x, d)] for k, x in v.items()]}
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(v, torch.Tensor):
            return _tensor(v)
        if isinstance(v, torch.dtype):
            return {"$dtype": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"$device": str(v)}
        if isinstance(v, torch.nn.Module):
            return {"$record": {"type": type(v).__name__, "fields": _encode(dict(v.state_dict()), d)}}
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(v, np.generic):
            return _encode(v.item(), d)
        if isinstance(v, np.ndarray):
            a = np.ascontiguousarray(v)
            if a.dtype.hasobject:
                return _encode(a.tolist(), d)
            return {"$ndarray": {"dtype": a.dtype.str, "shape": list(a.shape), "data": _b64(a.tobytes())}}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        fields = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
        return {"$record": {"type": type(v).__name__, "fields": _encode(fields, d)}}
    try:
        text = repr(v)
    except Exception as e:  # noqa: BLE001 - a broken __repr__ is still a value we can name
        text = f"<repr failed: {type(e).__name__}>"
    return {"$opaque": {"type": type(v).__name__, "repr": text[:300]}}


def encode(value):
    """``value`` as a JSON-able node (what :func:`pack` puts together): a snapshot taken now."""
    return _encode(value, 0)


def pack(nodes: list) -> str:
    """Wire text of a list of :func:`encode` d nodes (``loads`` gives back the list of values)."""
    return _text(list(nodes))


def dumps(value) -> str:
    """``value`` as wire text (JSON). Raises :class:`WireError` beyond :data:`MAX_BYTES`."""
    return _text(_encode(value, 0))


def _text(node) -> str:
    text = json.dumps({"wire": 1, "value": node}, separators=(",", ":"), allow_nan=False)
    if len(text) > MAX_BYTES:
        raise WireError(f"the values take {len(text) >> 20} MB as data, more than the "
                        f"{MAX_BYTES >> 20} MB a check may send")
    return text


# --- decoding -----------------------------------------------------------------------------------

_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _bytes(s) -> bytes:
    if not isinstance(s, str):
        raise WireError("bytes must be base64 text")
    try:
        return base64.b64decode(s.encode("ascii"), validate=True)
    except ValueError as e:
        raise WireError(f"bad base64: {e}") from None


def _shape(shape) -> list[int]:
    if (not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_BYTES * 8 for n in shape)):
        raise WireError(f"bad shape {_cut(shape)} (at most {_MAX_DIMS} sizes, each an int from 0 to "
                        f"{MAX_BYTES * 8})")
    return shape


def _cut(v, limit: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _decode_tensor(spec: dict):
    import torch

    name = spec.get("dtype")
    if not isinstance(name, str) or name not in TENSOR_DTYPES:
        raise WireError(f"tensor dtype {_cut(name)} is not wire data "
                        f"(one of {', '.join(sorted(TENSOR_DTYPES))})")
    dtype = getattr(torch, name)
    shape, data = _shape(spec.get("shape")), _bytes(spec.get("data"))
    numel = math.prod(shape)
    if len(data) != numel * dtype.itemsize:
        raise WireError(f"tensor data of {len(data)} bytes does not fit shape {shape} of {name}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:                      # any byte but 0 is True (as numpy reads it), never a
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)   # bool byte torch has no value for
        return (raw != 0).reshape(shape)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape).clone()


def _decode_ndarray(spec: dict):
    import numpy as np

    name = spec.get("dtype")
    try:
        if not isinstance(name, str) or len(name) > 8:
            raise TypeError(name)
        dtype = np.dtype(name)
    except Exception:  # noqa: BLE001 - numpy raises TypeError, ValueError, SyntaxError … for odd names
        raise WireError(f"unknown array dtype {_cut(name)}") from None
    if dtype.kind not in ARRAY_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise WireError(f"array dtype {_cut(name)} is not wire data (bool, int, uint, float or complex only)")
    shape, data = _shape(spec.get("shape")), _bytes(spec.get("data"))
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise WireError(f"array data of {len(data)} bytes does not fit shape {shape} of {dtype}")
    if dtype.kind == "b":                        # any byte but 0 is True, as for tensors
        return np.frombuffer(data, dtype=np.uint8).reshape(shape) != 0
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def _decode(v, depth: int):
    if depth > _MAX_DEPTH + 2:
        raise WireError("wire data nested too deeply")
    d = depth + 1
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_decode(x, d) for x in v]
    if not isinstance(v, dict):
        raise WireError(f"not wire data: {type(v).__name__}")
    if len(v) != 1 or not next(iter(v)).startswith("$"):
        return {k: _decode(x, d) for k, x in v.items()}
    (tag, body), = v.items()
    if tag == "$t":
        return tuple(_decode(x, d) for x in _list(body))
    if tag == "$s":
        return set(_keys([_decode(x, d) for x in _capped(_list(body), "set")], "set"))
    if tag == "$d":
        pairs = _capped(_pairs(body), "dict")
        keys = _keys([_decode(p[0], d) for p in pairs], "dict")
        return dict(zip(keys, (_decode(p[1], d) for p in pairs), strict=True))
    if tag == "$f":
        if body not in _FLOATS:
            raise WireError(f"bad float {body!r}")
        return _FLOATS[body]
    if tag == "$c":
        re_, im = _list(body) if len(_list(body)) == 2 else (None, None)
        if not all(isinstance(x, (int, float)) for x in (re_, im)):
            raise WireError("bad complex")
        return complex(re_, im)
    if tag == "$b":
        return _bytes(body)
    if tag == "$tensor":
        return _decode_tensor(_obj(body))
    if tag == "$ndarray":
        return _decode_ndarray(_obj(body))
    if tag == "$dtype":
        import torch

        dtype = getattr(torch, body, None) if isinstance(body, str) and not body.startswith("_") else None
        if not isinstance(dtype, torch.dtype):
            raise WireError(f"unknown dtype {_cut(body)}")
        return dtype
    if tag == "$device":
        import torch

        if not isinstance(body, str) or len(body) > 40:
            raise WireError(f"bad device {_cut(body)}")
        try:
            return torch.device(body)
        except Exception:  # noqa: BLE001 - torch raises RuntimeError for a name it does not know
            raise WireError(f"bad device {_cut(body)}") from None
    if tag == "$raised":
        body = _obj(body)
        return Raised(str(body.get("type", "?")), tuple(map(str, _list(body.get("mro", [])))),
                      str(body.get("message", "")),
                      None if body.get("remote_type") is None else str(body["remote_type"]))
    if tag == "$record":
        body = _obj(body)
        fields = _decode(body.get("fields", {}), d)
        return Record(str(body.get("type", "?")), fields if isinstance(fields, dict) else {})
    if tag == "$opaque":
        body = _obj(body)
        return Opaque(str(body.get("type", "?")), str(body.get("repr", ""))[:300])
    return {k: _decode(x, d) for k, x in v.items()}          # a plain dict with one "$…" key


def _list(v) -> list:
    if not isinstance(v, list):
        raise WireError("expected a list")
    return v


def _obj(v) -> dict:
    if not isinstance(v, dict):
        raise WireError("expected an object")
    return v


def _pairs(v) -> list:
    pairs = _list(v)
    if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise WireError("expected [key, value] pairs")
    return pairs


def _capped(items: list, what: str) -> list:
    if len(items) > MAX_KEYS:
        raise WireError(f"a {what} of {len(items)} elements: wire data holds at most {MAX_KEYS} per {what}")
    return items


def _keys(values: list, what: str) -> list:
    """``values`` as set elements / dict keys — refused when many distinct ones share a hash.

    A set of integers that all hash alike (multiples of 2**61 - 1) takes quadratic time to build:
    hashes are counted first, and a hash shared by more than :data:`MAX_SAME_HASH` values is refused
    before any set or dict is built. (Equal values share their hash too; a set or dict sent by
    :func:`dumps` never holds a value twice.)
    """
    from collections import Counter

    keys = [_hashable(v) for v in values]
    counts = Counter(hash(k) for k in keys)
    if counts:
        h, n = counts.most_common(1)[0]
        if n > MAX_SAME_HASH:
            example = next(k for k in keys if hash(k) == h)
            raise WireError(f"a {what} whose {n} elements share one hash value (e.g. {_cut(example)}): "
                            f"at most {MAX_SAME_HASH} may")
    return keys


def _hashable(v):
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    try:
        hash(v)
    except TypeError:
        raise WireError(f"a {type(v).__name__} cannot be a dict key or set element") from None
    return v


def loads(text: str | bytes):
    """The value encoded by :func:`dumps`. Raises :class:`WireError` for anything else."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str) or len(text) > MAX_BYTES:
        raise WireError("wire text missing or larger than the limit")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise WireError(f"not wire data: {e}") from None
    if not isinstance(doc, dict) or doc.get("wire") != 1 or "value" not in doc:
        raise WireError("not wire data (no version)")
    try:
        return _decode(doc["value"], 0)
    except WireError:
        raise
    except (Exception, RecursionError, MemoryError) as e:  # noqa: BLE001 - whatever odd data makes
        raise WireError(f"not wire data: {type(e).__name__}: {_cut(str(e), 200)}") from None  # fail

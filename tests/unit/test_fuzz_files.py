"""Fuzzed files (#18): every file format sparknet reads, mutated a thousand ways, loads or ends in its own clear error.

Each test takes real seed files of one format (the BVLC Caffe files, files sparknet's own writers
made), mutates them with hypothesis (bytes flipped, set, cut, inserted and repeated; prototxt tokens
replaced; protobuf length fields rewritten; JSON keys dropped, retyped, nested 100,000 deep; Parquet
columns of the wrong type, with nulls, NaN, ragged or empty rows) and runs the reader on each case
under a wall-clock bound. A case ends in one of two ways: the reader returns (``ok``: what it
returned is checked to be whole), or it raises the exception type that reader documents, with a
message naming the file. Anything else (another exception type: KeyError, struct.error,
UnicodeDecodeError, a raw protobuf DecodeError, a safetensors error, RecursionError...; a message
that does not name the file; a case that runs past its bound) is collected, and fails the test
after every case has run, each with its input.

The writers that take a folder (``save_model``, a checkpoint's save) are fuzzed failing: a write
that fails at its start or part way, on each of their files, an unwritable target, content that
cannot be stored. Afterwards nothing is left that a later load would take as whole.

The tally of each format (cases, and how they ended) is printed (``-s -n0`` shows it) and written
to ``fuzz_tally.json`` in pytest's base temporary folder; docs/RELIABILITY.md ("Fuzzed files")
records a run's::

    python -m pytest tests/unit/test_fuzz_files.py -n0 -s
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import struct
import time
import traceback
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from google.protobuf import text_format
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from _protobuf_wire import varint
from sparknet import model_io, zoo
from sparknet._parquet import read_parquet_dataset
from sparknet.caffe import (PrototxtError, describe_caffemodel, load_caffemodel_into, load_net_prototxt,
                            load_solver_prototxt, read_caffemodel, write_caffemodel)
from sparknet.caffe import _schema
from sparknet.caffe.caffemodel import _array_to_blob
from sparknet.checkpoint import CheckpointError, CheckpointManager, model_fingerprint, rng_state
from sparknet.datasets import synthetic
from sparknet.errors import GraphError
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.spark.data import arrays_table

pytestmark = pytest.mark.filterwarnings("ignore:invalid octal escape sequence:DeprecationWarning")  # protobuf's, on '\\777'

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "caffe-models"
needs_models = pytest.mark.skipif(not MODELS.is_dir(), reason=f"BVLC Caffe files not found at {MODELS}")

CASES = int(os.environ.get("SPARKNET_FUZZ_CASES", 1000))
"""Cases per format (hypothesis examples, each one tallied); ``SPARKNET_FUZZ_CASES`` asks for more on a long run."""
WRITE_CASES = 300
"""Cases per writer fuzzed failing."""
BOUND_S = 30.0
"""Wall-clock bound of one case: a reader still running after it has hung."""

FUZZ = settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
                phases=(Phase.explicit, Phase.generate),  # cases are tallied, not failed: nothing to shrink
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example])


# -- running a case ------------------------------------------------------------------------------
class _Hang(BaseException):
    """A case ran past :data:`BOUND_S` (a BaseException, so that no reader's ``except Exception`` takes it)."""


@contextmanager
def _bounded(seconds: float):
    """Raise :class:`_Hang` in this thread after ``seconds``; pytest-timeout's own SIGALRM timer is put back after."""
    def ring(signum, frame):
        raise _Hang(f"still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, ring)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))


class Tally:
    """How the cases of one format ended: ``ok``, or the name of the exception they raised."""

    def __init__(self, name: str):
        self.name = name
        self.counts: Counter = Counter()
        self.bad: dict[str, str] = {}  # wrong ending -> its first case
        self.last: str | None = None  # the label of the last case, when it ended rightly

    @property
    def cases(self) -> int:
        return sum(self.counts.values())

    def run(self, call, expected: tuple[type, ...], names: str, describe,
            judge=lambda result: "ok") -> Exception | None:
        """Run ``call()``, tally how it ended, and return what it raised (None when it returned).

        ``expected``: the exact exception types allowed; ``names``: what their message must contain (the
        file); ``judge(result)``: the label of a case that returned, after checking what it returned (an
        ``AssertionError`` from it is a wrong ending).
        """
        try:
            with _bounded(BOUND_S):
                result = call()
        except _Hang as exc:
            self._wrong("hang", f"{exc}", describe)
            raise AssertionError(self.report()) from None
        except Exception as exc:  # noqa: BLE001 - every ending is tallied; the unexpected ones fail the test
            kind = type(exc).__name__
            if type(exc) not in expected:
                self._wrong(f"unexpected {kind} at {_where(exc)}", "".join(traceback.format_exception(exc)[-4:]),
                            describe)
            elif names not in str(exc):
                self._wrong(f"{kind} not naming {names}", str(exc), describe)
            else:
                self.counts[kind] += 1
                self.last = kind
            return exc
        try:
            self.last = judge(result)
            self.counts[self.last] += 1
        except AssertionError as exc:
            self._wrong("returned wrongly", str(exc), describe)
        return None

    def then(self, after: str) -> None:
        """Add what followed to the last case's label (``"PermissionError"`` -> ``"PermissionError, then ..."``)."""
        if self.last is not None:
            self.counts[self.last] -= 1
            self.counts[f"{self.last}, then {after}"] += 1
            self.counts = +self.counts  # drop the labels left at 0
            self.last = None

    def _wrong(self, label: str, detail: str, describe) -> None:
        self.last = None
        self.counts[label] += 1
        if label not in self.bad:
            self.bad[label] = f"{detail.strip()[-1500:]}\n  on: {describe()[:1500]}"

    def fail(self, label: str, detail: str) -> None:
        """The last case ended wrongly after all (what followed it was wrong)."""
        if self.last is not None:
            self.counts[self.last] -= 1
            self.counts = +self.counts
        self._wrong(label, detail, lambda: "")

    def report(self) -> str:
        wrong = {k: v for k, v in self.counts.items() if k in self.bad}
        lines = [f"{self.name}: {sum(wrong.values())} of {self.cases} cases ended wrongly"]
        for label, example in self.bad.items():
            lines.append(f"--- {label}: {wrong[label]} cases; the first:\n{example}")
        return "\n".join(lines)


def _where(exc: BaseException) -> str:
    """The innermost line of sparknet's own code an exception passed through."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/sparknet/" in f.filename]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


@pytest.fixture(scope="module")
def tallies(tmp_path_factory):
    """Every format's tally, printed and written to fuzz_tally.json when the module is done."""
    found: dict[str, Tally] = {}
    yield found
    out = tmp_path_factory.getbasetemp() / "fuzz_tally.json"
    table = {name: {"cases": t.cases, "outcomes": dict(t.counts.most_common())} for name, t in found.items()}
    out.write_text(json.dumps(table, indent=1))
    for name, row in table.items():
        print(f"fuzz {name}: {row['cases']} cases: "
              + ", ".join(f"{k} {v}" for k, v in row["outcomes"].items()))
    print(f"fuzz tally written to {out}")


def _fuzz(strategy, case, regressions=(), cases: int = CASES):
    """Run ``case`` on ``regressions`` (the inputs of bugs the fuzzing found, fixed since), then on ``cases``
    values of ``strategy`` (derandomized: the same cases on every run)."""
    def run(value):
        case(value)

    for value in regressions:
        run = example(value)(run)
    settings(FUZZ, max_examples=cases)(given(strategy)(run))()


def _finish(tally: Tally, cases: int = CASES) -> None:
    assert tally.cases >= cases, f"{tally.name}: only {tally.cases} cases ran"
    assert not tally.bad, tally.report()


def test_a_case_that_runs_past_its_bound_fails_as_a_hang():
    tally = Tally("sleeper")
    outer = signal.getitimer(signal.ITIMER_REAL)[0]  # pytest-timeout's, when it runs
    with mock.patch(f"{__name__}.BOUND_S", 0.2), pytest.raises(AssertionError, match="hang"):
        tally.run(lambda: time.sleep(30), (ValueError,), "", lambda: "a reader that sleeps")
    assert tally.counts == {"hang": 1}
    assert (signal.getitimer(signal.ITIMER_REAL)[0] > 0) == (outer > 0)  # the outer timer is set again


# -- mutations of bytes ----------------------------------------------------------------------------
_POS = st.integers(0, 1 << 24)
_SPECIAL_BYTES = [b"\x00", b"\xff", b"\x7f", b"\x80", b"\xff\xff\xff\xff\x0f", b"\xff" * 10 + b"\x01",
                  b"\x80" * 11, b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\x00" * 8, b"\xff" * 8]

BYTE_EDIT = st.one_of(
    st.tuples(st.just("flip"), _POS, st.integers(0, 7)),
    st.tuples(st.just("set"), _POS, st.integers(0, 255)),
    st.tuples(st.just("truncate"), _POS),
    st.tuples(st.just("insert"), _POS, st.binary(min_size=1, max_size=16) | st.sampled_from(_SPECIAL_BYTES)),
    st.tuples(st.just("delete"), _POS, st.integers(1, 64)),
    st.tuples(st.just("repeat"), _POS, st.integers(1, 64), _POS),
)
"""One edit of a file's bytes; positions are taken modulo the file's length."""


def apply_bytes(data: bytes, edits) -> bytes:
    b = bytearray(data)
    for edit in edits:
        kind, at = edit[0], edit[1] % (len(b) + 1)
        if kind == "flip" and at < len(b):
            b[at] ^= 1 << edit[2]
        elif kind == "set" and at < len(b):
            b[at] = edit[2]
        elif kind == "truncate":
            del b[at:]
        elif kind == "insert":
            b[at:at] = edit[2]
        elif kind == "delete":
            del b[at:at + edit[2]]
        elif kind == "repeat":
            b[edit[3] % (len(b) + 1):edit[3] % (len(b) + 1)] = b[at:at + edit[2]]
    return bytes(b)


# -- mutations of JSON -----------------------------------------------------------------------------
_SPECIAL_JSON = [10**400, -10**400, 2**63, -2**63 - 1, 2**64, 2**31, 1e308, -1, 0, 1, 0.5, "", "x" * 5000,
                 "../../etc/passwd", "/", "..", ".", "weights.safetensors", "state.pt", "manifest.json", "net.json",
                 "solver.json", "config.json", "sparknet_model.json", "module.pt", "netparams", "module",
                 "sparknet.model", "sparknet-checkpoint", "float32", "F32", "I64", "BF16", [], {}, [[]], [-1],
                 [2**40, 2**40], None, True, float("nan"), float("inf"), -float("inf")]
JSON_VALUE = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=16),
              st.sampled_from(_SPECIAL_JSON)),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
    max_leaves=8)
"""Any JSON value, the awkward ones (NaN, 10**400, "../..", the files' own names) often."""

_AT = st.integers(0, 1 << 20)
JSON_EDIT = st.one_of(
    st.tuples(st.just("drop"), _AT),
    st.tuples(st.just("set"), _AT, JSON_VALUE),
    st.tuples(st.just("retype"), _AT, st.integers(0, 5)),
    st.tuples(st.just("add"), _AT, st.text(max_size=12) | st.sampled_from(["format", "round", "kind", "sha256"]),
              JSON_VALUE),
    st.tuples(st.just("deep"), _AT, st.sampled_from([50, 1000, 100_000])),
    st.tuples(st.just("whole"), JSON_VALUE),
)
"""One edit of a JSON document: a key or item dropped, a value replaced or retyped, a key added, a value
nested ``n`` lists deep, or the whole document replaced; the place is taken modulo the document's paths."""

_DEEP = "\x00deep\x00"


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _paths(value, prefix + (i,))


def apply_json(doc, edits) -> bytes:
    """``doc`` with ``edits`` applied, as JSON text (NaN and Infinity as Python writes them)."""
    doc = copy.deepcopy(doc)
    depth = 0
    for edit in edits:
        kind = edit[0]
        if kind == "whole":
            doc = copy.deepcopy(edit[1])
            continue
        paths = list(_paths(doc))
        path = paths[edit[1] % len(paths)]
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        here = parent[path[-1]] if path else doc

        def put(value):
            nonlocal doc
            if path:
                parent[path[-1]] = value
            else:
                doc = value

        if kind == "drop" and path:
            del parent[path[-1]]
        elif kind == "set":
            put(copy.deepcopy(edit[2]))
        elif kind == "retype":
            put([str(here), [here], {"value": here}, len(json.dumps(here)), None, -1][edit[2]])
        elif kind == "add" and isinstance(here, dict):
            here[edit[2]] = copy.deepcopy(edit[3])
        elif kind == "add" and isinstance(here, list):
            here.append(copy.deepcopy(edit[3]))
        elif kind == "deep":
            put(_DEEP)
            depth = edit[2]
    text = json.dumps(doc)
    if depth:
        text = text.replace(json.dumps(_DEEP), "[" * depth + "]" * depth, 1)
    return text.encode()


def json_file() -> st.SearchStrategy:
    """JSON edits, then (in a quarter of the cases) byte edits of the text."""
    return st.tuples(st.lists(JSON_EDIT, min_size=1, max_size=3),
                     st.one_of(st.just([]), st.just([]), st.just([]), st.lists(BYTE_EDIT, min_size=1, max_size=2)))


def _loads(data: bytes):
    """JSON a previous edit may have spoilt or nested deeper than Python recurses: ``None`` then (the next
    edits go to the bytes)."""
    try:
        doc = json.loads(data)
        copy.deepcopy(doc)
        return doc
    except (ValueError, RecursionError):
        return None


def mutate_json(data: bytes, change) -> bytes:
    edits, byte_edits = change
    doc = _loads(data)
    return apply_bytes(data if doc is None else apply_json(doc, edits), byte_edits)


def mutate_safetensors(data: bytes, change) -> bytes:
    """A safetensors file with its JSON header edited (and re-counted, or not), then byte edits."""
    (edits, byte_edits), recount = change
    (n,) = struct.unpack("<Q", data[:8].ljust(8, b"\0"))
    doc = _loads(data[8:8 + n])
    if doc is None:
        return apply_bytes(data, byte_edits)
    header = apply_json(doc, edits)
    size = struct.pack("<Q", len(header)) if recount else data[:8]
    return apply_bytes(size + header + data[8 + n:], byte_edits)


WEIGHTS_EDIT = st.one_of(st.tuples(st.just("header"), st.tuples(json_file(), st.booleans())),
                         st.tuples(st.just("bytes"), st.lists(BYTE_EDIT, min_size=1, max_size=3)))
"""A safetensors file's header edited, or its bytes."""


def mutate_weights(data: bytes, edit) -> bytes:
    return mutate_safetensors(data, edit[1]) if edit[0] == "header" else apply_bytes(data, edit[1])


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- 1, 2: Caffe net and solver prototxt -----------------------------------------------------------
_TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|#[^\n]*|[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+)'
                    r'|[A-Za-z_][A-Za-z0-9_]*|\s+|.', re.S)


def _token_kind(token: str) -> str:
    c = token[0]
    if c in "\"'":
        return "string"
    if c.isdigit() or (c in "+-." and len(token) > 1):
        return "number"
    if c.isalpha() or c == "_":
        return "name"
    if c.isspace() or c == "#":
        return "space"
    return "punct"


def _schema_names() -> list[str]:
    """Every field and enum value name of Caffe's schema (what a prototxt's names are swapped for)."""
    names, seen = set(), set()
    todo = [_schema.NetParameter.DESCRIPTOR, _schema.SolverParameter.DESCRIPTOR]
    while todo:
        message = todo.pop()
        if message.full_name in seen:
            continue
        seen.add(message.full_name)
        for f in message.fields:
            names.add(f.name)
            if f.message_type is not None:
                todo.append(f.message_type)
            if f.enum_type is not None:
                names.update(v.name for v in f.enum_type.values)
    return sorted(names)


_NUMBERS = ["0", "-1", "1", "2", "3", "2147483647", "2147483648", "-2147483649", "4294967296", "9223372036854775807",
            "9223372036854775808", "18446744073709551616", "1e308", "1e39", "-1e39", "1e-45", "nan", "inf", "-inf",
            "0.5", "-0.0", "1000000", "65536", "100000000", "0x7fffffff", "1e400"]
_STRINGS = ['""', '"data"', '"label"', '"loss"', '"conv1"', '"pool1"', '"ip1"', '"ip2"', '"TRAIN"', '"TEST"',
            '"Convolution"', '"InnerProduct"', '"Input"', '"Data"', '"Pooling"', '"ReLU"', '"BatchNorm"', '"Scale"',
            '"Concat"', '"Eltwise"', '"Slice"', '"Split"', '"Reshape"', '"Flatten"', '"Embed"', '"LSTM"',
            '"SoftmaxWithLoss"', '"Accuracy"', '"Adam"', '"RMSProp"', '"AdaGrad"', '"Nesterov"', '"step"',
            '"multistep"', '"poly"', '"gaussian"', '"xavier"', '"msra"', '"bilinear"', '"../../x"', '"/"', '"\\x"',
            '"\\xff"', '"\\777"', '"\\u00e9"', '"a\\nb"', "'single'", '"' + "a" * 5000 + '"', '"mnist_train_lmdb"',
            '"cifar10_test_lmdb"', '"mean.binaryproto"', '"lenet.prototxt"', '"lenet_train_test.prototxt"',
            '"lenet_solver.prototxt"', '"mnist/lenet.prototxt"', '"../cifar10/mean.binaryproto"',
            '"mnist/mnist_autoencoder.prototxt"',
            '"examples/mnist/lenet_train_test.prototxt"', '"cifar10_quick_train_test.prototxt"', '"test-on-test"']
_INDEX = st.integers(0, 1 << 20)
TEXT_EDIT = st.one_of(
    st.tuples(st.just("number"), _INDEX, st.sampled_from(_NUMBERS) | st.integers(-2**70, 2**70).map(str)
              | st.floats().map(repr)),
    st.tuples(st.just("name"), _INDEX, st.sampled_from(_schema_names())),
    st.tuples(st.just("swap_name"), _INDEX, _INDEX),
    st.tuples(st.just("string"), _INDEX, st.sampled_from(_STRINGS) | st.text(max_size=12).map(json.dumps)),
    st.tuples(st.just("swap_string"), _INDEX, _INDEX),
    st.tuples(st.just("line"), _INDEX, st.sampled_from(["delete", "duplicate", "swap", "move"]), _INDEX),
    st.tuples(st.just("punct"), _INDEX, st.sampled_from(["", "{", "}", ":", "<", ">", "[", "]", ",", ";", '"', "#",
                                                         "\n", "layer {", "}}", "{{", "- ", "."])),
)
"""One edit of a prototxt's tokens (a number, a name, a string, a line, a brace; a name or string swapped for
another of the file's); places taken modulo their count."""


def apply_text(text: str, edits) -> str:
    for edit in edits:
        kind = edit[0]
        if kind == "line":
            lines = text.split("\n")
            i, j = edit[1] % len(lines), edit[3] % len(lines)
            if edit[2] == "delete":
                del lines[i]
            elif edit[2] == "duplicate":
                lines.insert(j, lines[i])
            elif edit[2] == "swap":
                lines[i], lines[j] = lines[j], lines[i]
            else:
                lines.insert(j, lines.pop(i))
            text = "\n".join(lines)
            continue
        tokens = _TOKEN.findall(text)
        want = {"swap_string": "string", "swap_name": "name"}.get(kind, kind)
        places = [i for i, t in enumerate(tokens) if _token_kind(t) == want]
        if not places:
            continue
        i = places[edit[1] % len(places)]
        tokens[i] = tokens[places[edit[2] % len(places)]] if kind.startswith("swap") else edit[2]
        text = "".join(tokens)
    return text


_FD = _schema.NetParameter.DESCRIPTOR.fields_by_name["name"]  # a FieldDescriptor, for its type constants
_INT_VALUES = [0, -1, 1, 2, 3, 7, 100, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**53, 2**63 - 1, -2**31, -2**63]
_INT_RANGES = {_FD.CPPTYPE_INT32: (-2**31, 2**31 - 1), _FD.CPPTYPE_UINT32: (0, 2**32 - 1),
               _FD.CPPTYPE_INT64: (-2**63, 2**63 - 1), _FD.CPPTYPE_UINT64: (0, 2**64 - 1)}
_FLOAT_VALUES = [0.0, -1.0, 1.0, 0.5, 1e-45, 1e10, 3.4e38, 1e300, float("nan"), float("inf"), -float("inf"), -0.0]
_PLAIN_STRINGS = [json.loads(s) for s in _STRINGS if s.startswith('"') and "\\" not in s]


def _nodes(message, out):
    """Every field set in ``message`` and below: (message, field, index or None)."""
    for fd, value in message.ListFields():
        if fd.is_repeated:
            out.append((message, fd, None))
            for i, item in enumerate(value):
                if fd.message_type is not None:
                    _nodes(item, out)
                else:
                    out.append((message, fd, i))
        else:
            out.append((message, fd, None))
            if fd.message_type is not None:
                _nodes(value, out)
    return out


def _value(fd, pick: int, strings: list[str]):
    """The ``pick``-th awkward value of the field's type."""
    if fd.cpp_type == fd.CPPTYPE_BOOL:
        return bool(pick % 2)
    if fd.cpp_type in _INT_RANGES:
        low, high = _INT_RANGES[fd.cpp_type]
        return min(max(_INT_VALUES[pick % len(_INT_VALUES)], low), high)
    if fd.cpp_type in (fd.CPPTYPE_FLOAT, fd.CPPTYPE_DOUBLE):
        return _FLOAT_VALUES[pick % len(_FLOAT_VALUES)]
    if fd.cpp_type == fd.CPPTYPE_ENUM:
        return fd.enum_type.values[pick % len(fd.enum_type.values)].number
    return strings[pick % len(strings)]


MESSAGE_EDIT = st.one_of(
    st.tuples(st.just("set"), _INDEX, _INDEX),
    st.tuples(st.just("clear"), _INDEX),
    st.tuples(st.just("repeat"), _INDEX, _INDEX),
    st.tuples(st.just("remove"), _INDEX, _INDEX),
    st.tuples(st.just("add"), _INDEX, _INDEX, _INDEX),
)
"""One edit of a parsed prototxt: a field set to an awkward value of its type (a string to another of the
file's, an enum to another value), cleared, an element of a repeated field (a layer, a bottom) repeated or
removed, or an unset field of some message added."""


def apply_message(message, edits):
    for edit in edits:
        nodes = _nodes(message, [])
        if not nodes:
            return message
        owner, fd, index = nodes[edit[1] % len(nodes)]
        strings = _PLAIN_STRINGS + [v for m, f, i in nodes if f.cpp_type == f.CPPTYPE_STRING
                                    for v in ([getattr(m, f.name)[i]] if i is not None else
                                              [] if f.is_repeated else [getattr(m, f.name)])]
        kind = edit[0]
        if kind == "set" and fd.message_type is None:
            value = _value(fd, edit[2], strings)
            if index is not None:
                getattr(owner, fd.name)[index] = value
            elif not fd.is_repeated:
                setattr(owner, fd.name, value)
        elif kind == "clear" and index is None:
            owner.ClearField(fd.name)
        elif kind in ("repeat", "remove") and fd.is_repeated and index is None:
            items = getattr(owner, fd.name)
            j = edit[2] % len(items)
            if kind == "remove":
                del items[j]
            elif fd.message_type is not None:
                items.add().CopyFrom(items[j])
            else:
                items.append(items[j])
        elif kind == "add":
            holders = [owner] + [getattr(owner, fd.name)] * (fd.message_type is not None and not fd.is_repeated)
            holder = holders[edit[2] % len(holders)]
            fields = holder.DESCRIPTOR.fields
            new = fields[edit[3] % len(fields)]
            if new.is_repeated:
                if new.message_type is not None:
                    getattr(holder, new.name).add()
                else:
                    getattr(holder, new.name).append(_value(new, edit[2], strings))
            elif new.message_type is not None:
                getattr(holder, new.name).SetInParent()
            else:
                setattr(holder, new.name, _value(new, edit[2], strings))
    return message


def text_file(seeds) -> st.SearchStrategy:
    """(seed, message edits, token edits, byte edits): in half the cases the parsed file is edited and written
    back, in the others its tokens; in a quarter, bytes too (which may leave the text not UTF-8)."""
    return st.tuples(st.sampled_from(seeds),
                     st.one_of(st.tuples(st.lists(MESSAGE_EDIT, min_size=1, max_size=4), st.just([])),
                               st.tuples(st.just([]), st.lists(TEXT_EDIT, min_size=1, max_size=4))),
                     st.one_of(st.just([]), st.just([]), st.just([]), st.lists(BYTE_EDIT, min_size=1, max_size=2)))


def mutate_prototxt(text: str, message_type, edits) -> bytes:
    (message_edits, text_edits), byte_edits = edits
    if message_edits:
        message = apply_message(text_format.Parse(text, message_type()), message_edits)
        text = text_format.MessageToString(message)
    return apply_bytes(apply_text(text, text_edits).encode(), byte_edits)


def _net_seeds() -> list[tuple[str, str]]:
    """The BVLC nets and the prototxt sparknet writes for its own zoo nets."""
    seeds = [(p.relative_to(MODELS).as_posix(), p.read_text())
             for p in sorted(MODELS.glob("*/*.prototxt")) if "solver" not in p.name]
    from sparknet.caffe import net_to_prototxt

    for name, net in (("zoo/lenet.prototxt", zoo.lenet(batch_size=8)), ("zoo/cifar_cnn.prototxt", zoo.cifar_cnn(4)),
                      ("zoo/mlp.prototxt", zoo.mlp(input_shape=[6], hidden=[8], num_classes=3))):
        seeds.append((name, net_to_prototxt(net)))
    return seeds


def _copy_models(to: Path) -> None:
    """The BVLC files in ``to``, with the mean files their data layers name: a solver finds its net, a
    net its mean file (and a string swapped into ``mean_file`` other files)."""
    shutil.copytree(MODELS, to, dirs_exist_ok=True)
    for path in to.rglob("*"):
        path.chmod(0o644 if path.is_file() else 0o755)
    (to / "zoo").mkdir(exist_ok=True)
    for name, shape in (("cifar10/mean.binaryproto", (1, 3, 32, 32)), ("bvlc_alexnet/imagenet_mean.binaryproto",
                                                                        (1, 3, 256, 256))):
        blob = _schema.BlobProto()
        _array_to_blob(np.full(shape, 120.0, dtype=np.float32), blob)
        (to / name).write_bytes(blob.SerializeToString())


_LENET_DEPLOY = """name: "LeNet"
layer { name: "data" type: "Input" top: "data" input_param { shape: { dim: 64 dim: 1 dim: 28 dim: 28 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 20 kernel_size: 5 weight_filler { type: "gaussian" std: 0.01 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "conv1" top: "ip1" inner_product_param { num_output: 10 } }
"""
NET_REGRESSIONS = [
    (("zoo/regression.prototxt", _LENET_DEPLOY), ([], []), [("set", 40, 0xFF)]),  # UnicodeDecodeError
    (("zoo/regression.prototxt", _LENET_DEPLOY.replace("std: 0.01", "std: -1")), ([], []), []),  # bare ValueError
]
"""Inputs that broke the reader once: a byte that is not UTF-8; a filler the layer DSL refuses (negative std)."""


def _loaded(net, phase: str) -> str:
    assert net.phase == phase and net.net_params.inputs, f"a {net.phase} net without inputs for phase {phase}"
    return "ok"


@needs_models
def test_fuzzed_net_prototxt_loads_or_is_a_prototxt_error(tmp_path, tallies):
    tally = tallies["net prototxt"] = Tally("net prototxt")
    _copy_models(tmp_path)
    seeds = _net_seeds()

    def case(value):
        (name, text), *edits = value
        mutated = mutate_prototxt(text, _schema.NetParameter, edits)
        path = tmp_path / name
        path.write_bytes(mutated)
        phase = "TEST" if len(mutated) % 2 else "TRAIN"
        stages = ("test-on-test",) if "autoencoder" in name and phase == "TEST" else ()
        describe = lambda: f"{name} ({phase}) edited {edits}:\n{mutated[:4000]!r}"  # noqa: E731
        tally.run(lambda: load_net_prototxt(path, phase, stages=stages), (PrototxtError,), str(path), describe,
                  judge=lambda net: _loaded(net, phase))
        path.write_text(text)  # the next case's mean file or net is the real one again

    _fuzz(text_file(seeds), case, NET_REGRESSIONS)
    _finish(tally)


_SOLVER = 'net: "lenet_train_test.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 100\n'
SOLVER_REGRESSIONS = [
    (("mnist/regression_solver.prototxt", _SOLVER + "test_iter: 100\ntest_iter: 100\n"), ([], []), []),
    (("mnist/regression_solver.prototxt", _SOLVER.replace('net: "lenet_train_test.prototxt"', "train_net_param {}")),
     ([], []), []),
    (("mnist/regression_solver.prototxt", _SOLVER.replace("lenet_train_test", "a" * 5000)), ([], []), []),
    (("mnist/regression_solver.prototxt", _SOLVER), ([], []), [("insert", 0, b"\xc3\x28")]),
]
"""Inputs that broke the reader once: two test_iter values for one test net (a bare ValueError from test_plan), an
empty inline net (FileNotFoundError), a net path too long for the system (OSError), a byte that is not UTF-8."""


@needs_models
def test_fuzzed_solver_prototxt_loads_or_is_a_prototxt_error(tmp_path, tallies):
    tally = tallies["solver prototxt"] = Tally("solver prototxt")
    _copy_models(tmp_path)
    seeds = [(p.relative_to(MODELS).as_posix(), p.read_text()) for p in sorted(MODELS.glob("*/*solver*.prototxt"))]

    def load(path):
        solver = load_solver_prototxt(path)
        if solver.net_path is not None or solver.net_text is not None:
            solver.load_net("TRAIN")
        return solver.test_plan

    def case(value):
        (name, text), *edits = value
        mutated = mutate_prototxt(text, _schema.SolverParameter, edits)
        path = tmp_path / name
        path.write_bytes(mutated)
        describe = lambda: f"{name} edited {edits}:\n{mutated[:4000]!r}"  # noqa: E731
        tally.run(lambda: load(path), (PrototxtError,), str(path), describe)
        path.write_text(text)

    _fuzz(text_file(seeds), case, SOLVER_REGRESSIONS)
    _finish(tally)


# -- 3: .caffemodel --------------------------------------------------------------------------------
def _read_varint(data: bytes, at: int, end: int) -> tuple[int, int]:
    """The protobuf varint at ``at`` and where it ends; ``ValueError`` when it runs past ``end``."""
    value, shift = 0, 0
    while at < end:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7
    raise ValueError("a varint cut short")


def _wire_lengths(data: bytes, start: int = 0, end: int | None = None, depth: int = 0) -> list[tuple[int, int]]:
    """``(offset, size)`` of every length field of a protobuf message, nested messages included."""
    end = len(data) if end is None else end
    found, at = [], start
    try:
        while at < end:
            tag, at = _read_varint(data, at, end)
            wire = tag & 7
            if wire == 0:
                _, at = _read_varint(data, at, end)
            elif wire in (1, 5):
                at += 8 if wire == 1 else 4
            elif wire == 2:
                length, payload = _read_varint(data, at, end)
                if payload + length > end:
                    raise ValueError("a field longer than its message")
                found.append((at, payload - at))
                if depth < 4 and tag >> 3 not in (5, 8):  # not a blob's packed floats: maybe a message
                    found += _wire_lengths(data, payload, payload + length, depth + 1)
                at = payload + length
            else:
                raise ValueError("a wire type Caffe's messages do not use")
    except ValueError:
        return []
    return found if at == end else []  # not a message: its bytes are something else


CAFFEMODEL_EDIT = st.one_of(
    BYTE_EDIT,
    st.tuples(st.just("length"), _INDEX, st.sampled_from(["one less", "one more", 0, 1, 2**31 - 1, 2**31, 2**32,
                                                          2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1)),
)
"""A byte edit, or one of the file's protobuf length fields rewritten: one less, one more, or another number."""


CAFFEMODEL_CHANGE = st.one_of(st.tuples(st.just("message"), st.lists(MESSAGE_EDIT, min_size=1, max_size=4)),
                              st.tuples(st.just("bytes"), st.lists(CAFFEMODEL_EDIT, min_size=1, max_size=3)))
"""The parsed file edited (a blob's shape or values, a layer's name, a blob or a layer repeated or removed) and
written back, or its bytes and length fields."""


def mutate_caffemodel(data: bytes, change) -> bytes:
    kind, edits = change
    if kind == "message":
        net = _schema.NetParameter()
        net.ParseFromString(data)
        return apply_message(net, edits).SerializeToString()
    for edit in edits:
        if edit[0] != "length":
            data = apply_bytes(data, [edit])
            continue
        lengths = _wire_lengths(data)
        if not lengths:
            continue
        at, size = lengths[edit[1] % len(lengths)]
        old, _ = _read_varint(data, at, len(data))
        new = {"one less": max(old - 1, 0), "one more": old + 1}.get(edit[2], edit[2])
        data = data[:at] + varint(new) + data[at + size:]
    return data


_SMALL_CAFFE_NET = """
name: "small"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 1 dim: 6 dim: 6 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "ip1" type: "InnerProduct" bottom: "conv1" top: "ip1" inner_product_param { num_output: 4 } }
layer { name: "prob" type: "Softmax" bottom: "ip1" top: "prob" }
"""


def _caffemodel_seeds(folder: Path) -> list[tuple[str, bytes, object]]:
    """``.caffemodel`` files sparknet's writer made: (name, bytes, the net they load into)."""
    seeds = []
    caffe_net = load_net_prototxt(_SMALL_CAFFE_NET, "TEST")
    module = caffe_net.build(seed=0)
    mlp = zoo.mlp(input_shape=[6], hidden=[8], num_classes=3)
    mlp_module = mlp.build(seed=0)
    doubles = {name: [t.double() for t in ts] for name, ts in mlp_module.layer_weights().items()}
    for name, weights, structure, target in (("small.caffemodel", module.layer_weights(), caffe_net, module),
                                             ("mlp.caffemodel", mlp_module.layer_weights(), mlp, mlp_module),
                                             ("mlp64.caffemodel", doubles, None, mlp_module)):
        path = write_caffemodel(folder / name, weights, structure)
        seeds.append((name, path.read_bytes(), target))
    return seeds


def test_fuzzed_caffemodel_reads_or_is_a_value_error_naming_the_file(tmp_path, tallies):
    tally = tallies["caffemodel"] = Tally("caffemodel")
    seeds = _caffemodel_seeds(tmp_path)
    path = tmp_path / "fuzzed.caffemodel"

    def read(target):
        layers = read_caffemodel(path)
        describe_caffemodel(path)
        load_caffemodel_into(target, path)
        return layers

    def case(value):
        (name, data, target), edits = value
        mutated = mutate_caffemodel(data, edits)
        path.write_bytes(mutated)
        describe = lambda: f"{name} edited {edits}: {len(mutated)} bytes"  # noqa: E731
        tally.run(lambda: read(target), (ValueError, GraphError), str(path), describe)

    mlp = seeds[1]
    not_utf8 = [(mlp, ("bytes", [("set", mlp[1].index(b"ip1") + 1, 0xFF)]))]  # a layer name made bytes: TypeError
    _fuzz(st.tuples(st.sampled_from(seeds), CAFFEMODEL_CHANGE), case, not_utf8)
    _finish(tally)


# -- 4: checkpoint folders -------------------------------------------------------------------------
def _small_net(seed: int = 0) -> Net:
    net = Net(zoo.mlp(input_shape=[6], hidden=[8], num_classes=3), SolverConfig(base_lr=0.1), batch_size=16, seed=seed)
    net.set_training_data(synthetic(64, shape=(6,), num_classes=3, seed=1))
    net.train(3)
    return net


_CKPT_FILES = ("manifest.json", "weights.safetensors", "state.pt")
CHECKPOINT_EDIT = st.one_of(
    st.tuples(st.just("manifest.json"), json_file()),
    st.tuples(st.just("weights.safetensors"), WEIGHTS_EDIT, st.booleans()),
    st.tuples(st.just("state.pt"), st.lists(BYTE_EDIT, min_size=1, max_size=3), st.booleans()),
    st.tuples(st.just("remove"), st.sampled_from(_CKPT_FILES)),
)
"""One edit of the newest checkpoint: its manifest, or a file's bytes with its SHA-256 in the manifest
brought along (True) or left (False), or a file removed."""


def _record_sha(manifest_path: Path, name: str, path: Path) -> None:
    """Write ``path``'s SHA-256 into the manifest's ``sha256`` entry ``name``, when the manifest is there and can
    take it (a fuzzed manifest may not)."""
    if not manifest_path.exists():
        return
    try:
        manifest = json.loads(manifest_path.read_bytes())
        manifest["sha256"][name] = _sha(path.read_bytes())
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        return
    manifest_path.write_text(json.dumps(manifest))


def mutate_checkpoint(folder: Path, edits) -> None:
    for edit in edits:
        if edit[0] == "remove":
            (folder / edit[1]).unlink(missing_ok=True)
            continue
        path = folder / edit[0]
        if not path.exists():
            continue
        if edit[0] == "manifest.json":
            path.write_bytes(mutate_json(path.read_bytes(), edit[1]))
            continue
        data = path.read_bytes()
        path.write_bytes(mutate_weights(data, edit[1]) if edit[0] == "weights.safetensors"
                         else apply_bytes(data, edit[1]))
        if edit[2]:  # the SHA-256 brought along: a file written wrong, not damaged after
            _record_sha(folder / "manifest.json", edit[0], path)


def _at(doc, key: str) -> int:
    """The place (for :data:`JSON_EDIT`) of the first value under ``key`` in a JSON document."""
    return next(i for i, path in enumerate(_paths(doc)) if path and path[-1] == key)


_CKPT_MANIFEST = {"format": "", "format_version": 1, "round": 2, "time": 0.0, "fingerprint": "", "numel": 1,
                  "config": {"model": ""}, "extra": {}, "sha256": {"weights.safetensors": "", "state.pt": ""}}
"""The keys of a checkpoint's manifest, in the order it writes them (to place the regressions' edits)."""
CHECKPOINT_REGRESSIONS = [
    [("manifest.json", ([("deep", 0, 100_000)], []))],  # RecursionError
    [("manifest.json", ([("set", _at(_CKPT_MANIFEST, "sha256"), [{}, {}])], []))],  # TypeError: unhashable
    [("manifest.json", ([("set", _at(_CKPT_MANIFEST, "sha256"), [])], []))],  # AttributeError: no .items()
    [("manifest.json", ([("drop", _at(_CKPT_MANIFEST, "fingerprint"))], []))],  # KeyError
    [("manifest.json", ([("set", _at(_CKPT_MANIFEST, "round"), [])], []))],  # TypeError from int()
    [("state.pt", [("truncate", 100)], True)],  # RuntimeError from torch.load
    [("state.pt", [("truncate", 0)], True)],  # EOFError
    [("weights.safetensors", ("header", (([("whole", None)], []), True)), True)],  # AttributeError
    [("weights.safetensors", ("header", (([("deep", 0, 100_000)], []), True)), True)],  # RecursionError
    [("weights.safetensors", ("bytes", [("truncate", 300)]), True)],  # ValueError: corrupt header
    [("weights.safetensors", ("bytes", [("delete", 400, 8)]), True)],  # SafetensorError: data shorter than its header
]
"""Inputs that broke resuming once (the exception each raised): a manifest nested 100,000 deep; its sha256 a list;
no fingerprint; its round a list; a state.pt or a weights file cut short or its header spoilt, with the SHA-256
brought along."""


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_fuzzed_checkpoint_resumes_or_is_refused_or_skipped(tmp_path, tallies):
    tally = tallies["checkpoint"] = Tally("checkpoint")
    net = _small_net()
    fingerprint = model_fingerprint(net.get_weights())
    seed = tmp_path / "seed"
    manager = CheckpointManager(str(seed))
    for r in (1, 2):
        manager.save(r, net.get_weights(), {"solver": net.solver_state(), "rng": rng_state()}, config={"model": "mlp"})
    root = tmp_path / "ck"
    records = _Records()
    logging.getLogger("sparknet.checkpoint").addHandler(records)

    def resume():
        return CheckpointManager(str(root)).load(expect_fingerprint=fingerprint)

    def case(edits):
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(seed, root)
        newest = root / "ckpt-00000002"
        mutate_checkpoint(newest, edits)
        records.messages.clear()
        describe = lambda: f"edits {edits}: " + ", ".join(  # noqa: E731
            f"{p.name} {p.read_bytes()[:2000]!r}" for p in sorted(newest.iterdir()) if p.suffix == ".json")

        def judge(out):
            warned = [m for m in records.messages if str(newest) in m]
            assert model_fingerprint(out.weights) == fingerprint and isinstance(out.state, dict), \
                "resumed the weights or state of another model"
            if out.round == 2 and out.path == str(newest):
                return "resumed from the fuzzed checkpoint"
            assert out.round == 1 and warned, f"resumed round {out.round} from {out.path} (warned: {warned})"
            why = "incomplete" if "incomplete" in warned[0] else "damaged"
            return f"skipped as {why} (a warning), resumed from the one before"

        tally.run(resume, (CheckpointError,), str(root), describe, judge)

    try:
        _fuzz(st.lists(CHECKPOINT_EDIT, min_size=1, max_size=3), case, CHECKPOINT_REGRESSIONS)
    finally:
        logging.getLogger("sparknet.checkpoint").removeHandler(records)
    _finish(tally)


# -- 5: model folders ------------------------------------------------------------------------------
_MODEL_FILES = ("sparknet_model.json", "net.json", "solver.json", "config.json")
MODEL_EDIT = st.one_of(
    st.tuples(st.sampled_from(_MODEL_FILES), json_file(), st.booleans()),
    st.tuples(st.just("weights.safetensors"), WEIGHTS_EDIT, st.booleans()),
    st.tuples(st.just("remove"), st.sampled_from(_MODEL_FILES + ("weights.safetensors",))),
)
"""One edit of a model folder: a JSON file's content or the weights' bytes, with the file's SHA-256 in the
manifest brought along (True) or left (False), or a file removed."""


def mutate_model(folder: Path, edits) -> None:
    for edit in edits:
        if edit[0] == "remove":
            (folder / edit[1]).unlink(missing_ok=True)
            continue
        path = folder / edit[0]
        if not path.exists():
            continue
        data = path.read_bytes()
        weights = edit[0] == "weights.safetensors"
        path.write_bytes(mutate_weights(data, edit[1]) if weights else mutate_json(data, edit[1]))
        if edit[2] and edit[0] != model_io.MANIFEST_NAME:
            _record_sha(folder / model_io.MANIFEST_NAME, edit[0], path)


def _model_seeds(folder: Path) -> list[Path]:
    """Model folders ``save_model`` wrote: a trained MLP with its solver, configuration and metadata, and a small
    convolutional net from a Caffe prototxt (convolution, batch norm, scale: running statistics among its weights)."""
    conv = Net(load_net_prototxt(_SMALL_CAFFE_NET, "TEST").net_params,
               SolverConfig(base_lr=0.01, lr_policy="step", stepsize=10), batch_size=2, seed=0)
    return [model_io.save_model(folder / "mlp", _small_net(), config={"run": {"steps": 3}}, metadata={"vocab": "abc"}),
            model_io.save_model(folder / "conv", conv)]


_MODEL_MANIFEST = {"format": "", "format_version": 1, "kind": "", "net": "", "weights": "", "solver": "", "config": "",
                   "input_shape": [1]}
"""The first keys of a model folder's manifest, in the order it writes them (to place the regressions' edits)."""


def _model_regressions(seeds: list[Path]) -> list:
    """Inputs that broke loading once (the exception each raised)."""
    mlp, conv = seeds
    net = json.loads((conv / "net.json").read_text())
    return [
        (mlp, [("sparknet_model.json", ([("set", _at(_MODEL_MANIFEST, "net"), ["net.json"])], []), False)]),
        # ^ TypeError in posixpath.basename
        (mlp, [("sparknet_model.json", ([("deep", 0, 100_000)], []), False)]),  # RecursionError
        (mlp, [("solver.json", ([("whole", [])], []), True)]),  # TypeError: ** must be a mapping
        (mlp, [("solver.json", ([("set", _at({"type": 0, "base_lr": 0}, "base_lr"), [])], []), True)]),  # TypeError
        (mlp, [("solver.json", ([("deep", 0, 100_000)], []), True)]),  # RecursionError
        (mlp, [("weights.safetensors", ("header", (([("whole", 5)], []), True)), True)]),  # AttributeError
        (mlp, [("weights.safetensors", ("header", (([("deep", 0, 100_000)], []), True)), True)]),  # RecursionError
        (conv, [("weights.safetensors", ("bytes", [("truncate", 1000)]), True)]),  # SafetensorError
        (conv, [("weights.safetensors", ("bytes", [("set", 9, 0)]), True)]),  # ValueError without the folder
        (conv, [("net.json", ([("set", _at(net, "num_filters"), 10**12)], []), True)]),  # 100 TB asked for
        (conv, [("sparknet_model.json", ([("drop", _at(_MODEL_MANIFEST, "input_shape") + 1)], []), False)]),
        # ^ input_shape [6, 6] for the net's (1, 6, 6): predict's RuntimeError (conv2d given 2 channels)
    ]


def test_fuzzed_model_folder_loads_or_is_a_value_error(tmp_path, tallies):
    tally = tallies["model folder"] = Tally("model folder")
    seeds = _model_seeds(tmp_path / "seeds")
    target = tmp_path / "model"

    def load():
        saved = model_io.load_model(target)
        if saved.input_shape is not None:
            saved.predict(torch.zeros(2, *saved.input_shape))
        return saved

    def case(value):
        seed, edits = value
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(seed, target)
        mutate_model(target, edits)
        describe = lambda: f"{seed.name} edits {edits}: " + ", ".join(  # noqa: E731
            f"{p.name} {p.read_bytes()[:1500]!r}" for p in sorted(target.iterdir()) if p.suffix == ".json")
        tally.run(load, (ValueError,), str(target), describe)

    _fuzz(st.tuples(st.sampled_from(seeds), st.lists(MODEL_EDIT, min_size=1, max_size=3)), case,
          _model_regressions(seeds))
    _finish(tally)


# -- 6: Parquet inputs -----------------------------------------------------------------------------
_VECTOR = pa.struct([("type", pa.int8()), ("size", pa.int32()), ("indices", pa.list_(pa.int32())),
                     ("values", pa.list_(pa.float64()))])
"""How Spark stores an ML vector in Parquet."""


def _parquet_seeds() -> dict[str, pa.Table]:
    """Tables as sparknet writes them (class ids; a sequence) and as Spark writes ML vectors."""
    data = synthetic(24, shape=(5,), num_classes=3, seed=2)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 7, size=(12, 6))
    rows = data.x[:12].astype(float).tolist()
    vectors = pa.array([{"type": 0, "size": 5, "indices": [0, 3], "values": [row[0], row[3]]} if i % 2 == 0  # sparse
                        else {"type": 1, "size": None, "indices": None, "values": row} for i, row in enumerate(rows)],
                       _VECTOR)
    return {"classes": arrays_table(data.x, data.y),
            "sequence": arrays_table(tokens, np.roll(tokens, -1, axis=1)),
            "vectors": pa.table({"features": vectors, "label": pa.array(data.y[:12].astype(np.int64))})}


_ODD_VALUES = [float("nan"), float("inf"), -float("inf"), 1e39, -1e39, 1e308, 0.5, -1.0, -0.0, 2.0**63, 2.0**64, 1e30,
               None, 0, 2**31, 2**63 - 1, -2**63]
_FEATURE_TYPES = ["list<float32>", "list<float64>", "list<int64>", "list<int8>", "large_list<float32>",
                  "fixed<float32>", "list<string>", "list<bool>", "string", "float64", "binary",
                  "list<list<float32>>", "null", "vector", "dictionary"]
_LABEL_TYPES = ["int64", "int32", "uint64", "int8", "float64", "float32", "string", "bool", "list<int64>",
                "list<float64>", "null", "date", "decimal", "dictionary"]
_ROW = st.integers(0, 1 << 16)
TABLE_EDIT = st.one_of(
    st.tuples(st.just("features type"), st.sampled_from(_FEATURE_TYPES)),
    st.tuples(st.just("label type"), st.sampled_from(_LABEL_TYPES)),
    st.tuples(st.just("feature value"), _ROW, _ROW, st.sampled_from(_ODD_VALUES) | st.floats()),
    st.tuples(st.just("label value"), _ROW, st.sampled_from(_ODD_VALUES) | st.integers() | st.floats()
              | st.sampled_from(["3", "x", ""])),
    st.tuples(st.just("null row"), st.sampled_from(["features", "label"]), _ROW),
    st.tuples(st.just("ragged"), st.sampled_from(["features", "label"]), _ROW, st.integers(-8, 8)),
    st.tuples(st.just("rows"), st.integers(0, 3)),
    st.tuples(st.just("column"), st.sampled_from(["drop features", "drop label", "rename features", "rename label",
                                                   "swap", "extra", "duplicate rows"])),
    st.tuples(st.just("vector"), _ROW, st.sampled_from(["type", "size", "indices", "values"]),
              st.sampled_from([None, -1, 0, 1, 2, 7, 2**31 - 1, [], [-1], [99], [0, 0], [2**31 - 1], [0.5], [None]])),
)
"""One edit of a table: a column's type, a value, a null row, a row made longer or shorter, rows cut,
a column dropped, renamed or swapped, an ML vector's field."""
PARQUET_CASE = st.tuples(st.sampled_from(["classes", "sequence", "vectors"]),
                         st.lists(TABLE_EDIT, min_size=1, max_size=4), st.integers(1, 32),
                         st.one_of(st.just([]), st.just([]), st.just([]), st.lists(BYTE_EDIT, min_size=1, max_size=3)))
"""(seed table, edits, row group size, byte edits of the written file in a quarter of the cases)."""


def _ints(values) -> list:
    """Numbers as int64 values (clamped; a non-finite one or another type as 0), None kept."""
    def one(v):
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
            return 0
        return int(max(min(v, 2**62), -2**62))

    return [one(v) for v in values]


def _column(kind: str, rows: list) -> pa.Array:
    """``rows`` (lists of numbers, numbers, vector dicts or None) as a column of type ``kind``."""
    def listed(row):
        if row is None or isinstance(row, list):
            return row
        if isinstance(row, dict):
            return row.get("values")
        return [row]

    lists = [listed(r) for r in rows]
    if kind in ("list<float32>", "list<float64>", "large_list<float32>", "fixed<float32>", "list<list<float32>>"):
        floats = [None if r is None else [None if v is None else float(v) if isinstance(v, (int, float)) else 0.0
                                          for v in r] for r in lists]
        if kind == "list<list<float32>>":
            return pa.array([None if r is None else [[v] for v in r] for r in floats], pa.list_(pa.list_(pa.float32())))
        if kind == "fixed<float32>":
            widths = {len(r) for r in floats if r is not None}
            if len(widths) == 1:
                return pa.array(floats, pa.list_(pa.float32(), widths.pop()))
        value = pa.float64() if kind == "list<float64>" else pa.float32()
        return pa.array(floats, pa.large_list(value) if kind == "large_list<float32>" else pa.list_(value))
    if kind in ("list<int64>", "list<int8>"):
        ints = [None if r is None else _ints(r) for r in lists]
        if kind == "list<int8>":
            ints = [None if r is None else [None if v is None else v % 128 for v in r] for r in ints]
        return pa.array(ints, pa.list_(pa.int64() if kind == "list<int64>" else pa.int8()))
    if kind == "list<string>":
        return pa.array([None if r is None else [str(v) for v in r] for r in lists], pa.list_(pa.string()))
    if kind == "list<bool>":
        return pa.array([None if r is None else [bool(v) for v in r] for r in lists], pa.list_(pa.bool_()))
    if kind in ("string", "dictionary"):
        column = pa.array([None if r is None else str(r) for r in lists], pa.string())
        return column.dictionary_encode() if kind == "dictionary" else column
    if kind == "float64":
        return pa.array([r[0] if r and isinstance(r[0], (int, float)) else None for r in lists], pa.float64())
    if kind == "binary":
        return pa.array([None if r is None else struct.pack(f"<{len(r)}f", *[float(v or 0) for v in r]) for r in lists])
    if kind == "null":
        return pa.nulls(len(rows))
    if kind == "vector":
        def floats(values):
            return None if values is None else [float(v) if isinstance(v, (int, float)) else None for v in values]

        vectors = [None if r is None else dict(r, values=floats(r.get("values"))) if isinstance(r, dict)
                   else {"type": 1, "size": None, "indices": None, "values": floats(listed(r))} for r in rows]
        return pa.array(vectors, _VECTOR)
    raise AssertionError(kind)


def _label_column(kind: str, labels: list) -> pa.Array:
    if kind in ("list<int64>", "list<float64>"):
        rows = [None if v is None else v if isinstance(v, list) else [v] for v in labels]
        if kind == "list<int64>":
            return pa.array([None if r is None else _ints(r) for r in rows], pa.list_(pa.int64()))
        return pa.array([None if r is None else [float(v) if isinstance(v, (int, float)) else None for v in r]
                         for r in rows], pa.list_(pa.float64()))
    flat = [v[0] if isinstance(v, list) and v else None if isinstance(v, list) else v for v in labels]
    if kind in ("float64", "float32"):
        return pa.array([float(v) if isinstance(v, (int, float)) else None for v in flat],
                        pa.float64() if kind == "float64" else pa.float32())
    if kind in ("int64", "int32", "int8", "uint64"):
        ints = _ints(flat)
        if kind == "uint64":
            return pa.array([None if v is None else abs(v) for v in ints], pa.uint64())
        if kind == "int32":
            return pa.array([None if v is None else v % 2**31 for v in ints], pa.int32())
        if kind == "int8":
            return pa.array([None if v is None else v % 128 for v in ints], pa.int8())
        return pa.array(ints, pa.int64())
    if kind in ("string", "dictionary"):
        column = pa.array([None if v is None else str(v) for v in flat], pa.string())
        return column.dictionary_encode() if kind == "dictionary" else column
    if kind == "bool":
        return pa.array([None if v is None else bool(v) for v in flat], pa.bool_())
    if kind == "null":
        return pa.nulls(len(labels))
    if kind == "date":
        return pa.array([None if v is None else int(_ints([v])[0]) % 10000 for v in flat], pa.date32())
    if kind == "decimal":
        return pa.array([None if v is None else int(_ints([v])[0]) % 10**9 for v in flat], pa.decimal128(12, 2))
    raise AssertionError(kind)


def build_table(seed: pa.Table, edits) -> pa.Table:
    """The seed table with ``edits`` applied (rebuilt from Python values, each column of its kind)."""
    rows = seed.column("features").to_pylist()
    labels = seed.column("label").to_pylist()
    features_kind = "vector" if pa.types.is_struct(seed.column("features").type) else (
        "list<int64>" if pa.types.is_integer(seed.column("features").type.value_type) else "list<float32>")
    label_kind = "list<int64>" if pa.types.is_list(seed.column("label").type) else "int64"
    layout = "plain"
    for edit in edits:
        kind = edit[0]
        n = len(rows)
        if kind == "features type":
            features_kind = edit[1]
        elif kind == "label type":
            label_kind = edit[1]
        elif kind == "feature value" and n:
            row = rows[edit[1] % n]
            values = row.get("values") if isinstance(row, dict) else row
            if values:
                values[edit[2] % len(values)] = edit[3]
        elif kind == "label value" and n:
            i = edit[1] % n
            if isinstance(labels[i], list) and labels[i]:
                labels[i][0] = edit[2]
            else:
                labels[i] = edit[2]
        elif kind == "null row" and n:
            (rows if edit[1] == "features" else labels)[edit[2] % n] = None
        elif kind == "ragged" and n:
            column = rows if edit[1] == "features" else labels
            row = column[edit[2] % n]
            values = row.get("values") if isinstance(row, dict) else row
            if isinstance(values, list):
                change = edit[3]
                if change >= 0:
                    values.extend([1.0] * change)
                else:
                    del values[change:]
        elif kind == "rows":
            rows, labels = rows[:edit[1]], labels[:edit[1]]
        elif kind == "column":
            layout = edit[1] if edit[1] != "duplicate rows" else layout
            if edit[1] == "duplicate rows":
                rows, labels = rows + rows, labels + labels
        elif kind == "vector" and n:
            row = rows[edit[1] % n]
            if isinstance(row, dict):
                value = edit[3]
                if edit[2] in ("type", "size"):
                    value = value if value is None or isinstance(value, int) else len(value)
                    value = value % 128 if edit[2] == "type" and value is not None else value
                elif edit[2] == "indices":
                    value = None if value is None else [v % 2**31 if isinstance(v, int) else 0 for v in
                                                        (value if isinstance(value, list) else [value])]
                else:
                    value = None if value is None else [float(v) if isinstance(v, (int, float)) else None for v in
                                                        (value if isinstance(value, list) else [value])]
                row[edit[2]] = value
    columns = {"features": _column(features_kind, rows), "label": _label_column(label_kind, labels)}
    if layout == "drop features":
        del columns["features"]
    elif layout == "drop label":
        del columns["label"]
    elif layout == "rename features":
        columns["Features"] = columns.pop("features")
    elif layout == "rename label":
        columns["labels"] = columns.pop("label")
    elif layout == "swap":
        columns = {"features": columns["label"], "label": columns["features"]}
    elif layout == "extra":
        columns["weight"] = pa.array([1.0] * len(rows))
    return pa.table(columns)


PARQUET_REGRESSIONS = [
    ("vectors", [("null row", "features", 0)], 4, []),  # TypeError: 'NoneType' object is not subscriptable
    ("vectors", [("vector", 0, "indices", [99])], 4, []),  # ValueError: shape mismatch (one index, two values)
    ("vectors", [("vector", 0, "indices", [2**31 - 1, 0])], 4, []),  # IndexError: index beyond the vector's size
    ("classes", [("label type", "float64"), ("label value", 0, 1e30)], 4, []),  # a label of -2**63, silently
    ("classes", [("features type", "list<float64>"), ("ragged", "features", 1, 2)], 4, []),  # no file name
]
"""Inputs the reader once failed on: a null ML vector, a sparse vector with fewer indices than values or an index
beyond its size, a label beyond int64 (cast to a negative class id without a word), and every message without the
file's name."""


def test_fuzzed_parquet_reads_or_is_a_value_error_naming_the_file(tmp_path, tallies):
    tally = tallies["parquet"] = Tally("parquet")
    seeds = _parquet_seeds()
    path = tmp_path / "data.parquet"

    def read():
        train, test, info = read_parquet_dataset(str(path))
        for part in (train, test):
            assert np.isfinite(part.x).all() and part.y.dtype == np.int64
            assert len(part.x) == len(part.y) and 0 <= part.y.min() and part.y.max() < info["num_classes"]
        return info

    def case(value):
        name, edits, group, byte_edits = value
        table = build_table(seeds[name], edits)
        pq.write_table(table, path, row_group_size=group)
        if byte_edits:
            path.write_bytes(apply_bytes(path.read_bytes(), byte_edits))
        describe = lambda: (  # noqa: E731
            f"{name} edited {edits}, row groups of {group}, bytes {byte_edits}: {table.schema}")
        tally.run(read, (ValueError,), str(path), describe)

    _fuzz(PARQUET_CASE, case, PARQUET_REGRESSIONS)
    _finish(tally)


# -- the writers, failing ----------------------------------------------------------------------------
class _CutStream:
    """An output stream that writes the first ``keep`` of the bytes it is given, then fails (a full disk)."""

    def __init__(self, stream, keep: float, path: str):
        self.stream, self.keep, self.path = stream, keep, path

    def write(self, data) -> None:
        self.stream.write(bytes(data)[:int(len(data) * self.keep)])
        raise OSError(errno.ENOSPC, "No space left on device (injected)", self.path)

    def close(self) -> None:
        self.stream.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _FailingFS:
    """A pyarrow filesystem that fails once: the ``at``-th time it does ``op`` (``open``: opening a file to write;
    ``write``: writing a file, after part of its bytes; ``create_dir``; ``delete_dir``)."""

    def __init__(self, fs, op: str, at: int, keep: float = 0.5):
        self._fs, self.op, self.at, self.keep = fs, op, at, keep
        self.done: Counter = Counter()

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def _due(self, op: str) -> bool:
        self.done[op] += 1
        return op == self.op and self.done[op] == self.at + 1

    def create_dir(self, path, *args, **kwargs):
        if self._due("create_dir"):
            raise OSError(errno.EACCES, "Permission denied (injected)", path)
        return self._fs.create_dir(path, *args, **kwargs)

    def delete_dir(self, path, *args, **kwargs):
        if self._due("delete_dir"):
            raise OSError(errno.EBUSY, "Device or resource busy (injected)", path)
        return self._fs.delete_dir(path, *args, **kwargs)

    def open_output_stream(self, path, *args, **kwargs):
        if self._due("open"):
            raise OSError(errno.EACCES, "Permission denied (injected)", path)
        stream = self._fs.open_output_stream(path, *args, **kwargs)
        return _CutStream(stream, self.keep, path) if self._due("write") else stream


FAILURE = st.one_of(
    st.tuples(st.sampled_from(["open", "write"]), st.integers(0, 6), st.floats(0, 1)),
    st.tuples(st.sampled_from(["create_dir", "delete_dir"]), st.just(0), st.just(0.0)),
    st.tuples(st.just("none"), st.just(0), st.just(0.0)),
)
"""Which filesystem call fails: the ``n``-th file opened or written (cut after that fraction of its bytes), the
folder's creation, the old folder's deletion; or none."""
CONTENT = st.sampled_from(["fine"] * 6 + ["config with an object", "module with a lambda"])
"""What is saved: a net and a configuration that store, or one of them that cannot be stored."""
_SAVE_ERRORS = (OSError, PermissionError, NotADirectoryError, FileExistsError, ValueError, TypeError)
"""The errors a save may end in: the filesystem's, a target that is not a model folder, content that cannot
be stored."""


def _same(a, b) -> bool:
    """Whether two weight collections hold the same layers, shapes and values."""
    shapes = [[(name, i, tuple(t.shape)) for name, i, t in w.tensors()] for w in (a, b)]
    return shapes[0] == shapes[1] and a.max_abs_diff(b) == 0


def test_a_model_save_that_fails_leaves_no_folder_that_loads(tmp_path, tallies):
    tally = tallies["save_model failing"] = Tally("save_model failing")
    old, new = _small_net(seed=0), _small_net(seed=1)
    root = tmp_path / "cases"
    real = model_io.filesystem

    def case(value):
        before, overwrite, content, (op, at, keep) = value
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        target = root / "model"
        if before == "the old model":
            model_io.save_model(target, old)
        elif before == "a file":
            target.write_bytes(b"not a model")
        elif before == "another folder":
            target.mkdir()
            (target / "notes.txt").write_text("mine")
        elif before == "under a file":
            (root / "file").write_bytes(b"x")
            target = root / "file" / "model"
        net, config = new, {"steps": 3}
        if content == "config with an object":
            config = {"steps": object()}
        elif content == "module with a lambda":
            net = torch.nn.Linear(6, 3)
            net.hook = lambda x: x

        def failing(path):
            fs, where = real(path)
            return _FailingFS(fs, op, at, keep), where

        def save():
            with mock.patch.object(model_io, "filesystem", failing):
                return model_io.save_model(target, net, config=config, overwrite=overwrite)

        error = tally.run(save, _SAVE_ERRORS, "", lambda: f"{value}", judge=lambda path: "saved")
        try:
            loaded = model_io.load_model(target)
        except (ValueError, FileNotFoundError):
            loaded = None
        describe = f"{value}: the save {'returned' if error is None else f'raised {error!r}'}"
        left = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
        if error is not None and before == "the old model" and not (
                loaded is not None and _same(loaded.weights, old.get_weights())):
            tally.fail("loses the old model", f"a save that failed did not leave the old model as it was: {describe}")
        elif loaded is not None and _same(loaded.weights, new.get_weights()) and loaded.config == {"steps": 3}:
            tally.then("loads the new model")
        elif loaded is not None and before == "the old model" and _same(loaded.weights, old.get_weights()):
            tally.then("loads the old model")
        elif loaded is not None:
            tally.fail("loads a mix", f"the folder loads neither model whole: {describe}")
        elif before == "a file" and target.read_bytes() == b"not a model":
            tally.then("nothing loads (the file is untouched)")
        elif before == "another folder" and left == ["notes.txt"]:
            tally.then("nothing loads (the other folder is untouched)")
        elif left:
            tally.fail("leaves files", f"a folder that does not load is left ({left}): {describe}")
        else:
            tally.then("nothing loads")

    _fuzz(st.tuples(st.sampled_from(["nothing", "the old model", "a file", "another folder", "under a file"]),
                    st.booleans(), CONTENT, FAILURE), case, cases=WRITE_CASES)
    _finish(tally, WRITE_CASES)


def test_a_checkpoint_save_that_fails_leaves_the_last_good_one(tmp_path, tallies):
    tally = tallies["checkpoint save failing"] = Tally("checkpoint save failing")
    net = _small_net()
    saved = {r: (net.get_weights() * float(r), {"step": r}) for r in (1, 2, 3)}
    seed = tmp_path / "seed"
    manager = CheckpointManager(str(seed))
    for r in (1, 2):
        manager.save(r, saved[r][0], saved[r][1])
    root = tmp_path / "ck"

    def case(value):
        round_, content, (op, at, keep) = value
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(seed, root)
        writer = CheckpointManager(str(root))
        writer.fs = _FailingFS(writer.fs, op, at, keep)
        weights, state = saved[round_]
        if content == "state with an object":
            state = {"step": round_, "sampler": object()}
        error = tally.run(lambda: writer.save(round_, weights, state), (OSError, PermissionError, CheckpointError,
                                                                        TypeError), "", lambda: f"{value}",
                          judge=lambda path: "saved")
        reader = CheckpointManager(str(root))
        checkpoint = reader.load()
        describe = f"{value}: the save {'returned' if error is None else f'raised {error!r}'}; {reader.rounds()} listed"
        # a failed save of round 3 leaves round 2; one of round 2 again, the old round 2 or (deleted first) round 1
        expected = {round_} if error is None else {2} if round_ == 3 else {1, 2}
        whole = (checkpoint.round in expected and _same(checkpoint.weights, saved[checkpoint.round][0])
                 and checkpoint.state == saved[checkpoint.round][1])
        if not whole:
            tally.fail("resumes wrongly", f"resumes round {checkpoint.round}: {describe}")
        elif error is not None and (root / f"ckpt-{round_:08d}").exists() and round_ not in reader.rounds():
            tally.fail("leaves a folder", f"the failed save's folder is left: {describe}")
        else:
            tally.then(f"resumes round {checkpoint.round}")

    _fuzz(st.tuples(st.sampled_from([2, 3]), st.sampled_from(["fine"] * 6 + ["state with an object"]), FAILURE),
          case, cases=WRITE_CASES)
    _finish(tally, WRITE_CASES)

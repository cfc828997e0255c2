"""The header of one .safetensors file, validated as strictly as the safetensors library validates it.

A file is an 8-byte little-endian length N, N bytes of UTF-8 JSON ({name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {str: str}}), then the data. Files come from outside, so everything is checked
before a byte of data is trusted: the JSON is strict (UTF-8 only, no duplicate keys, no NaN or Infinity, bounded
nesting), shapes and offsets are JSON integers in int64 range, and the tensors' byte ranges tile the data exactly,
from 0 to the end of the file, without gaps or overlaps (so a small file can never make a reader allocate more
than its own size). Every defect is a ValueError naming the file, and the tensor where there is one.
"""
import json
import math
import re

from .dtypes import DTYPES, PACKED_X2, READ_ONLY

MAX_HEADER = 100 << 20
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
MAX_DEPTH = 8  # a valid header nests three deep (header, entry, shape); deeper is refused before parsing
INT64_MAX = 2**63 - 1


class Location:
    """Where one tensor's bytes are: file, absolute offset, byte count, and what the file says it is. source: the
    file whose header said so, as (its path with links resolved, its identity: st_dev, st_ino, birth ns, its
    (size, mtime ns) then), or None. Readers pass it to pread (io_path, identity), so a file replaced at its name
    since its header was read (a save committed meanwhile) is refused instead of read at the old header's offsets;
    files.check_unchanged tells one written in place meanwhile."""

    __slots__ = ("path", "offset", "nbytes", "dtype", "shape", "source")

    def __init__(self, path, offset, nbytes, dtype, shape, source=None):
        self.path, self.offset, self.nbytes, self.dtype, self.shape = path, offset, nbytes, dtype, shape
        self.source = source

    @property
    def io_path(self):
        return self.path if self.source is None else self.source[0]

    @property
    def identity(self):
        return None if self.source is None else self.source[1]

    def as_tuple(self):
        return self.path, self.offset, self.nbytes


def _short(value, limit=200):
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def json_depth(text):
    """How deep brackets nest outside strings: a cheap scan, so deep nesting never reaches the recursive parser."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def strict_json(raw, what):
    """Parses JSON bytes as the safetensors library does; ValueError starting with `what` on any defect."""
    try:
        text = raw.decode("utf-8")  # json.loads(bytes) would also take UTF-16 and UTF-32
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what}: not UTF-8 JSON ({exc.reason} at byte {exc.start})") from None
    if json_depth(text) > MAX_DEPTH:
        raise ValueError(f"{what}: the JSON nests deeper than {MAX_DEPTH} levels")

    def no_duplicates(pairs):
        out = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"{what}: the JSON has the key {_short(key)} twice")
            out[key] = value
        return out

    def no_constant(name):
        raise ValueError(f"{what}: the JSON holds {name}, which is not valid JSON")
    try:
        parsed = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"{what}: the JSON nests too deep") from None
    if _SURROGATE_ESCAPE.search(text):  # rare: walk the strings only then
        _no_lone_surrogates(parsed, what)
    return parsed


def _no_lone_surrogates(value, what):
    """ValueError where a string escapes half a surrogate pair (\\ud800 alone): Python's json accepts it, and the
    safetensors library (Rust's serde_json) refuses the file; such a name could not be written back either."""
    strings = []
    if isinstance(value, str):
        strings.append(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            strings.append(key)
            _no_lone_surrogates(item, what)  # (depth checked above: no RecursionError)
    elif isinstance(value, list):
        for item in value:
            _no_lone_surrogates(item, what)
    for text in strings:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{what}: the JSON string {_short(text)} holds a lone surrogate escape, which is not "
                             "valid Unicode") from None


def _ints(value):
    """value as a tuple of ints if it is a JSON list of integers in int64 range (not bools, floats or strings)."""
    if not isinstance(value, list) or not all(type(v) is int and 0 <= v <= INT64_MAX for v in value):
        raise TypeError
    return tuple(value)


def parse_header(path, raw, file_size, source=None):
    """({name: Location}, __metadata__ ({str: str}, empty when absent)) from the header bytes `raw` of the file at
    path, which has file_size bytes (source: that file's, for the Locations; see Location)."""
    header = strict_json(raw, path)
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path}: __metadata__ must map strings to strings, got {_short(metadata)}")
    data_start = 8 + len(raw)
    out, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            if not isinstance(entry, dict):
                raise TypeError
            name_of_dtype = entry["dtype"]
            unknown = isinstance(name_of_dtype, str) and name_of_dtype not in DTYPES and name_of_dtype not in READ_ONLY
            dtype = None if unknown else DTYPES.get(name_of_dtype) or READ_ONLY[name_of_dtype]
            shape = _ints(entry["shape"])
            begin, end = _ints(entry["data_offsets"])  # (a ValueError when not a pair)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has a malformed or unsupported header entry "
                             f"{_short(entry)}") from None
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {name_of_dtype!r}, which swapio cannot load "
                             f"(unsupported; it reads {', '.join(sorted(DTYPES) + sorted(READ_ONLY))})")
        if name_of_dtype == PACKED_X2:  # counted in 4-bit elements: torch's dtype holds two of them
            if not shape or shape[-1] % 2:
                raise ValueError(f"{path}: tensor {name!r} of {PACKED_X2} has shape {list(shape)}, whose last "
                                 "dimension is not even (two 4-bit elements to a byte)")
            shape = (*shape[:-1], shape[-1] // 2)
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if numel > INT64_MAX or nbytes > INT64_MAX or end < begin or end - begin != nbytes:
            raise ValueError(f"{path}: tensor {name!r} spans bytes [{begin}, {end}) but shape {list(shape)} of "
                             f"{entry['dtype']} needs {nbytes}")
        if data_start + end > file_size:
            raise ValueError(f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has "
                             f"{file_size} bytes (truncated)")
        extent = dtype.itemsize
        for n in shape:
            extent *= max(n, 1)  # torch multiplies every dimension, a zero one included, and checks for overflow
        if extent >= 1 << 63:
            raise ValueError(f"{path}: tensor {name!r} has shape {list(shape)}, whose storage size overflows 64 "
                             "bits")
        spans.append((begin, end, name))
        out[name] = Location(path, data_start + begin, nbytes, dtype, shape, source)
    _check_tiling(path, spans, file_size - data_start)
    return out, metadata


def _check_tiling(path, spans, data_bytes):
    """The tensors' ranges must cover [0, data_bytes) one after the other, as the safetensors library requires."""
    at, previous = 0, None
    for begin, end, name in sorted(spans):
        if begin != at:
            what = f"overlaps tensor {previous!r}" if begin < at else f"leaves bytes [{at}, {begin}) unused"
            raise ValueError(f"{path}: tensor {name!r} starts at data byte {begin}, which {what}")
        at, previous = end, name
    if at != data_bytes:
        raise ValueError(f"{path}: the tensors end at data byte {at} but the file holds {data_bytes} bytes of data")

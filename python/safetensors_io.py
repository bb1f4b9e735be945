"""Minimal safetensors reader and writer (numpy only, no `safetensors` package).

File layout (https://github.com/huggingface/safetensors):

    [8 bytes]  N, little-endian u64: length of the JSON header in bytes
    [N bytes]  JSON object, UTF-8, right-padded with spaces so N % 8 == 0:
                 {"<name>": {"dtype": "F32", "shape": [..],
                             "data_offsets": [begin, end]},
                  ...,
                  "__metadata__": {"<key>": "<string value>", ...}}
    [rest]     raw little-endian, row-major tensor data; offsets are relative
               to the start of this section, and the section has no holes.

Padding the header keeps every tensor 8-byte aligned when the data section is
mapped, which is why readers may assume alignment.
"""

import json
import os
import struct
import tempfile

import numpy as np

# Only the dtypes the project exchanges; extend with care (BF16 has no numpy
# equivalent and would need a bit-level conversion).
_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
}
_NAMES = {dt: name for name, dt in _DTYPES.items()}

# Guard against reading garbage as a header length (a truncated or non
# safetensors file would otherwise ask for gigabytes).
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def _dtype_name(array):
    dt = array.dtype.newbyteorder("<")
    if dt not in _NAMES:
        raise TypeError(
            f"unsupported dtype {array.dtype}; supported: "
            + ", ".join(str(d) for d in _NAMES))
    return _NAMES[dt]


def serialize(tensors, metadata=None):
    """Return the bytes of a safetensors file holding `tensors`.

    tensors: mapping name -> array-like (numpy array or anything np.asarray
             accepts, e.g. a CPU torch tensor); stored with its own dtype.
    metadata: optional mapping str -> str, stored under "__metadata__".
    """
    header = {}
    chunks = []
    offset = 0
    for name in sorted(tensors):
        if name == "__metadata__":
            raise ValueError("'__metadata__' is reserved and cannot name a tensor")
        array = np.asarray(tensors[name])
        dtype = _dtype_name(array)
        data = np.ascontiguousarray(array, dtype=_DTYPES[dtype]).tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": [int(n) for n in array.shape],
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    if metadata:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(
                    f"metadata must map str -> str; got {key!r}: {type(value).__name__}")
        header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def save_file(tensors, path, metadata=None):
    """Write a safetensors file atomically.

    The bytes go to a temporary file in the destination directory, are
    fsync'ed, and then os.replace() moves it over `path`, so a reader never
    sees a half-written file and a crash leaves the old file intact.
    """
    blob = serialize(tensors, metadata)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(
        prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def deserialize(blob):
    """Parse safetensors bytes; return (tensors: dict name -> ndarray, metadata).

    Validates what a careless writer gets wrong: header length, dtype, that
    each byte range matches its shape, and that ranges tile the data section
    exactly (no holes, no overlaps, no trailing bytes).
    """
    if len(blob) < 8:
        raise ValueError(f"safetensors: {len(blob)} bytes, too short for the header length")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > _MAX_HEADER_BYTES or 8 + n > len(blob):
        raise ValueError(f"safetensors: header length {n} exceeds the file ({len(blob)} bytes)")
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("safetensors: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data = memoryview(blob)[8 + n:]

    tensors = {}
    ranges = []
    for name, info in header.items():
        dtype = info.get("dtype")
        if dtype not in _DTYPES:
            raise ValueError(f"safetensors: tensor {name!r} has unsupported dtype {dtype!r}")
        shape = tuple(int(s) for s in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        expected = _DTYPES[dtype].itemsize * int(np.prod(shape, dtype=np.int64))
        if not 0 <= begin <= end <= len(data) or end - begin != expected:
            raise ValueError(
                f"safetensors: tensor {name!r} {dtype}{list(shape)} needs {expected} bytes "
                f"but has data_offsets [{begin}, {end}] in a {len(data)}-byte data section")
        array = np.frombuffer(data[begin:end], dtype=_DTYPES[dtype]).reshape(shape)
        tensors[name] = array.copy()  # own the memory, writable, native order
        ranges.append((begin, end, name))

    cursor = 0
    for begin, end, name in sorted(ranges):
        if begin != cursor:
            raise ValueError(
                f"safetensors: data section has a hole or overlap at byte {cursor} "
                f"(tensor {name!r} starts at {begin})")
        cursor = end
    if cursor != len(data):
        raise ValueError(
            f"safetensors: {len(data) - cursor} trailing bytes after the last tensor")
    return tensors, dict(metadata)


def load_file(path):
    """Read a safetensors file; return (tensors, metadata)."""
    with open(path, "rb") as f:
        return deserialize(f.read())

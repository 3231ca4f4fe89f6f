"""The runner protocol: one JSON line per message, then the raw bytes of the arrays it names.

Host and runner (a target's process, see ``slmedge.targets.runner``) exchange requests and
replies on a pipe (stdin/stdout of a child, of ``qemu-aarch64``, or of ``ssh``). Arrays travel as
bytes, never as pickles; the JSON header lists each one's dtype and shape.
"""

from __future__ import annotations

import json

import numpy as np

MAX_HEADER = 1 << 26


class WireError(Exception):
    """The other end closed the pipe or sent something that is not a message."""


def send(stream, header: dict, arrays: list | None = None) -> None:
    arrays = [np.ascontiguousarray(a) for a in (arrays or [])]
    head = dict(header)
    head["arrays"] = [{"dtype": a.dtype.str, "shape": list(a.shape)} for a in arrays]
    stream.write(json.dumps(head, separators=(",", ":")).encode("utf-8") + b"\n")
    for a in arrays:
        stream.write(a.tobytes())
    stream.flush()


def recv(stream) -> tuple[dict, list]:
    line = stream.readline(MAX_HEADER)
    if not line:
        raise WireError("the other end closed the connection")
    try:
        head = json.loads(line)
    except ValueError as exc:
        raise WireError(f"not a protocol message: {line[:200]!r}") from exc
    arrays = []
    for spec in head.pop("arrays", []):
        dtype = np.dtype(spec["dtype"])
        n = int(np.prod(spec["shape"], dtype=np.int64)) * dtype.itemsize
        buf = _read_exact(stream, n)
        arrays.append(np.frombuffer(buf, dtype=dtype).reshape(spec["shape"]))
    return head, arrays


def _read_exact(stream, n: int) -> bytes:
    chunks, left = [], n
    while left:
        b = stream.read(left)
        if not b:
            raise WireError(f"the connection closed {left} bytes before the end of an array")
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)

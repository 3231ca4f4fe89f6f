"""The checksum a GGUF file slmedge wrote carries inside itself.

A GGUF export is one file, and its manifest is one of its metadata strings (``slmedge.manifest``),
so the file cannot list its own sha256 the way an artifact's manifest lists its files. Instead
the manifest records ``file_sha256``: the sha256 of every byte of the file except the manifest
string's own bytes. The writer leaves fixed-width placeholders in the manifest, hashes the
finished file around them, and writes the real values in place (the string keeps its length, so
no offset moves). A reader hashes the same bytes and compares; the manifest's content is covered
by its seal (``manifest_sha256``, see ``slmedge.fsutil.check_seal``). A GGUF without the metadata key
(one slmedge did not write) has nothing to check and passes; one whose manifest lacks either digest
is refused: every GGUF slmedge released wrote both (the unsealed manifests of the development builds
before 9705866, 2026-12-01, cannot be told from a manifest whose seal was removed).

``check_gguf`` is the one place that decides a GGUF slmedge wrote was modified since: it raises
``ModifiedGGUFError`` for that alone (its manifest intact, its bytes not), e.g. a file re-quantized
by llama-quantize from slmedge's export, which carries the export's manifest along.

``input_gguf_manifest`` is how a GGUF given as an input (to evaluate, inspect, import) is read: a file
``check_gguf`` finds modified since slmedge wrote it is a file slmedge did not write (llama-quantize's
output from slmedge's f16 export is the ordinary case), its manifest ignored with one note saying so.
Where slmedge reuses its own outputs as its own (caches, a study's exports: ``reusable``) the
same finding still refuses the file: those callers use ``check_gguf`` itself.

It lives with the models because a GGUF is also a model source (``models.source`` imports one).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ArtifactError
from ..fsutil import SEAL_KEY, check_seal, sealed

MANIFEST_KEY = "slmedge.manifest"  # the metadata key holding an slmedge GGUF export's manifest
FILE_KEY = "file_sha256"
PLACEHOLDER = "0" * 64  # a sha256's width: the real value replaces it in place


class ModifiedGGUFError(ArtifactError):
    """A GGUF carries slmedge's manifest, intact and sealed, but its bytes are no longer those slmedge
    wrote (``check_gguf``)."""


def manifest_text(manifest: dict) -> str:
    """How the manifest is stored: sorted keys, no spaces (the seal is over a canonical form of the
    content, so a reader takes whatever spacing; the writer's own two writes must match in length)."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), default=str)


def placeholder_manifest(manifest: dict) -> dict:
    """``manifest`` as the writer first stores it: both digests as fixed-width placeholders."""
    return {**manifest, FILE_KEY: PLACEHOLDER, SEAL_KEY: PLACEHOLDER}


# GGUF metadata value types -> their width in bytes (8: string, 9: array are read as they come)
_WIDTH = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# ... and how a scalar of each type reads (struct format, little-endian)
_FORMAT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _header(buf):
    """(key, value type, offset of the value) of each key/value of a little-endian GGUF's header in
    ``buf`` (bytes or an mmap), walking the header alone (gguf.GGUFReader builds an object for every
    vocabulary entry first: 5 s for a 49k-token vocabulary, against ~0.05 s here). ValueError: not a
    GGUF this walk reads (big-endian, truncated, not a GGUF)."""
    import struct

    size = len(buf)
    if size < 24 or buf[:4] != b"GGUF":
        raise ValueError("not a GGUF")
    version, _n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version & 0xFFFF == 0 or version > 0xFFFF:  # a big-endian file: GGUFReader reads those
        raise ValueError("big-endian GGUF")
    at = 24

    def need(n: int) -> None:
        if at + n > size:
            raise ValueError("truncated GGUF metadata")

    def skip(vtype: int) -> None:
        nonlocal at
        if vtype == 8:
            need(8)
            (n,) = struct.unpack_from("<Q", buf, at)
            need(8 + n)
            at += 8 + n
        elif vtype == 9:
            need(12)
            etype, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if etype in _WIDTH:
                need(count * _WIDTH[etype])
                at += count * _WIDTH[etype]
            else:
                for _ in range(count):
                    skip(etype)
        elif vtype in _WIDTH:
            need(_WIDTH[vtype])
            at += _WIDTH[vtype]
        else:
            raise ValueError(f"unknown GGUF value type {vtype}")

    for _ in range(n_kv):
        need(8)
        (n,) = struct.unpack_from("<Q", buf, at)
        need(8 + n + 4)
        name = bytes(buf[at + 8: at + 8 + n])
        (vtype,) = struct.unpack_from("<I", buf, at + 8 + n)
        at += 8 + n + 4
        yield name, vtype, at
        skip(vtype)


def string_value_span(path: Path, key: str) -> tuple[int, int] | None:
    """(offset, length) of the bytes of the string metadata ``key`` of a little-endian GGUF (``_header``).
    None: no such string key. ValueError: not a GGUF this walk reads."""
    import mmap
    import struct

    want = key.encode("utf-8")
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for name, vtype, at in _header(buf):
            if name == want and vtype == 8:
                if at + 8 > len(buf):
                    raise ValueError("truncated GGUF metadata")
                (length,) = struct.unpack_from("<Q", buf, at)
                if at + 8 + length > len(buf):
                    raise ValueError("truncated GGUF metadata")
                return at + 8, int(length)
    return None


def header_values(path: Path, keys) -> dict:
    """The metadata ``keys`` of a little-endian GGUF file, read from its header alone: numbers,
    booleans and strings as they are; an array as its length, or, for an array of numbers, its
    largest element (per-layer head counts). Keys it does not have are left out. ValueError: not a
    GGUF this walk reads."""
    import mmap
    import struct

    want = {k.encode("utf-8"): k for k in keys}
    out: dict = {}
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for name, vtype, at in _header(buf):
            if name not in want:
                continue
            if vtype in _FORMAT:
                (out[want[name]],) = struct.unpack_from(_FORMAT[vtype], buf, at)
            elif vtype == 8:
                (n,) = struct.unpack_from("<Q", buf, at)
                out[want[name]] = bytes(buf[at + 8: at + 8 + n]).decode("utf-8", "replace")
            elif vtype == 9:
                etype, count = struct.unpack_from("<IQ", buf, at)
                if etype in _FORMAT and count and at + 12 + count * _WIDTH[etype] <= len(buf):
                    fmt = _FORMAT[etype]
                    out[want[name]] = max(struct.unpack_from(f"<{count}{fmt[1]}", buf, at + 12))
                else:
                    out[want[name]] = int(count)
    return out


def _manifest_span(path: Path, key: str = MANIFEST_KEY) -> tuple[int, int, dict] | None:
    """(offset, length, parsed manifest) of the manifest string's bytes in the file (under ``key``); None:
    it has none, or the file is no readable GGUF at all (then the reader that opens it next refuses it, in
    its words)."""
    try:
        span = string_value_span(path, key)
    except ValueError:
        span = _reader_span(path, key)  # what the walk does not read (big-endian), gguf's reader does
    except OSError:
        return None
    if span is None:
        return None
    start, length = span
    with open(path, "rb") as handle:
        handle.seek(start)
        value = handle.read(length)
    try:
        manifest = json.loads(value.decode("utf-8"))
    except ValueError as exc:
        raise ArtifactError(f"{path}: its {key} metadata is not JSON: the file was changed or is "
                            "corrupt") from exc
    return start, length, manifest


def _reader_span(path: Path, key: str = MANIFEST_KEY) -> tuple[int, int] | None:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception:  # noqa: BLE001 - not a GGUF at all, or truncated: its reader says so when it opens it
        return None
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return field.offset + sum(int(p.nbytes) for p in field.parts[:field.data[0]]), int(value.nbytes)


def _digest_around(path: Path, start: int, length: int) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        remaining = start
        while remaining > 0:
            block = handle.read(min(1 << 20, remaining))
            if not block:
                break
            digest.update(block)
            remaining -= len(block)
        handle.seek(start + length)
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def seal_gguf(path, key: str = MANIFEST_KEY) -> dict:
    """Write the real digests into a GGUF whose manifest (the metadata string ``key``: an export's
    ``slmedge.manifest``, an importance matrix's ``slmedge.imatrix``) holds the placeholders; return the
    manifest."""
    path = Path(path)
    span = _manifest_span(path, key)
    if span is None:
        raise ArtifactError(f"{path} has no {key} to seal")
    start, length, manifest = span
    # Sealed only as the writer left it: both digests still placeholders. A manifest with anything
    # else there was not written by this export, and is never sealed from what it says.
    if not isinstance(manifest, dict) or manifest.get(FILE_KEY) != PLACEHOLDER or manifest.get(SEAL_KEY) != PLACEHOLDER:
        raise ArtifactError(f"cannot seal {path}: its manifest is not one this export left to seal")
    manifest[FILE_KEY] = _digest_around(path, start, length)
    manifest = sealed(manifest)
    text = manifest_text(manifest).encode("utf-8")
    if len(text) != length:  # the placeholders were not written by placeholder_manifest
        raise ArtifactError(f"cannot seal {path}: its manifest changed length ({len(text)} != {length} bytes)")
    with open(path, "r+b") as handle:
        handle.seek(start)
        handle.write(text)
    return manifest


def check_gguf(path, key: str = MANIFEST_KEY) -> dict | None:
    """The manifest of a GGUF slmedge wrote (the metadata string ``key``), after checking the file and the
    manifest against the digests it records (ArtifactError naming the file when either changed); None: no
    manifest."""
    path = Path(path)
    span = _manifest_span(path, key)
    if span is None:
        return None
    start, length, manifest = span
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: its {key} metadata is not an slmedge manifest")
    where = f"the manifest inside {path}"
    check_seal(manifest, where, ArtifactError, required=True)
    recorded = manifest.get(FILE_KEY)
    if not isinstance(recorded, str):
        raise ArtifactError(f"{where} has no {FILE_KEY}, and slmedge writes every GGUF with it: it cannot be "
                            "trusted; export it again")
    if recorded != _digest_around(path, start, length):
        raise ModifiedGGUFError(f"checksum mismatch for {path}: the file was modified or is corrupt since slmedge "
                                "wrote it; export it again")
    return manifest


def input_gguf_manifest(path) -> tuple[dict | None, str | None]:
    """(manifest, note) of a GGUF given as an input: the manifest ``check_gguf`` returns, or, for a file
    it finds modified since slmedge wrote it, no manifest and a one-line note that it was ignored and why.
    A manifest that is itself damaged or unsealed is still refused (ArtifactError): that is no file a
    tool derived from slmedge's, but one whose record was changed."""
    path = Path(path)
    try:
        return check_gguf(path), None
    except ModifiedGGUFError:
        return None, (f"{path.name} carries the slmedge.manifest of the file it was made from (llama-quantize "
                      "copies it along), but its tensors are not that file's: the manifest is ignored and the "
                      "file is evaluated as one slmedge did not write")

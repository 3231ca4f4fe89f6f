"""The checksum a GGUF file slmedge wrote carries inside itself.

A GGUF export is one file, and its manifest is one of its metadata strings (``slmedge.manifest``),
so the file cannot list its own sha256 the way an artifact's manifest lists its files. Instead
the manifest records ``file_sha256``: the sha256 of every byte of the file except the manifest
string's own bytes. The writer leaves fixed-width placeholders in the manifest, hashes the
finished file around them, and writes the real values in place (the string keeps its length, so
no offset moves). A reader hashes the same bytes and compares; the manifest's content is covered
by its seal (``manifest_sha256``, see ``slmedge.fsutil.check_seal``). A GGUF without the key (one
slmedge did not write, or wrote before this) has nothing to check and passes.

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


def placeholder_manifest(manifest: dict) -> dict:
    """``manifest`` as the writer first stores it: both digests as fixed-width placeholders."""
    return {**manifest, FILE_KEY: PLACEHOLDER, SEAL_KEY: PLACEHOLDER}


def _manifest_span(path: Path) -> tuple[int, int, dict] | None:
    """(offset, length, parsed manifest) of the manifest string's bytes in the file; None: it has none,
    or the file is no readable GGUF at all (then the reader that opens it next refuses it, in its words)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception:  # noqa: BLE001 - not a GGUF at all, or truncated: its reader says so when it opens it
        return None
    field = reader.fields.get(MANIFEST_KEY)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    start = field.offset + sum(int(p.nbytes) for p in field.parts[:field.data[0]])
    try:
        manifest = json.loads(value.tobytes().decode("utf-8"))
    except ValueError as exc:
        raise ArtifactError(f"{path}: its {MANIFEST_KEY} metadata is not JSON: the file was changed or is "
                            "corrupt") from exc
    return start, int(value.nbytes), manifest


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


def seal_gguf(path) -> dict:
    """Write the real digests into a GGUF whose manifest holds the placeholders; return the manifest."""
    path = Path(path)
    span = _manifest_span(path)
    if span is None:
        raise ArtifactError(f"{path} has no {MANIFEST_KEY} to seal")
    start, length, manifest = span
    manifest[FILE_KEY] = _digest_around(path, start, length)
    manifest = sealed(manifest)
    text = json.dumps(manifest, sort_keys=True, default=str).encode("utf-8")
    if len(text) != length:  # the placeholders were not written by placeholder_manifest
        raise ArtifactError(f"cannot seal {path}: its manifest changed length ({len(text)} != {length} bytes)")
    with open(path, "r+b") as handle:
        handle.seek(start)
        handle.write(text)
    return manifest


def check_gguf(path) -> dict | None:
    """The manifest of a GGUF slmedge wrote, after checking the file and the manifest against the
    digests it records (ArtifactError naming the file when either changed); None: no manifest."""
    path = Path(path)
    span = _manifest_span(path)
    if span is None:
        return None
    start, length, manifest = span
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: its {MANIFEST_KEY} metadata is not an slmedge manifest")
    check_seal(manifest, f"the manifest inside {path}", ArtifactError)
    recorded = manifest.get(FILE_KEY)
    if recorded is not None and recorded != _digest_around(path, start, length):
        raise ArtifactError(f"checksum mismatch for {path}: the file was modified or is corrupt since slmedge wrote "
                            "it; export it again")
    return manifest

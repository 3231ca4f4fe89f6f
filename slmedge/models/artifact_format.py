"""The artifact directory's file names and manifest readers: the one place that says what they are.

An slmedge artifact is a model source like any other (``models.source`` loads it), and it is
what compress writes (``compress.artifact``). The names and the readers live here, in the
lowest layer that needs them, so that loading a model never imports compression code;
``slmedge.compress.artifact`` re-exports every name below, and that is where callers above the
models layer import them from.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ArtifactError
from ..fsutil import check_seal, sha256_file

MANIFEST = "slmedge.json"  # written last: a directory without it is incomplete
QUANT_FILE = "quantization.safetensors"
# Version 2: the tensors that are not rebuilt from the codes (untouched ones in the source's dtype,
# pruned-only linears' kept values); version 1 had the whole model as dense fp32 instead.
WEIGHTS_FILE = "weights.safetensors"
V1_WEIGHTS_FILE = "model.safetensors"
FORMAT = "slmedge-artifact"
# The newest version this slmedge reads. Version 3 is version 2 plus linears on llama.cpp's grids (a
# layer entry's "grid": its codes, fp16 scales and integer sub-block codes, models.grids): written only
# when an artifact holds such a linear, so that an slmedge reading versions 1-2 refuses it rather than
# misreading it; artifacts on the uniform grid alone stay version 2.
FORMAT_VERSION = 3
GRID_VERSION = 3
# Every manifest of this format version or later was written sealed (``manifest_sha256``: seals came
# in 9705866, before version 2 in f8cf15b): one without its seal had it removed, and is refused.
# Version 1 manifests were written both before seals existed and after; an unsealed one still opens
# (its per-layer facts and format version must then agree with its checksummed quantization file).
SEALED_SINCE = 2


def manifest_path(path) -> Path:
    """Where the artifact at ``path`` keeps its manifest (whether or not it is there)."""
    return Path(path) / MANIFEST


def is_artifact(path) -> bool:
    """Whether ``path`` is a complete artifact directory (its manifest is written last)."""
    return manifest_path(path).is_file()


def format_version(manifest: dict) -> int:
    """The artifact format a manifest was written in (1: dense fp32 ``model.safetensors``; 2: compact)."""
    version = manifest.get("format_version", 1) if isinstance(manifest, dict) else 1
    return version if isinstance(version, int) else 1


def is_compact(path, manifest: dict | None = None) -> bool:
    """Whether the artifact at ``path`` is a compact (version 2) one: no HF weights file of its own,
    its weights rebuilt from the codes (``models.artifact_weights``)."""
    manifest = read_manifest(path) if manifest is None else manifest
    return format_version(manifest) >= 2


def read_manifest(path) -> dict:
    """The parsed manifest of the artifact at ``path``, unchecked.

    Raises OSError when it cannot be read and ValueError (``ManifestNotJSON``) when it is not JSON
    (callers that only peek at a manifest catch those); ``open_manifest`` is the checked reader. Manifests written by
    earlier versions read as today's: their recipe's empty ``extra`` table (a setting that was
    never read, since removed) is dropped, a non-empty one is kept so that building a Recipe from
    it fails loudly.
    """
    mpath = manifest_path(path)
    return _parsed(mpath.read_bytes(), mpath)


class ManifestNotJSON(ArtifactError, ValueError):
    """An artifact's manifest that does not parse: an ArtifactError naming the file (one line, exit 1)
    wherever it is read, and still the ValueError a caller that only peeks at a manifest catches."""


def _parsed(raw: bytes, mpath: Path):
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except ValueError as exc:
        raise ManifestNotJSON(f"{mpath} is not valid JSON: the artifact is corrupt") from exc
    recipe = manifest.get("recipe") if isinstance(manifest, dict) else None
    if isinstance(recipe, dict) and recipe.get("extra", None) == {}:
        del recipe["extra"]
    return manifest


def open_manifest(path, verify: bool = True) -> dict:
    """The manifest of the artifact at ``path``, checked: a complete slmedge artifact and (with
    ``verify``) sealed where its format version always is, its seal matching, every file it lists
    matching its sha256. Raises ArtifactError saying what is wrong."""
    return open_manifest_bytes(path, verify)[0]


def open_manifest_bytes(path, verify: bool = True) -> tuple[dict, str]:
    """``open_manifest``, and the sha256 of the very bytes it parsed and checked: what an export
    records as its source's manifest (``source_manifest_sha256``), so that a manifest replaced after
    it was checked is never the one named."""
    import hashlib

    path = Path(path)
    if not path.is_dir():
        raise ArtifactError(f"{path} is not an artifact directory")
    mpath = manifest_path(path)
    if not mpath.is_file():
        raise ArtifactError(f"{path} is incomplete: it has no {MANIFEST} (was the run that wrote it interrupted?)")
    raw = mpath.read_bytes()
    manifest = _parsed(raw, mpath)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{mpath} is not an slmedge artifact manifest")
    if format_version(manifest) > FORMAT_VERSION:
        raise ArtifactError(f"{path} is an artifact of format version {format_version(manifest)}; this slmedge "
                            f"reads versions 1 to {FORMAT_VERSION}: upgrade slmedge")
    if verify:
        check_manifest_seal(path, manifest)
        verify_files(path, manifest)
        _check_layers(path, manifest)
    return manifest, hashlib.sha256(raw).hexdigest()


def check_manifest_seal(path, manifest: dict) -> None:
    """The artifact manifest's seal alone (no file read): present where its format version is always
    sealed (``SEALED_SINCE``), and matching its content. The cheap check before a manifest's content is
    used without opening the artifact (a study's model list, the base model an export names)."""
    check_seal(manifest, manifest_path(path), ArtifactError, required=format_version(manifest) >= SEALED_SINCE)


def quant_metadata(path) -> dict | None:
    """The ``slmedge`` metadata of the artifact's quantization file (its layers' bits, group sizes,
    shapes), read from the safetensors header alone; None when the file or the key is absent."""
    return _safetensors_metadata(Path(path) / QUANT_FILE)


def weights_metadata(path) -> dict | None:
    """The ``slmedge`` metadata of a compact artifact's weights file: ``rebuilt`` (tensor name -> the
    compressed linear whose codes or kept values it is rebuilt from); None when absent."""
    return _safetensors_metadata(Path(path) / WEIGHTS_FILE)


def safetensors_header(f) -> dict | None:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, data_offsets; and
    ``__metadata__``); None when unreadable."""
    try:
        with open(f, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 0 < size <= 100 * 1024**2:
                return None
            header = json.loads(handle.read(size))
    except (OSError, ValueError):
        return None
    return header if isinstance(header, dict) else None


def _safetensors_metadata(f: Path) -> dict | None:
    header = safetensors_header(f)
    meta = (header.get("__metadata__") or {}).get("slmedge") if header is not None else None
    try:
        return json.loads(meta) if meta else None
    except ValueError:
        return None


def _check_layers(path: Path, manifest: dict) -> None:
    """The manifest's per-layer facts must be those of the (checksummed) quantization file: an
    edited manifest (bits 4 -> 8) shows here even when it predates the manifest's seal."""
    meta = quant_metadata(path)
    if meta is not None and "layers" in meta and meta["layers"] != manifest.get("layers"):
        raise ArtifactError(f"{manifest_path(path)} disagrees with {QUANT_FILE} about the compressed layers "
                            "(was the manifest edited?): the artifact cannot be trusted; compress again")
    # The quantization file records the format version it was written in (every version did): a
    # manifest that says otherwise was edited, such as a sealed format's version lowered to pass unsealed.
    written = meta.get("version") if isinstance(meta, dict) else None
    if isinstance(written, int) and written != format_version(manifest):
        raise ArtifactError(f"{manifest_path(path)} says format version {format_version(manifest)}, but {QUANT_FILE} "
                            f"was written in version {written} (was the manifest edited?): the artifact cannot be "
                            "trusted; compress again")
    if format_version(manifest) >= 2:
        weights = weights_metadata(path)
        rebuilt = weights.get("rebuilt") if isinstance(weights, dict) else None
        if not isinstance(rebuilt, dict):
            raise ArtifactError(f"{path / WEIGHTS_FILE} has no readable slmedge metadata: the artifact is corrupt")
        unknown = sorted(set(rebuilt.values()) - set(manifest.get("layers") or {}))
        if unknown:
            raise ArtifactError(f"{path / WEIGHTS_FILE} rebuilds {unknown[0]} from codes the manifest does not list: "
                                "the artifact cannot be trusted; compress again")


def verify_files(path, manifest: dict) -> None:
    """Check every file listed in the manifest against its sha256."""
    path = Path(path)
    files = manifest.get("files")
    if not files:
        raise ArtifactError(f"{manifest_path(path)} lists no files and checksums")
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise ArtifactError(f"artifact {path} is missing {name}")
        if sha256_file(f) != info.get("sha256"):
            raise ArtifactError(f"checksum mismatch for {name} in {path}: the file was modified or is corrupt")

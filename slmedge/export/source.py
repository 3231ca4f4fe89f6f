"""What an export reads: an slmedge artifact (checksums verified, codes loaded) or a plain HF folder."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..compress.artifact import MANIFEST, QUANT_FILE, Artifact
from ..models.artifact_format import is_artifact, is_compact
from .errors import ExportError


@dataclass
class ExportSource:
    path: Path
    artifact: Artifact | None
    config: object
    layers: dict = field(default_factory=dict)

    @property
    def model_type(self) -> str | None:
        return getattr(self.config, "model_type", None)


def open_export_source(source) -> ExportSource:
    from transformers import AutoConfig

    path = Path(source)
    artifact = None
    layers = {}
    if (path / MANIFEST).is_file():
        artifact = Artifact.open(path)  # checks every checksum
        layers = artifact.layers() if (path / QUANT_FILE).is_file() else {}
    elif not (path / "config.json").is_file():
        raise ExportError(f"{path} is neither an slmedge artifact (no {MANIFEST}) nor a Hugging Face folder "
                          "(no config.json)")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
        raise ExportError(f"cannot read {path / 'config.json'}: {str(exc).splitlines()[0]}") from exc
    return ExportSource(path, artifact, config, layers)


def weight_files(path: Path) -> list[Path]:
    """The safetensors weight files of a folder (sharded or not; never quantization.safetensors)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(p for p in path.glob("*.safetensors") if p.name != QUANT_FILE)
    if not files:
        raise ExportError(f"{path} has no safetensors weights")
    return files


def iter_weights(path: Path, names=None):
    """(name, fp32 numpy array) of every weight tensor, or only those in ``names``: a compact
    artifact's rebuilt from its codes, one at a time, in the order of a version-1 weights file."""
    from safetensors import safe_open

    if is_artifact(path) and is_compact(path):
        from ..models.artifact_weights import iter_tensors

        for key, t in iter_tensors(path, names):
            yield key, t.float().numpy()
        return
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                if names is None or key in names:
                    yield key, handle.get_tensor(key).float().numpy()

"""What an export reads: an slmedge artifact (checksums verified, codes loaded) or a plain HF folder."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..compress.artifact import MANIFEST, QUANT_FILE, Artifact
from ..models.artifact_format import is_artifact, is_compact
from ..models.remote_code import refuse_code
from ..errors import brief
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


@dataclass(frozen=True)
class LinearOutline:
    """One compressed linear as the manifest and the quantization file's header describe it, no tensor
    read: its grid (None: pruned only), its (rows, cols) and whether it has a mask."""

    spec: object  # compress.quant.QuantSpec | None
    shape: tuple[int, int]
    masked: bool

    @property
    def coded(self) -> bool:
        return self.spec is not None


def outlines(layers: Mapping) -> dict[str, LinearOutline]:
    """``LinearOutline`` per linear of an export source's ``layers`` (``LazyLayers``: nothing read; a dict
    of loaded ``LinearResult``: from what is loaded)."""
    if isinstance(layers, LazyLayers):
        return layers.outlines()
    return {name: LinearOutline(r.spec if r.codes is not None else None,
                                tuple((r.codes if r.codes is not None else r.mask).shape), r.mask is not None)
            for name, r in layers.items()}


class LazyLayers(Mapping):
    """An artifact's compressed linears (name -> ``LinearResult``: codes, scales, zeros, column order,
    mask) read from its quantization file one at a time, when asked for, and not kept: an exporter
    that handles one linear at a time holds one linear's codes, not the model's."""

    def __init__(self, artifact: Artifact):
        self.artifact = artifact
        self.entries: dict = dict(artifact.manifest.get("layers") or {})

    def __getitem__(self, name: str):
        if name not in self.entries:
            raise KeyError(name)
        one = Artifact(self.artifact.path, {**self.artifact.manifest, "layers": {name: self.entries[name]}})
        return one.layers()[name]

    def outlines(self) -> dict[str, LinearOutline]:
        """``LinearOutline`` of every linear, from the manifest and the quantization file's header alone."""
        from ..compress.quant import QuantSpec
        from ..models.artifact_format import safetensors_header

        keys = set(safetensors_header(self.artifact.path / QUANT_FILE) or {})
        return {name: LinearOutline(QuantSpec(e["bits"], e["group_size"], e["symmetric"]) if "bits" in e else None,
                                    tuple(e["shape"]), f"{name}.mask" in keys)
                for name, e in self.entries.items()}

    def outline(self, name: str):
        """(grid, mask) of one linear without reading its codes: its ``QuantSpec`` (None: pruned only) and
        its mask (None: not pruned)."""
        from safetensors import safe_open

        from ..compress.quant import QuantSpec
        from ..models.codes import unpack_mask

        entry = self.entries[name]
        spec = QuantSpec(entry["bits"], entry["group_size"], entry["symmetric"]) if "bits" in entry else None
        with safe_open(str(self.artifact.path / QUANT_FILE), framework="pt") as f:
            key = f"{name}.mask"
            mask = unpack_mask(f.get_tensor(key), entry["shape"][1]) if key in set(f.keys()) else None
        return spec, mask

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name) -> bool:
        return name in self.entries


def open_export_source(source, lazy_layers: bool = False) -> ExportSource:
    """The export's source at ``source``; an artifact's compressed linears loaded up front, or with
    ``lazy_layers`` read one at a time when asked for (``LazyLayers``)."""
    from transformers import AutoConfig

    path = Path(source)
    artifact = None
    layers = {}
    if (path / MANIFEST).is_file():
        artifact = Artifact.open(path)  # checks every checksum
        if (path / QUANT_FILE).is_file():
            layers = LazyLayers(artifact) if lazy_layers else artifact.layers()
    elif not (path / "config.json").is_file():
        raise ExportError(f"{path} is neither an slmedge artifact (no {MANIFEST}) nor a Hugging Face folder "
                          "(no config.json)")
    refuse_code(path)  # before transformers reads the folder
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
        raise ExportError(f"cannot read {path / 'config.json'}: {brief(exc)}") from exc
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


def weight_shapes(path: Path) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every weight tensor, in the order ``iter_weights`` yields them, from the files'
    headers alone (no tensor is read): what a writer needs to lay out a file before the data comes."""
    from safetensors import safe_open

    from ..models.artifact_format import WEIGHTS_FILE, quant_metadata, safetensors_header, weights_metadata

    if is_artifact(path) and is_compact(path):
        from ..models.artifact_weights import weight_names

        header = safetensors_header(path / WEIGHTS_FILE) or {}
        rebuilt = (weights_metadata(path) or {}).get("rebuilt", {})
        layers = (quant_metadata(path) or {}).get("layers", {})
        return [(n, tuple(layers[rebuilt[n]]["shape"]) if n in rebuilt else tuple(header[n]["shape"]))
                for n in weight_names(path)]
    out = []
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as handle:
            out.extend((key, tuple(handle.get_slice(key).get_shape())) for key in handle.keys())
    return out

"""The artifact directory: the contract between compress, export and evaluate.

- ``config.json``, tokenizer files, ``model.safetensors``: the compressed model as plain fp32
  weights (dequantized codes, pruned zeros); ``AutoModelForCausalLM.from_pretrained(dir)`` loads
  it with nothing else.
- ``quantization.safetensors``: per quantized linear the packed integer codes, fp16 scales,
  zero points and (act-order) column order; per pruned linear the bit-packed keep-mask; the
  searches' plain results (AWQ scales). Its metadata says bits, group size and symmetry.
- ``slmedge.json``: recipe, base model identity, calibration identity, versions, timings, sizes
  and the sha256 of every other file. Written last; a directory without it is incomplete.

The file names and the manifest readers (``MANIFEST``, ``is_artifact``, ``manifest_path``,
``read_manifest``, ``open_manifest``) are defined once, in ``slmedge.models.artifact_format``: a
model source may be an artifact, and loading a model must not import compression (nor torch).
They are re-exported here for compress and its callers.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .. import __version__
from ..fsutil import atomic_directory, sealed, sha256_file, write_json_atomic
from ..models.artifact_format import (FORMAT, FORMAT_VERSION, MANIFEST, QUANT_FILE, is_artifact, manifest_path,
                                      open_manifest, read_manifest, verify_files)
from .methods.base import LinearResult
from .quant import QuantSpec, codes_per_byte, pack_codes, pack_mask, unpack_codes, unpack_mask

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "QUANT_FILE", "Artifact", "is_artifact", "library_versions",
           "manifest_path", "open_manifest", "quant_tensors", "read_manifest", "verify_files", "write_artifact"]


def library_versions() -> dict:
    import importlib.metadata as md

    out = {"slmedge": __version__, "python": platform.python_version()}
    for pkg in ("torch", "transformers", "safetensors", "gguf", "llama_cpp_python", "onnx", "onnxruntime"):
        try:
            out[pkg] = md.version(pkg.replace("_", "-"))
        except md.PackageNotFoundError:
            pass
    return out


def quant_tensors(layers: dict[str, LinearResult], extras: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """The tensors and per-layer metadata of ``quantization.safetensors``."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, dict] = {}
    for name, res in layers.items():
        rows, cols = res.weight.shape
        entry = {"shape": [rows, cols]}
        if res.codes is not None:
            spec = res.spec
            entry.update(bits=spec.bits, group_size=spec.group_size, symmetric=spec.symmetric,
                         codes_per_byte=codes_per_byte(spec.bits), act_order=res.perm is not None)
            tensors[f"{name}.qweight"] = pack_codes(res.codes, spec.bits)
            tensors[f"{name}.scales"] = res.scales.to(torch.float16).contiguous()
            tensors[f"{name}.zeros"] = res.zeros.to(torch.uint8).contiguous()
            if res.perm is not None:
                tensors[f"{name}.perm"] = res.perm.to(torch.int32).contiguous()
        if res.mask is not None:
            tensors[f"{name}.mask"] = pack_mask(res.mask)
            entry["sparsity"] = round(1 - float(res.mask.float().mean()), 6)
        meta[name] = entry
    for key, value in extras.items():
        tensors[key] = value.contiguous()
    return tensors, meta


def write_artifact(dest, model, tokenizer, layers, extras, manifest: dict, overwrite: bool = False) -> Path:
    """Write the whole directory under a temporary name, manifest last, then rename it into place."""
    started = time.perf_counter()
    with atomic_directory(dest, overwrite=overwrite, manifest=MANIFEST) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        tensors, meta = quant_tensors(layers, extras)
        # One metadata key: safetensors writes several in no fixed order, which would make
        # artifacts of the same seed differ byte-wise.
        info = {"format": "slmedge-quant", "version": FORMAT_VERSION, "layers": meta}
        save_file(tensors, str(tmp / QUANT_FILE), metadata={"slmedge": json.dumps(info, sort_keys=True)})
        files = sorted(p for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST)
        manifest = dict(manifest)
        manifest.update(
            format=FORMAT,
            format_version=FORMAT_VERSION,
            layers=meta,
            versions=library_versions(),
            files={p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files},
        )
        manifest.setdefault("timings", {})["write_s"] = round(time.perf_counter() - started, 3)
        write_json_atomic(tmp / MANIFEST, sealed(manifest))
    return Path(dest)


@dataclass
class Artifact:
    path: Path
    manifest: dict

    @classmethod
    def open(cls, path, verify: bool = True) -> "Artifact":
        """Open a complete artifact; with ``verify`` every file is checked against its sha256."""
        path = Path(path)
        return cls(path, open_manifest(path, verify=verify))

    def verify(self) -> None:
        """Check every file listed in the manifest against its sha256."""
        verify_files(self.path, self.manifest)

    def load_model(self, dtype=torch.float32):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype, use_safetensors=True)

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        from ..models.source import tokenizer_kwargs

        return AutoTokenizer.from_pretrained(self.path, **tokenizer_kwargs(self.path))

    def layers(self) -> dict[str, LinearResult]:
        """Codes, scales, zeros, column order and masks of every compressed linear (no weights)."""
        meta = self.manifest["layers"]
        out = {}
        with safe_open(str(self.path / QUANT_FILE), framework="pt") as f:
            keys = set(f.keys())
            for name, entry in meta.items():
                rows, cols = entry["shape"]
                res = LinearResult(weight=None)
                if "bits" in entry:
                    spec = QuantSpec(entry["bits"], entry["group_size"], entry["symmetric"])
                    res.spec = spec
                    res.codes = unpack_codes(f.get_tensor(f"{name}.qweight"), spec.bits, cols)
                    res.scales = f.get_tensor(f"{name}.scales")
                    res.zeros = f.get_tensor(f"{name}.zeros")
                    if f"{name}.perm" in keys:
                        res.perm = f.get_tensor(f"{name}.perm").long()
                if f"{name}.mask" in keys:
                    res.mask = unpack_mask(f.get_tensor(f"{name}.mask"), cols)
                out[name] = res
        return out

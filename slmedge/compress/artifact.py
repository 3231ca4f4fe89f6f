"""The artifact directory: the contract between compress, export and evaluate.

- ``config.json``, ``generation_config.json``, tokenizer files.
- ``quantization.safetensors``: per quantized linear the packed integer codes, fp16 scales,
  zero points and (act-order) column order; per pruned linear the bit-packed keep-mask; the
  searches' plain results (AWQ scales). Its metadata says bits, group size and symmetry. A linear on
  one of llama.cpp's grids (format version 3) has its codes and the grid's fields instead
  (``<linear>.grid_d`` fp16 scales, ``grid_m``/``grid_dmin`` fp16 mins, ``grid_sc``/``grid_mc``
  integer sub-block codes; ``models.grids``), and its metadata names the grid.
- ``weights.safetensors`` (format version 2, the default): every tensor not rebuilt from the
  codes, in the source model's dtype when that holds it exactly (else fp32: AWQ's scaled norms,
  SparseGPT's updated kept values of a bf16 model), and each pruned-only linear's kept values.
  Loading rebuilds the fp32 weights bit for bit (``models.artifact_weights``). Version 1 had
  ``model.safetensors`` instead: the whole model as dense fp32 (still read; ``write_artifact(...,
  version=1)`` still writes it, for tests comparing the two).
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
from ..models.artifact_format import (FORMAT, FORMAT_VERSION, GRID_VERSION, MANIFEST, QUANT_FILE, WEIGHTS_FILE,
                                      format_version, is_artifact, manifest_path, open_manifest, open_manifest_bytes,
                                      read_manifest, verify_files)
from ..models.architectures import exact_attention
from ..models.artifact_weights import GRID_FIELD_PREFIX, KEPT_SUFFIX, rebuild_linear
from ..models.grids import get_grid
from .methods.base import LinearResult
from .quant import QuantSpec, codes_per_byte, pack_codes, pack_mask, unpack_codes, unpack_mask

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "QUANT_FILE", "WEIGHTS_FILE", "Artifact", "CompactWeights", "is_artifact", "library_versions",
           "manifest_path", "open_manifest", "quant_tensors", "read_manifest", "verify_files", "write_artifact"]


def library_versions() -> dict:
    import importlib.metadata as md

    out = {"slmedge": __version__, "python": platform.python_version()}
    for pkg in ("torch", "transformers", "safetensors", "gguf", "llama_cpp_python", "onnx", "onnxruntime",
                "onnxruntime_genai", "compressed_tensors"):
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
        if res.codes is not None and res.fields is not None:  # a llama.cpp grid (format version 3)
            grid = res.spec
            entry.update(grid=grid.name, bits=grid.bits, codes_per_byte=codes_per_byte(grid.bits),
                         act_order=res.perm is not None)
            tensors[f"{name}.qweight"] = pack_codes(res.codes, grid.bits)
            for field in grid.fields:
                value = res.fields[field]
                dtype = torch.float16 if field in ("d", "m", "dmin") else torch.uint8
                tensors[f"{name}.{GRID_FIELD_PREFIX}{field}"] = value.to(dtype).contiguous()
            if res.perm is not None:
                tensors[f"{name}.perm"] = res.perm.to(torch.int32).contiguous()
        elif res.codes is not None:
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


def source_dtypes(folder) -> dict[str, torch.dtype]:
    """Tensor name -> its dtype in the source folder's safetensors weights (read from the headers;
    empty when there is no folder). What the compact artifact stores untouched tensors in."""
    from ..models.artifact_format import safetensors_header

    names = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
    out: dict[str, torch.dtype] = {}
    if folder is None or not Path(folder).is_dir():
        return out
    for f in sorted(Path(folder).glob("*.safetensors")):
        if f.name == QUANT_FILE:
            continue
        for name, info in (safetensors_header(f) or {}).items():
            if name != "__metadata__" and isinstance(info, dict) and info.get("dtype") in names:
                out[name] = names[info["dtype"]]
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _narrowest(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` (fp32) in ``dtype`` when that holds every value exactly, else as it is."""
    if dtype is None or dtype == t.dtype or t.dtype != torch.float32 or dtype not in _FLOATS:
        return t
    narrow = t.to(dtype)
    # Compared a slice at a time: a whole fp32 copy of an embedding would cost what the model does.
    flat_t, flat_n = t.reshape(-1), narrow.reshape(-1)
    step = 1 << 22
    for i in range(0, flat_t.numel(), step):
        if not _same_bits(flat_n[i:i + step].float(), flat_t[i:i + step]):
            return t
    return narrow


class _Tensors:
    """safe_open's ``get_tensor`` over an in-memory dict (to rebuild a weight before writing it)."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def get_tensor(self, name):
        return self.tensors[name]


def compact_tensors(state: dict, layers: dict[str, LinearResult], quant: dict, meta: dict,
                    dtypes: dict[str, torch.dtype]) -> tuple[dict, dict]:
    """The tensors of a version-2 ``weights.safetensors`` for ``state`` (the whole state dict, or one
    part of it: a block, or what is outside the blocks), and which of them are rebuilt.

    Every tensor a version-1 ``model.safetensors`` would hold (tied duplicates once: ties are found
    within ``state``, by storage; a part's storage may be reused once it is freed, so addresses are
    never compared across parts). A compressed linear's weight is rebuilt from
    ``quant`` (codes, masks) and the kept values, and compared bit for bit with the model's: only
    when equal is it left out (listed in ``rebuilt``); otherwise the fp32 tensor itself is stored.
    Kept values and untouched tensors are stored in the source dtype when it holds them exactly,
    else fp32 (lossless).
    """
    seen: set = set()
    # Tied tensors share storage: the embedding of a model whose compressed lm_head is tied to it is
    # that linear's weight.
    ptr_of = {state[f"{name}.weight"].data_ptr(): name for name in layers if f"{name}.weight" in state}
    names = []
    for key, t in state.items():
        ptr = (t.data_ptr(), tuple(t.shape))
        if ptr in seen:  # a tied duplicate (lm_head of tied embeddings): save_pretrained drops it too
            continue
        seen.add(ptr)
        names.append(key)
    names.sort()  # the order of a safetensors file's keys, as version 1 listed them
    tensors: dict[str, torch.Tensor] = {}
    rebuilt: dict[str, str] = {}
    qview = _Tensors(quant)
    for key in names:
        t = state[key].detach().cpu()
        layer = ptr_of.get(state[key].data_ptr())
        if layer is not None and t.dtype == torch.float32 and layer in meta:
            kept = {}
            if "bits" not in meta[layer]:
                mask = layers[layer].mask
                kept[key + KEPT_SUFFIX] = _narrowest(t[mask].contiguous(), dtypes.get(key))
            again = rebuild_linear(layer, meta[layer], qview, _Tensors(kept), key)
            if _same_bits(again, t):
                tensors.update(kept)
                rebuilt[key] = layer
                continue
        tensors[key] = _narrowest(t.contiguous(), dtypes.get(key))
    return tensors, rebuilt


class CompactWeights:
    """A version-2 artifact's tensors, gathered part by part as the engine finishes each block
    (``add`` is a ``compress.engine.Sink``): only the codes, the kept values and the untouched
    tensors in their narrowest exact dtype are held, never a dense weight. ``write_artifact``
    writes them."""

    def __init__(self, dtypes: dict[str, torch.dtype]):
        self.dtypes = dtypes
        self.weights: dict[str, torch.Tensor] = {}
        self.rebuilt: dict[str, str] = {}
        self.quant: dict[str, torch.Tensor] = {}
        self.meta: dict[str, dict] = {}

    def add(self, state: dict, layers: dict[str, LinearResult], extras: dict) -> None:
        quant, meta = quant_tensors(layers, extras)
        weights, rebuilt = compact_tensors(state, layers, quant, meta, self.dtypes)
        self.quant.update(quant)
        self.meta.update(meta)
        self.weights.update(weights)
        self.rebuilt.update(rebuilt)

    @classmethod
    def of_model(cls, model, layers: dict[str, LinearResult], extras: dict, dtypes: dict) -> "CompactWeights":
        """The same, for a model compressed whole in memory."""
        out = cls(dtypes)
        out.add(model.state_dict(), layers, extras)
        return out


def write_artifact(dest, model, tokenizer, layers, extras, manifest: dict, overwrite: bool = False, *,
                   source_dir=None, version: int | None = None, compact: CompactWeights | None = None) -> Path:
    """Write the whole directory under a temporary name, manifest last, then rename it into place.

    ``compact``: the tensors, gathered block by block while compressing (``CompactWeights``); the
    model then only gives its config (its blocks may be gone), and ``layers``/``extras`` are not read.
    Without it they come from the whole ``model`` and ``layers``. ``source_dir``: the source model's
    folder, whose safetensors dtypes the untouched tensors keep (fp32 without one). ``version=1``
    writes the previous layout (dense fp32 ``model.safetensors``; a whole model needed). The default is
    the lowest version that holds what there is: 2, or 3 where a linear is on a llama.cpp grid.
    """
    started = time.perf_counter()
    on_grids = any(r.fields is not None for r in (layers or {}).values() if r is not None)
    if compact is not None:
        on_grids = any("grid" in e for e in compact.meta.values())
    version = (GRID_VERSION if on_grids else 2) if version is None else version
    if version not in (1, 2, 3):
        raise ValueError(f"artifact format version {version} cannot be written")
    if on_grids and version < GRID_VERSION:
        raise ValueError(f"linears on llama.cpp's grids need artifact format version {GRID_VERSION}")
    if version == 1 and compact is not None:
        raise ValueError("a version-1 artifact is written from the whole model, not from compact tensors")
    needed = _planned_bytes(version, model, compact, source_dir)  # what a full disk's message says it needed
    with atomic_directory(dest, overwrite=overwrite, manifest=MANIFEST, needed=needed) as tmp:
        if version == 1:
            tensors, meta = quant_tensors(layers, extras)
            model.save_pretrained(tmp, safe_serialization=True)
        else:
            if compact is None:
                compact = CompactWeights.of_model(model, layers, extras, source_dtypes(source_dir))
            tensors, meta = compact.quant, compact.meta
            model.config.save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None and model.can_generate():
                model.generation_config.save_pretrained(tmp)
            winfo = {"format": "slmedge-weights", "version": 2, "rebuilt": compact.rebuilt}
            save_file(compact.weights, str(tmp / WEIGHTS_FILE), metadata={"slmedge": json.dumps(winfo, sort_keys=True)})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        # One metadata key: safetensors writes several in no fixed order, which would make
        # artifacts of the same seed differ byte-wise.
        info = {"format": "slmedge-quant", "version": version, "layers": meta}
        save_file(tensors, str(tmp / QUANT_FILE), metadata={"slmedge": json.dumps(info, sort_keys=True)})
        files = sorted(p for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST)
        manifest = dict(manifest)
        manifest.update(
            format=FORMAT,
            format_version=version,
            layers=meta,
            versions=library_versions(),
            files={p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files},
        )
        manifest.setdefault("timings", {})["write_s"] = round(time.perf_counter() - started, 3)
        write_json_atomic(tmp / MANIFEST, sealed(manifest))
    return Path(dest)


def _planned_bytes(version: int, model, compact, source_dir) -> int:
    """About the bytes an artifact's files take: its tensors (the dense fp32 weights where they are
    written from the whole model) and the tokenizer and config files of its source."""
    if version == 1 or compact is None:
        tensors = sum(p.numel() * 4 for p in model.parameters())
    else:
        tensors = sum(t.numel() * t.element_size() for d in (compact.weights, compact.quant) for t in d.values())
    extra = 0
    if source_dir is not None and Path(source_dir).is_dir():
        extra = sum(p.stat().st_size for p in Path(source_dir).iterdir() if p.is_file() and p.suffix != ".safetensors")
    return tensors + extra


@dataclass
class Artifact:
    path: Path
    manifest: dict
    # The sha256 of the manifest file's bytes as they were read and checked (``open``): what an export
    # records as its source (``source_manifest_sha256``). None: not opened from disk.
    manifest_sha256: str | None = None

    @classmethod
    def open(cls, path, verify: bool = True) -> "Artifact":
        """Open a complete artifact; with ``verify`` the manifest is checked against its seal (required
        from format version 2) and every file against its sha256."""
        path = Path(path)
        manifest, digest = open_manifest_bytes(path, verify=verify)
        return cls(path, manifest, digest)

    def verify(self) -> None:
        """Check every file listed in the manifest against its sha256."""
        verify_files(self.path, self.manifest)

    @property
    def version(self) -> int:
        return format_version(self.manifest)

    def load_model(self, dtype=torch.float32):
        """The compressed model (version 2: rebuilt from the codes, the same bits as version 1's file)."""
        if self.version >= 2:
            from ..models.artifact_weights import load_model

            return load_model(self.path, dtype)
        from transformers import AutoModelForCausalLM

        return exact_attention(AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype, use_safetensors=True))

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
                if "grid" in entry:
                    grid = get_grid(entry["grid"])
                    res.spec = grid
                    res.codes = unpack_codes(f.get_tensor(f"{name}.qweight"), grid.bits, cols)
                    res.fields = {fld: f.get_tensor(f"{name}.{GRID_FIELD_PREFIX}{fld}") for fld in grid.fields}
                    if f"{name}.perm" in keys:
                        res.perm = f.get_tensor(f"{name}.perm").long()
                elif "bits" in entry:
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

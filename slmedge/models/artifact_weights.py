"""A compact (version 2) artifact's weights, rebuilt from what it stores.

A version-2 artifact keeps no dense copy of the model. ``weights.safetensors`` holds every
tensor that is not rebuilt (embeddings, norms, biases, skipped linears; in the source model's
dtype when that holds the value exactly, else fp32) and, per pruned-only linear, its kept values
in row-major order (``<tensor>.kept``); ``quantization.safetensors`` holds the codes, scales,
zero points and masks as in version 1. The weights file's metadata (``weights_metadata``) says
which tensors are rebuilt from which linear (``rebuilt``); those and the stored ones are the
tensor names a version-1 ``model.safetensors`` had, in its (sorted) order:

- a quantized linear: ``scale * (code - zero)`` per group, the arithmetic the methods used when
  they chose the codes (``models.codes``, which ``compress.quant`` re-exports), so the rebuilt fp32 weight has
  the very bits of the version-1 one (pruned weights are codes equal to the zero point);
- a pruned-only linear: zeros, with the kept values placed where the mask is set.

The writer (``compress.artifact``) rebuilds each tensor once before writing and stores the fp32
tensor itself whenever the rebuild would not give its exact bits, so reading never approximates.
Reading loads one tensor at a time from memory-mapped files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from ..errors import ArtifactError
from .artifact_format import QUANT_FILE, WEIGHTS_FILE, quant_metadata, safetensors_header, weights_metadata
from .architectures import exact_attention

KEPT_SUFFIX = ".kept"  # <tensor name>.kept: a pruned-only linear's kept values, row-major


def weight_names(path) -> list[str]:
    """The tensor names of the artifact's weights: those stored and those rebuilt, sorted (a
    version-1 ``model.safetensors``'s names, in its order)."""
    return _names(path, _meta(path))


def _meta(path) -> dict:
    meta = weights_metadata(path)
    if not isinstance(meta, dict) or not isinstance(meta.get("rebuilt"), dict):
        raise ArtifactError(f"{Path(path) / WEIGHTS_FILE} has no readable slmedge metadata: the artifact is corrupt")
    return meta


def _names(path, meta: dict) -> list[str]:
    header = safetensors_header(Path(path) / WEIGHTS_FILE) or {}
    stored = {k for k in header if k != "__metadata__" and not k.endswith(KEPT_SUFFIX)}
    return sorted(stored | set(meta["rebuilt"]))


def iter_tensors(path, names=None) -> Iterator[tuple[str, "object"]]:
    """(name, fp32 torch tensor) of every weight of the compact artifact at ``path`` (or only those
    in ``names``), in the order of ``weight_names``; each rebuilt as the version-1 file held it."""
    from safetensors import safe_open

    path = Path(path)
    meta = _meta(path)
    rebuilt = meta.get("rebuilt", {})
    layers = (quant_metadata(path) or {}).get("layers", {})
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as wf, \
            safe_open(str(path / QUANT_FILE), framework="pt") as qf:
        for name in _names(path, meta):
            if names is not None and name not in names:
                continue
            layer = rebuilt.get(name)
            if layer is None:
                t = wf.get_tensor(name)
                yield name, (t.float() if t.is_floating_point() else t)
            else:
                yield name, rebuild_linear(layer, layers[layer], qf, wf, name)


def rebuild_linear(layer: str, entry: dict, qf, wf, tensor_name: str):
    """The fp32 weight of one compressed linear from its codes (quantized) or mask and kept values."""
    import torch

    from .codes import dequantize_grouped, group_width, unpack_codes, unpack_mask

    rows, cols = entry["shape"]
    if "bits" in entry:
        codes = unpack_codes(qf.get_tensor(f"{layer}.qweight"), entry["bits"], cols)
        return dequantize_grouped(codes, qf.get_tensor(f"{layer}.scales"), qf.get_tensor(f"{layer}.zeros"),
                                  group_width(entry["group_size"], cols))
    mask = unpack_mask(qf.get_tensor(f"{layer}.mask"), cols)
    w = torch.zeros(rows, cols, dtype=torch.float32)
    w[mask] = wf.get_tensor(tensor_name + KEPT_SUFFIX).float()
    return w


def state_dict(path) -> dict:
    """Every weight of the compact artifact at ``path``, fp32, by name."""
    return dict(iter_tensors(path))


def load_model(path, dtype=None):
    """The compact artifact's model, as ``from_pretrained`` of a version-1 artifact gives it: the same
    config, generation config and (fp32, then cast to ``dtype``) weights; tied weights tied again."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path))
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    model = cls.from_pretrained(None, config=config, state_dict=state_dict(path),
                                dtype=dtype if dtype is not None else torch.float32, low_cpu_mem_usage=True)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    model.config._name_or_path = str(path)  # as from_pretrained(path) says
    model.eval()
    return exact_attention(model)


def materialize(path, dest) -> Path:
    """Write the artifact at ``path`` (checked first) as a plain Hugging Face folder ``dest``: config,
    tokenizer and an fp32 ``model.safetensors``, the very file a version-1 artifact held, so that
    ``AutoModelForCausalLM.from_pretrained(dest)`` alone loads it. ``dest`` must be new or empty;
    it appears only when complete."""
    import shutil

    from safetensors.torch import save_file

    from ..fsutil import atomic_directory, check_output_dir
    from .artifact_format import MANIFEST, V1_WEIGHTS_FILE, is_compact, open_manifest

    path, dest = Path(path), Path(dest)
    manifest = open_manifest(path)  # every checksum
    check_output_dir(dest, False, inputs=[path])
    with atomic_directory(dest) as tmp:
        for f in sorted(path.iterdir()):
            if f.is_file() and f.name not in (MANIFEST, QUANT_FILE, WEIGHTS_FILE):
                shutil.copyfile(f, tmp / f.name)
        if is_compact(path, manifest):
            tensors = {name: t.contiguous() for name, t in iter_tensors(path)}
            save_file(tensors, str(tmp / V1_WEIGHTS_FILE), metadata={"format": "pt"})
            del tensors
    return dest

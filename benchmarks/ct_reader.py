"""Read compressed-tensors checkpoints as a tool pinned to this environment's releases reads them.

Runs inside a reader virtualenv made by benchmarks/ct_readers.sh (compressed-tensors 0.17.0 with
transformers 5.20, as vLLM 0.33 pins them; 0.19.0 with transformers 5.17, as llm-compressor 0.14
does), never beside slmedge: it imports only torch, transformers, compressed-tensors and safetensors.

    VENV/bin/python benchmarks/ct_reader.py JOBS.json OUT_DIR

JOBS.json: {"ids": [token ids], "checkpoints": {"name": "folder", ...}}. For each checkpoint, three
readings, each recorded as {"status": "ok"} or {"status": "error", "error": "Type: message"}:

- ``transformers``: ``AutoModelForCausalLM.from_pretrained`` with the compressed-tensors quantizer,
  decompressed at load (``dequantize=True``; a checkpoint without a quantization_config loads plain).
  Writes OUT_DIR/NAME.transformers.safetensors (every linear's weight as the model holds it, fp32)
  and OUT_DIR/NAME.logits.npy (fp32 logits of the ids).
- ``transformers_compressed``: the same without the argument (the default a user gets: kept
  compressed, decompressed by compressed-tensors' hook at the first forward pass). Writes
  OUT_DIR/NAME.compressed_logits.npy.
- ``compressed_tensors``: compressed-tensors' own reading of the files, without transformers' model:
  its ``CompressedTensorsDequantizer`` decompresses every targeted linear (in the dtype of the stored
  scales, then cast to fp32). Writes OUT_DIR/NAME.ct.safetensors. Skipped (status "none") for a
  checkpoint without a quantization_config.
- ``compressed_tensors_validate``: the same dequantizer's check of the file's tensor names against
  the config (``validate``), which ``convert_checkpoint`` runs before converting.

OUT_DIR/results.json holds {"versions": {...}, "checkpoints": {name: {reading: status}}}. The exit
status is 0 whenever the results were written (a reading that fails is a result, not a crash).
"""

from __future__ import annotations

import json
import sys
import traceback
from importlib.metadata import version
from pathlib import Path


def _error(exc: BaseException) -> dict:
    lines = str(exc).strip().splitlines() or [""]
    return {"status": "error", "error": f"{type(exc).__name__}: {lines[0][:400]}",
            "where": traceback.format_exception(exc)[-2].strip()[:400]}


def _quantized(folder: Path) -> bool:
    return bool(json.loads((folder / "config.json").read_text(encoding="utf-8")).get("quantization_config"))


def read_transformers(folder: Path, ids, out: Path, name: str) -> dict:
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    extra = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if _quantized(folder) else {}
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **extra).eval()
    weights = {f"{n}.weight": m.weight.detach().float().clone().contiguous()
               for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    save_file(weights, str(out / f"{name}.transformers.safetensors"))
    with torch.no_grad():
        np.save(out / f"{name}.logits.npy", model(torch.tensor([ids])).logits[0].float().numpy())
    return {"status": "ok", "linears": len(weights)}


def read_transformers_compressed(folder: Path, ids, out: Path, name: str) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        np.save(out / f"{name}.compressed_logits.npy", model(torch.tensor([ids])).logits[0].float().numpy())
    return {"status": "ok"}


def read_compressed_tensors(folder: Path, out: Path, name: str) -> dict:
    import torch
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file, save_file

    if not _quantized(folder):
        return {"status": "none", "why": "no quantization_config: a plain checkpoint"}
    dequantizer = CompressedTensorsDequantizer(str(folder), dtype=torch.float32)
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    packed = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_packed")}
    weights = dequantizer.process(dict(tensors))
    decoded = {f"{m}.weight": weights[f"{m}.weight"].float().contiguous() for m in sorted(packed)}
    save_file(decoded, str(out / f"{name}.ct.safetensors"))
    return {"status": "ok", "linears": len(decoded)}


def validate_compressed_tensors(folder: Path) -> dict:
    """The dequantizer's own check of the tensor names against the config, before it converts a file."""
    import torch
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file

    if not _quantized(folder):
        return {"status": "none", "why": "no quantization_config: a plain checkpoint"}
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    CompressedTensorsDequantizer(str(folder), dtype=torch.float32).validate(tensors)
    return {"status": "ok"}


def main(argv: list[str]) -> int:
    jobs_file, out_dir = Path(argv[0]), Path(argv[1])
    jobs = json.loads(jobs_file.read_text(encoding="utf-8"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, folder in jobs["checkpoints"].items():
        folder = Path(folder)
        r = results[name] = {}
        for reading, fn in (("transformers", lambda: read_transformers(folder, jobs["ids"], out_dir, name)),
                            ("transformers_compressed",
                             lambda: read_transformers_compressed(folder, jobs["ids"], out_dir, name)),
                            ("compressed_tensors", lambda: read_compressed_tensors(folder, out_dir, name)),
                            ("compressed_tensors_validate", lambda: validate_compressed_tensors(folder))):
            try:
                r[reading] = fn()
            except Exception as exc:  # noqa: BLE001 - what the reader says is the result
                r[reading] = _error(exc)
    versions = {p: version(p) for p in ("compressed-tensors", "transformers", "torch")}
    (out_dir / "results.json").write_text(json.dumps({"versions": versions, "checkpoints": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

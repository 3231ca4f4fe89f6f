"""What is inside a GGUF file, an ONNX export or an slmedge artifact (`slmedge inspect`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import SlmedgeError


class InspectError(SlmedgeError):
    """The file is not a GGUF, ONNX or artifact slmedge can read."""


def inspect_path(path) -> dict:
    p = Path(path)
    if not p.exists():
        raise InspectError(f"{p} does not exist")
    if p.is_file() and p.suffix.lower() == ".gguf":
        return inspect_gguf(p)
    if p.is_file() and p.suffix.lower() == ".onnx":
        return inspect_onnx(p)
    if p.is_dir():
        if (p / "model.onnx").is_file() or list(p.glob("*.onnx")):
            return inspect_onnx(p)
        if (p / "slmedge.json").is_file():
            return inspect_artifact(p)
    with open(p, "rb") as f:
        magic = f.read(4) if p.is_file() else b""
    if magic == b"GGUF":
        return inspect_gguf(p)
    raise InspectError(f"{p} is not a .gguf file, an .onnx file/export directory or an slmedge artifact")


def _by_type(rows) -> dict:
    """rows of (type, params, bytes) -> {type: {tensors, params, bytes, bits_per_weight}}."""
    out: dict[str, dict] = {}
    for kind, params, nbytes in rows:
        e = out.setdefault(kind, {"tensors": 0, "params": 0, "bytes": 0})
        e["tensors"] += 1
        e["params"] += int(params)
        e["bytes"] += int(nbytes)
    for e in out.values():
        e["bits_per_weight"] = round(8 * e["bytes"] / e["params"], 3) if e["params"] else None
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))


def inspect_gguf(path: Path) -> dict:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError/struct errors on corrupt files
        raise InspectError(f"{path} is not a readable GGUF file: {str(exc).splitlines()[0][:200]}") from exc
    fields = {}
    for name, f in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name.rsplit(".", 1)[1] in ("tokens", "scores", "token_type", "merges"):
            continue
        try:
            fields[name] = f.contents()
        except Exception:  # noqa: BLE001
            continue
    arch = fields.get("general.architecture")
    manifest = None
    if "slmedge.manifest" in fields:
        try:
            manifest = json.loads(fields.pop("slmedge.manifest"))
        except ValueError:
            manifest = {"error": "unreadable"}
    rows = [(t.tensor_type.name, int(np.prod(t.shape)), int(t.n_bytes)) for t in reader.tensors]
    params = sum(r[1] for r in rows)
    nbytes = sum(r[2] for r in rows)
    hparams = {k.split(".", 1)[1]: v for k, v in fields.items() if arch and k.startswith(arch + ".")}
    return {
        "path": str(path), "format": "gguf", "architecture": arch, "name": fields.get("general.name"),
        "file_bytes": path.stat().st_size, "tensors": len(rows), "params": params,
        "bits_per_weight": round(8 * nbytes / params, 3) if params else None,
        "by_type": _by_type(rows), "hparams": hparams,
        "tokenizer": {"model": fields.get("tokenizer.ggml.model"), "pre": fields.get("tokenizer.ggml.pre"),
                      "vocab": int(len(reader.fields["tokenizer.ggml.tokens"].data))
                      if "tokenizer.ggml.tokens" in reader.fields else None,
                      "chat_template": "tokenizer.chat_template" in fields},
        "manifest": manifest,
    }


def _onnx_weight_rows(model) -> list:
    from onnx import TensorProto, helper

    inits = {i.name: i for i in model.graph.initializer}
    used = set()
    rows = []
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            parts = [inits[n] for n in node.input[1:] if n in inits]
            nbytes = sum(_init_bytes(t) for t in parts)
            used.update(t.name for t in parts)
            rows.append((f"MatMulNBits int{attrs.get('bits', 4)} b{attrs.get('block_size')}", attrs["K"] * attrs["N"], nbytes))
    for name, t in inits.items():
        if name in used:
            continue
        n = int(np.prod(t.dims)) if t.dims else 1
        if n < 1024:  # scalars and shape constants
            continue
        rows.append((TensorProto.DataType.Name(t.data_type).lower(), n, _init_bytes(t)))
    return rows


def _init_bytes(t) -> int:
    from onnx import helper

    n = int(np.prod(t.dims)) if t.dims else 1
    try:
        size = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except Exception:  # noqa: BLE001
        size = 1
    return n * size


def inspect_onnx(path: Path) -> dict:
    import onnx

    from ..runtimes.ort import model_file

    f = model_file(path)
    try:
        model = onnx.load(str(f), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf decode errors
        raise InspectError(f"{f} is not a readable ONNX model: {str(exc).splitlines()[0][:200]}") from exc
    inputs = [i.name for i in model.graph.input]
    past = [n for n in inputs if n.startswith("past_key_values.")]
    ops: dict[str, int] = {}
    for node in model.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    rows = _onnx_weight_rows(model)
    params = sum(r[1] for r in rows)
    nbytes = sum(r[2] for r in rows)
    folder = f.parent
    files = [p for p in folder.iterdir() if p.is_file() and p.name.startswith(f.name)]
    manifest = None
    if (folder / "slmedge-export.json").is_file():
        manifest = json.loads((folder / "slmedge-export.json").read_text(encoding="utf-8"))
        manifest.pop("files", None)
    config = {}
    if (folder / "config.json").is_file():
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        config = {k: cfg.get(k) for k in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size") if k in cfg}
    return {
        "path": str(f), "format": "onnx", "architecture": config.get("model_type"),
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "file_bytes": sum(p.stat().st_size for p in files), "external_data": any(p != f for p in files),
        "inputs": inputs[:3] + ([f"... {len(past)} past_key_values inputs"] if past else []),
        "kv_cache": bool(past), "layers": len(past) // 2,
        "params": params, "bits_per_weight": round(8 * nbytes / params, 3) if params else None,
        "by_type": _by_type(rows), "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:12]),
        "config": config, "manifest": manifest,
    }


def inspect_artifact(path: Path) -> dict:
    from ..compress.artifact import Artifact

    art = Artifact.open(path, verify=False)
    m = art.manifest
    layers = m.get("layers", {})
    coded = [e for e in layers.values() if "bits" in e]
    return {
        "path": str(path), "format": "slmedge-artifact", "architecture": m.get("architecture"),
        "recipe": m.get("recipe"), "base_model": m.get("base_model"), "compressed_linears": len(coded),
        "pruned_linears": sum(1 for e in layers.values() if "sparsity" in e),
        "files": {n: f["bytes"] for n, f in m.get("files", {}).items()}, "summary": m.get("summary"),
    }

"""What a study job made, as facts the results store keeps: the compression level of what an
evaluation evaluated (bits per weight, and in words), an export's type and whether its codes were
kept. The worker that finishes a job computes them while its inputs are on disk; the report reads
them from the store, so an artifact ``--discard-artifacts`` deleted keeps its place in the plots.

Compression level, per kind of subject:

- an exported file: its bytes x 8 / the model's parameters (what a device loads);
- a compressed artifact: the codes and scales its manifest counts (quantized), or 16 x density
  (pruned: the fp16 values kept, sparse indices not counted);
- a base model: what it is stored as. The embedded bases are GGUF files (Q4_1, Q4_K_M) that the
  tool dequantizes: their level is the GGUF file's weights, in bits per weight, not 16; a
  Hugging Face folder's is its safetensors dtype.
"""

from __future__ import annotations

from pathlib import Path

# The families a method belongs to, for the report's colours: "quantize", "prune", "both", "base".
FAMILIES = ("base", "quantize", "prune", "both")


def family(labels: dict) -> str:
    """The family of a grid row, from its labels (method name, bits or a llama.cpp grid or budget, sparsity)."""
    name = labels.get("method_name")
    if name in (None, "none", "-"):
        return "base"
    bits, sparsity = labels.get("bits") or labels.get("grid") or labels.get("bpw"), labels.get("sparsity")
    if bits and sparsity:
        return "both"
    if sparsity:
        return "prune"
    if bits:
        return "quantize"
    try:
        from ..compress.methods import METHODS

        return "prune" if METHODS[name].kind == "prune" else "quantize"
    except (KeyError, ImportError):
        return "quantize"


def gguf_level(path: Path) -> dict:
    """A GGUF file's weights: bits per weight over its 2-D tensors, and its file type (Q4_K_M).
    Remembered per file (path, size, mtime): reading a 262k-entry vocabulary takes seconds."""
    import json

    from ..fsutil import write_json_atomic
    from ..paths import cache_dir

    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    memo = cache_dir() / "levels.json"
    try:
        known = json.loads(memo.read_text(encoding="utf-8"))
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(key), dict):
        return known[key]
    from gguf import GGUFReader, LlamaFileType

    reader = GGUFReader(str(path))
    bits = elements = 0
    by_type: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.shape) < 2:
            continue  # norms and biases (f32 in every type)
        n = int(t.n_elements)
        bits += int(t.n_bytes) * 8
        elements += n
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + n
    if not elements:
        return {}
    name = max(by_type, key=by_type.get)
    field = reader.fields.get("general.file_type")
    try:
        name = LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")
    except (AttributeError, IndexError, TypeError, ValueError):
        pass
    out = {"bits_per_weight": bits / elements, "level": f"{name} GGUF, dequantized"}
    known = {k: v for k, v in known.items() if not k.startswith(f"{path}|")}
    known[key] = out
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(memo, known)
    except OSError:
        pass  # a cache: without it, the next run reads the file again
    return out


def source_level(model: str) -> dict:
    """The storage level of a base model source (see the module's docstring); {} when unknown."""
    from ..errors import SlmedgeError
    from ..models.source import embedded_gguf_path, resolve, stored_dtype

    try:
        src = resolve(model)
        if src.kind == "embedded":
            return gguf_level(embedded_gguf_path(src.spec))
        if src.kind == "gguf":
            return gguf_level(src.path)
        if src.kind in ("hf_dir", "hub") and src.path is not None:
            dtype = stored_dtype(src.path)
            bits = dtype.itemsize * 8
            return {"bits_per_weight": float(bits), "level": f"{str(dtype).removeprefix('torch.')} safetensors"}
    except (SlmedgeError, OSError, ValueError, KeyError, ImportError):
        return {}
    return {}


def artifact_level(summary: dict) -> dict:
    """A compressed artifact's level from its manifest's summary."""
    if summary.get("bits_per_weight"):
        bits = float(summary["bits_per_weight"])
        sparsity = float(summary.get("sparsity") or 0.0)
        level = f"{bits:.2f} bits/w codes + scales" + (f", {sparsity:.0%} sparse" if sparsity else "")
        return {"bits_per_weight": bits, "level": level, "sparsity": sparsity}
    sparsity = float(summary.get("sparsity") or 0.0)
    return {"bits_per_weight": 16.0 * (1.0 - sparsity), "level": f"{sparsity:.0%} sparse, 16 x density",
            "sparsity": sparsity}


def export_facts(fmt, report: dict, coded: bool) -> dict:
    """An export job's facts: type, bytes, and what became of the artifact's codes (``coded``: the
    source holds them): "kept" (every coded tensor placed as it is), "requantized" (the format's
    grid did not fit them: the runtime's quantizer chose new values), "quantized by the exporter"
    (a dense source written in a quantized type), "none" (a float type)."""
    requant = sum(int(v) for k, v in report.items() if k.startswith("requantized_by") and isinstance(v, (int, float)))
    kept = int(report.get("codes_kept") or 0)
    exact = bool(report.get("exact"))
    facts = {"format": fmt.name, "type": report.get(fmt.type_key) or report.get("type"),
             "bytes": report.get("bytes"), "codes_kept": kept, "requantized": requant, "exact": exact}
    if coded:
        facts["codes"] = "kept" if exact else "requantized"
    else:
        facts["codes"] = "quantized by the exporter" if requant else "none"
    return facts


def evaluated_level(subject: str, labels: dict, results: dict) -> dict:
    """The compression level of what an evaluation evaluated (computed in its worker)."""
    from ..models.artifact_format import is_artifact, read_manifest

    fmt = labels.get("format")
    base = labels.get("method_name") in (None, "none", "-")
    if fmt not in (None, "none"):
        mem = (results.get("metrics") or {}).get("memory") or {}
        bits = mem.get("bits_per_weight")
        if bits is None:
            bits = _file_bits(fmt, Path(subject))
        out = {"bits_per_weight": bits, "level": f"{_export_type(fmt, Path(subject), labels)} {fmt} file"} if bits else {}
        if base and labels.get("model"):  # what the base itself is stored as, beside its file's level
            out["source"] = source_level(str(labels["model"]))
        return out
    p = Path(subject)
    if labels.get("method_name") not in (None, "none", "-") and is_artifact(p):
        try:
            return artifact_level(read_manifest(p).get("summary") or {})
        except (OSError, ValueError, KeyError):
            return {}
    return source_level(subject)


def _export_type(fmt: str, path: Path, labels: dict) -> str:
    """The type an export was written in (``auto`` resolved), from its manifest."""
    from ..errors import SlmedgeError
    from ..export.formats import get_format

    spec = get_format(fmt)
    try:
        return str((spec.read_manifest(path) or {}).get(spec.type_key) or labels.get("type") or "")
    except (SlmedgeError, OSError, ValueError):
        return str(labels.get("type") or "")


def _file_bits(fmt: str, path: Path) -> float | None:
    from ..evaluate.system import path_bytes
    from ..export.formats import get_format

    spec = get_format(fmt)
    try:
        size = path_bytes(spec.model_file(path))
        params = (spec.model_facts(spec.model_file(path)) or {}).get("params") if spec.model_facts else None
    except (OSError, ValueError, KeyError):
        return None
    return 8 * size / params if size and params else None


# The device profiles every exported file is projected on (roofline from the file's real bytes):
# labelled projections wherever they are shown, never measurements.
DEVICE_PROFILES = ("raspberry-pi-5", "snapdragon-8-gen-3", "jetson-orin-nano")


def projections(fmt: str, path: Path, context_tokens: int) -> dict:
    """profile -> decode and prefill bounds (tokens/s) of an exported file on each device profile,
    from its bytes, parameters and KV cache; {} when the file's shape cannot be read."""
    from ..errors import SlmedgeError
    from ..evaluate.system import kv_cache_bytes, path_bytes
    from ..export.formats import get_format
    from ..runtimes.registry import file_runtime
    from ..targets.profiles import get_profile
    from ..targets.roofline import roofline

    spec = get_format(fmt)
    try:
        model_file = spec.model_file(Path(path))
        shape = spec.model_facts(model_file) if spec.model_facts else None
        runtime = file_runtime(model_file)
        size = path_bytes(model_file)
    except (SlmedgeError, OSError, ValueError, KeyError):
        return {}
    if not shape or runtime is None or not size:
        return {}
    kv_token = kv_cache_bytes(shape.get("config") or {}, 1, runtime.kv_bytes_per_value)
    integer = bool(shape.get("quantized")) and runtime.integer_kernels
    out = {}
    for name in DEVICE_PROFILES:
        try:
            profile = get_profile(name, detect=False)
        except SlmedgeError:
            continue
        # a static KV cache (an ExecuTorch program's) is read whole at every decode step
        bounds = roofline(profile, size, kv_token, shape.get("params"), shape.get("kv_positions") or context_tokens,
                          integer)
        out[name] = {k: bounds[k] for k in ("decode_bound_tps", "prefill_bound_tps") if bounds.get(k) is not None}
        out[name]["runtime"] = runtime.name
    return out

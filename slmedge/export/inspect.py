"""What is inside a GGUF file, an ONNX export or an slmedge artifact (`slmedge inspect`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..errors import ArtifactError, SlmedgeError, brief
from ..models.remote_code import refuse_code
from ..fsutil import check_seal, sha256_file
from ..models.artifact_format import MANIFEST, is_artifact
from ..models.gguf_seal import MANIFEST_KEY
from .formats import FORMATS, format_for_path

# Where each export keeps its manifest (what it was written from, per tensor its type and whether
# its codes were kept): a GGUF in this metadata key (MANIFEST_KEY), an ONNX export in this file of
# its folder.
EXPORT_MANIFEST = "slmedge-export.json"


class InspectError(SlmedgeError):
    """The file is not a GGUF, ONNX or artifact slmedge can read."""


def inspect_path(path) -> dict:
    """What ``path`` holds, by the first that fits: a file with a format's suffix, a folder one
    recognizes, an artifact, a file starting with a format's magic bytes. What slmedge wrote is
    checked against the digests it recorded first (ArtifactError when something changed)."""
    p = Path(path)
    if not p.exists():
        raise InspectError(f"{p} does not exist")
    if p.is_dir():
        refuse_code(p)  # a folder whose configuration names code is refused before anything reads it
    formats = [f for f in FORMATS.values() if f.inspect is not None]
    name = format_for_path(p)  # by suffix, by a look inside a folder, or by a file's first bytes
    found = FORMATS[name] if name is not None and FORMATS[name].inspect is not None else None
    if found is None and p.is_dir():
        if is_artifact(p):
            return inspect_artifact(p)
        raise InspectError(f"{p} is a folder but neither an export nor an slmedge artifact (it has no .onnx "
                           f"model and no {MANIFEST}); inspect takes {_what_inspect_takes(formats)}")
    if found is None:
        raise InspectError(f"{p} is not {_what_inspect_takes(formats)}")
    checked, note = found.input_manifest_of(p)
    info = found.inspect(p)
    info["checksums"] = ("match the manifest" if checked is not None else
                         "manifest ignored: the file's bytes are not those slmedge wrote (derived by another tool)"
                         if note else "none recorded (not written by slmedge)")
    return info


def _what_inspect_takes(formats) -> str:
    files = " or ".join(f"a {f.suffix} file" for f in formats if f.single_file)
    folders = " or ".join(f"{f.what} ({f.suffix} file or its folder)" if f.suffix else f"{f.what} (its folder)"
                          for f in formats if not f.single_file)
    return ", ".join(x for x in (files, folders) if x) + " or an slmedge artifact folder"


# --- manifests: the one reader of each ----------------------------------------------------------


def read_gguf_manifest(path, metadata: dict | None = None) -> dict | None:
    """The manifest a GGUF export carries, its ``tensors`` one entry per tensor (``unpack_tensors``);
    None: the file has none; ValueError: unreadable. ``metadata``: the file's key/value metadata when
    already read (gguf's reader or llama.cpp's)."""
    if metadata is None:
        import gguf

        field = gguf.GGUFReader(str(path)).fields.get(MANIFEST_KEY)
        metadata = {MANIFEST_KEY: field.contents()} if field is not None else {}
    if MANIFEST_KEY not in metadata:
        return None
    manifest = json.loads(metadata[MANIFEST_KEY])
    if isinstance(manifest, dict) and isinstance(manifest.get("tensors"), dict):
        manifest["tensors"] = {name: _full_entry(entry) for name, entry in unpack_tensors(manifest["tensors"]).items()}
    return manifest


MANIFEST_ENTRY_KEYS = ("type", "codes_kept", "grid", "sparsity", "requantized_because")


def manifest_entry(info: dict) -> dict:
    """A tensor's entry as the manifest stores it: the export's facts about it (``MANIFEST_ENTRY_KEYS``),
    less a kept grid that is the tensor's own type (every llama.cpp grid's codes: ``"grid": "Q4_K"``
    beside ``"type": "Q4_K"``), which ``read_gguf_manifest`` puts back."""
    entry = {k: v for k, v in info.items() if k in MANIFEST_ENTRY_KEYS}
    if entry.get("codes_kept") is True and entry.get("grid") == entry.get("type"):
        del entry["grid"]
    return entry


def _full_entry(entry):
    """``manifest_entry`` undone: codes kept with no grid named are on their type's own grid."""
    if isinstance(entry, dict) and entry.get("codes_kept") is True and "grid" not in entry and "type" in entry:
        return {**entry, "grid": entry["type"]}
    return entry


# A GGUF's manifest says per tensor what slmedge did with it (type, codes kept, grid, sparsity). Written
# one key per tensor it is ~20 kB for a 30-block model, more than the metadata llama-quantize writes
# into its files, and nearly all of it repeats: the same entry for a tensor in every block. So the
# blocks that share an entry share one key, their numbers as ranges: "blk.{0-3,7,9-29}.ffn_down.weight".
# A plain name is a key of one tensor, so the manifests written one key per tensor read the same.
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.+)")
_BLOCK_KEY = re.compile(r"blk\.\{([0-9,-]+)\}\.(.+)")
MAX_PACKED_BLOCKS = 1 << 16  # more blocks than any GGUF has: a key naming more is not slmedge's


def _ranges(numbers: list[int]) -> str:
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def pack_tensors(entries: dict[str, dict]) -> dict[str, dict]:
    """``entries`` (tensor name -> entry), the blocks of each tensor that share an entry under one key."""
    packed: dict[str, dict] = {}
    groups: dict[tuple[str, str], tuple[dict, list[int]]] = {}  # (tensor, entry's JSON) -> (entry, blocks)
    for name, entry in entries.items():
        m = _BLOCK_NAME.fullmatch(name)
        if m is None:
            packed[name] = entry
            continue
        key = (m.group(2), json.dumps(entry, sort_keys=True, default=str))
        groups.setdefault(key, (entry, []))[1].append(int(m.group(1)))
    for (rest, _), (entry, blocks) in groups.items():
        name = f"blk.{blocks[0]}.{rest}" if len(blocks) == 1 else f"blk.{{{_ranges(blocks)}}}.{rest}"
        packed[name] = entry
    return packed


def unpack_tensors(packed: dict) -> dict[str, dict]:
    """The manifest's ``tensors`` (``pack_tensors``'s keys, or one key per tensor) as one entry per
    tensor, block by block (``_tensor_order``). ValueError: a key that is not slmedge's (a range
    backwards or past MAX_PACKED_BLOCKS, a tensor named twice)."""
    out: dict[str, dict] = {}

    def put(name: str, entry) -> None:
        if name in out:
            raise ValueError(f"the manifest names tensor {name} twice")
        out[name] = entry

    for key, entry in packed.items():
        m = _BLOCK_KEY.fullmatch(key)
        if m is None:
            put(key, entry)
            continue
        count = 0
        for part in m.group(1).split(","):
            first, dash, last = part.partition("-")
            if not first.isdigit() or (dash and not last.isdigit()):
                raise ValueError(f"the manifest's tensor key {key!r} is not a list of block ranges")
            a, b = int(first), int(last or first)
            count += b - a + 1
            if b < a or count > MAX_PACKED_BLOCKS:
                raise ValueError(f"the manifest's tensor key {key!r} names blocks out of range")
            for i in range(a, b + 1):
                put(f"blk.{i}.{m.group(2)}", entry)
    return dict(sorted(out.items(), key=lambda kv: _tensor_order(kv[0])))


def _tensor_order(name: str):
    """Block by block in number order, each block's tensors by name; the tensors outside blocks by name."""
    m = _BLOCK_NAME.fullmatch(name)
    return ("blk", int(m.group(1)), m.group(2)) if m else (name, -1, "")


def read_export_manifest(path) -> dict | None:
    """The manifest of a folder export (ONNX, compressed-tensors: its folder, or a model file in it);
    None: it has none."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    f = folder / EXPORT_MANIFEST
    return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else None


read_onnx_manifest = read_export_manifest


def verified_onnx_manifest(path) -> dict | None:
    """The manifest of an ONNX export, checked (``verified_export_manifest``)."""
    return verified_export_manifest(path, "ONNX")


def verified_export_manifest(path, label: str) -> dict | None:
    """The manifest of a folder export (``label``: how messages name its format) after checking it and
    every file it lists against their sha256 (ArtifactError naming the first that changed); None: a
    folder slmedge did not write."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    try:
        manifest = read_export_manifest(folder)
    except ValueError as exc:
        raise ArtifactError(f"{folder / EXPORT_MANIFEST} is not valid JSON: the export is corrupt") from exc
    if manifest is None:
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ArtifactError(f"{folder / EXPORT_MANIFEST} is not an slmedge export manifest")
    # Every folder export's manifest was written sealed (ONNX since seals came, 9705866; the later
    # formats from their start): an unsealed one had its seal removed. (The ONNX exports of the
    # development builds of 2026-11-30 and -12-01 before that commit, never released, are refused too:
    # nothing tells them from an edited one; export them again.)
    check_seal(manifest, folder / EXPORT_MANIFEST, ArtifactError, required=True)
    for name, info in sorted(manifest["files"].items()):
        f = folder / name
        if not f.is_file():
            raise ArtifactError(f"the {label} export {folder} is missing {name}")
        if sha256_file(f) != (info or {}).get("sha256"):
            raise ArtifactError(f"checksum mismatch for {name} in {folder}: the file was modified or is corrupt since "
                                "slmedge wrote it; export it again")
    return manifest


def write_export_manifest(folder: Path, body: dict, started: float) -> dict:
    """Write a folder export's manifest, last: ``body`` with ``files`` (the sha256 and size of every
    file in ``folder``) and ``seconds`` (since ``started``, a ``time.perf_counter()``), sealed. Returns it."""
    import time

    from ..fsutil import sealed, write_json_atomic

    files = sorted(p for p in Path(folder).iterdir() if p.is_file() and p.name != EXPORT_MANIFEST)
    manifest = sealed({**body, "files": {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files},
                       "seconds": round(time.perf_counter() - started, 2)})
    write_json_atomic(Path(folder) / EXPORT_MANIFEST, manifest)
    return manifest


def onnx_model_files(path) -> list[Path]:
    """An ONNX model file and its external-data files beside it (named after it)."""
    f = Path(path)
    return sorted(q for q in f.parent.iterdir() if q.is_file() and q.name.startswith(f.name)) if f.is_file() else [f]


def onnx_model_facts(path) -> dict:
    """An ONNX model file's shape (its folder's config.json), parameters and whether it runs
    integer kernels (MatMulNBits / MatMulInteger)."""
    info = inspect_onnx(Path(path))
    cfg = Path(info["path"]).parent / "config.json"
    config = json.loads(cfg.read_text(encoding="utf-8")) if cfg.is_file() else {}
    ops = info.get("ops", {})
    return {"config": config, "params": info.get("params"),
            "quantized": bool(ops.get("MatMulNBits") or ops.get("MatMulInteger"))}


def gguf_model_facts(path) -> dict:
    """A GGUF file's shape in the config's names, parameters and whether its weights are quantized,
    through llama.cpp's reader (vocabulary only: fast)."""
    from ..backends.llamacpp import vocab_only
    from ..errors import CorruptModelError

    try:
        with vocab_only(path) as llm:
            md = dict(llm.metadata)
            params = int(llm._model.n_params()) if hasattr(llm, "_model") else None
    except ValueError as exc:
        raise CorruptModelError(f"llama.cpp cannot read {path}: not a valid GGUF model") from exc
    arch = md.get("general.architecture", "")

    def get(key):
        value = md.get(f"{arch}.{key}")
        return int(value) if value is not None else None

    config = {"num_hidden_layers": get("block_count"), "num_attention_heads": get("attention.head_count"),
              "num_key_value_heads": get("attention.head_count_kv"), "head_dim": get("attention.key_length"),
              "hidden_size": get("embedding_length")}
    return {"config": config, "params": params,
            "quantized": str(md.get("general.file_type", "")) not in ("0", "1")}  # ALL_F32, MOSTLY_F16


def is_onnx_folder(path: Path) -> bool:
    return path.is_dir() and ((path / "model.onnx").is_file() or bool(list(path.glob("*.onnx"))))


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


# How the manifest names a tensor slmedge left to llama.cpp's quantizer (followed by the file's type).
REQUANTIZED = "requantized by llama.cpp"


def inspect_gguf(path: Path) -> dict:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError/struct errors on corrupt files
        raise InspectError(f"{path} is not a readable GGUF file: {brief(exc, 200)}") from exc
    fields = {}
    for name, f in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name.rsplit(".", 1)[1] in ("tokens", "scores", "token_type", "merges"):
            continue
        try:
            fields[name] = f.contents()
        except Exception:  # noqa: BLE001
            continue
    arch = fields.get("general.architecture")
    try:
        manifest = read_gguf_manifest(path, fields)
    except ValueError:
        manifest = {"error": "unreadable"}
    fields.pop(MANIFEST_KEY, None)
    rows = [(t.tensor_type.name, int(np.prod(t.shape)), int(t.n_bytes)) for t in reader.tensors]
    if manifest and isinstance(manifest.get("tensors"), dict):
        # The manifest is written before llama.cpp re-quantizes what slmedge left to it, so it names the
        # file's type there ("requantized by llama.cpp (q4_1)"); the type llama.cpp chose is the file's.
        chosen = {t.name: t.tensor_type.name for t in reader.tensors}
        for name, entry in list(manifest["tensors"].items()):  # unpacked entries may be one shared dict
            if str(entry.get("type", "")).startswith(REQUANTIZED) and name in chosen:
                manifest["tensors"][name] = {**entry, "type": f"{chosen[name]}, {entry['type']}"}
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

    from ..backends.ort import model_file

    f = model_file(path)
    try:
        model = onnx.load(str(f), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf decode errors
        raise InspectError(f"{f} is not a readable ONNX model: {brief(exc, 200)}") from exc
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
    manifest = read_onnx_manifest(folder)
    if manifest is not None:
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


def gguf_rows(info: dict) -> list[tuple[str, str]]:
    """`slmedge inspect`'s rows for a GGUF file."""
    tok = info["tokenizer"]
    hp = info["hparams"]
    return [("tokenizer", f"{tok['model']} / pre {tok['pre']}, {tok['vocab']} tokens"
             + (", chat template" if tok["chat_template"] else "")),
            ("hparams", ", ".join(f"{k}={v}" for k, v in hp.items() if not isinstance(v, list))[:300])]


def onnx_rows(info: dict) -> list[tuple[str, str]]:
    """`slmedge inspect`'s rows for an ONNX export."""
    return [("KV cache", f"yes, {info['layers']} layers" if info["kv_cache"] else "no"),
            ("ops", ", ".join(f"{k} x{v}" for k, v in info["ops"].items()))]


def inspect_artifact(path: Path) -> dict:
    from ..compress.artifact import Artifact

    art = Artifact.open(path)  # every file against its sha256, the manifest against its seal
    m = art.manifest
    layers = m.get("layers", {})
    coded = [e for e in layers.values() if "bits" in e]
    return {
        "path": str(path), "format": "slmedge-artifact", "format_version": art.version,
        "architecture": m.get("architecture"),
        "recipe": m.get("recipe"), "base_model": m.get("base_model"), "compressed_linears": len(coded),
        "pruned_linears": sum(1 for e in layers.values() if "sparsity" in e),
        "files": {n: f["bytes"] for n, f in m.get("files", {}).items()}, "summary": m.get("summary"),
        "storage": artifact_storage(path, m),
    }


# What each kind of tensor in the quantization file is, by the suffix of its name.
_QUANT_KINDS = {".qweight": "codes", ".scales": "scales", ".zeros": "zero points", ".perm": "act-order permutations",
                ".mask": "pruning masks"}


def artifact_storage(path: Path, manifest: dict) -> dict:
    """Where an artifact's bytes go: kind -> bytes (codes, scales, zero points, permutations, masks,
    searched scales, kept values of pruned linears, untouched tensors per dtype, version 1's dense
    fp32 weights, safetensors headers, tokenizer and config files, the manifest), from the files'
    headers alone. The kinds add up to the directory's size."""
    from ..models.artifact_format import QUANT_FILE, V1_WEIGHTS_FILE, WEIGHTS_FILE, safetensors_header
    from ..models.artifact_weights import KEPT_SUFFIX

    out: dict[str, int] = {}

    def add(kind: str, n: int) -> None:
        out[kind] = out.get(kind, 0) + int(n)

    path = Path(path)
    for name in sorted(manifest.get("files", {})):
        f = path / name
        size = f.stat().st_size
        header = safetensors_header(f) if name.endswith(".safetensors") else None
        if header is None:
            add("tokenizer and config files", size)
            continue
        data = 0
        for key, info in header.items():
            if key == "__metadata__" or not isinstance(info, dict):
                continue
            start, end = info.get("data_offsets", (0, 0))
            data += end - start
            dtype = str(info.get("dtype", "?")).lower()
            if name == QUANT_FILE:
                kind = next((k for suffix, k in _QUANT_KINDS.items() if key.endswith(suffix)), "searched scales (AWQ)")
            elif name == WEIGHTS_FILE:
                kind = f"kept values of pruned linears ({dtype})" if key.endswith(KEPT_SUFFIX) else \
                    f"tensors stored as they are ({dtype})"
            elif name == V1_WEIGHTS_FILE:
                kind = f"dense weights, version 1 ({dtype})"
            else:
                kind = f"other weights ({dtype})"
            add(kind, end - start)
        add("safetensors headers", size - data)
    from ..models.artifact_format import manifest_path

    add("manifest", manifest_path(path).stat().st_size)
    return out

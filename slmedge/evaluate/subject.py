"""What `slmedge evaluate` evaluates: a source opened in one runtime, with its tokenizer and identity.

The runtime follows from the file (``.gguf`` -> llama.cpp, ``.onnx`` or an ONNX export folder ->
onnxruntime, anything else -> torch) or ``--runtime``. An artifact or model asked for in
llama.cpp or onnxruntime is exported once (codes kept where the type allows, verified) into the
cache and run from there, so all three runtimes serve every source.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..fsutil import sha256_file
from ..paths import cache_dir
from ..runtimes import (LlamaCppRuntime, OnnxRuntime, Runtime, TorchRuntime, check_runtime_name,
                        runtime_for_path)
from .tokens import Encoder, HFEncoder, LlamaCppEncoder


@dataclass
class Subject:
    spec: str
    runtime: Runtime
    encoder: Encoder
    identity: dict
    file: Path | None = None  # the file (or folder) whose size is the model's size
    params: int | None = None
    config: dict = field(default_factory=dict)
    base_spec: str | None = None  # the reference by default: an artifact's base model

    @property
    def label(self) -> str:
        return self.identity.get("label") or Path(self.spec).name or self.spec

    def close(self):
        self.runtime.close()


def _sha256_files(paths) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def base_spec_from_identity(base: dict | None) -> str | None:
    if not base:
        return None
    kind = base.get("kind")
    if kind == "embedded":
        return base.get("name")
    if kind in ("hf_dir", "gguf", "artifact"):
        return base.get("path")
    if kind == "hub":
        return base.get("id")
    return None


def _artifact_base(folder: Path) -> str | None:
    try:
        manifest = json.loads((folder / "slmedge.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return base_spec_from_identity(manifest.get("base_model"))


def _export_base(manifest: dict | None) -> str | None:
    """The base model of an export: its source artifact's base, or the source folder itself."""
    if not manifest:
        return None
    src = manifest.get("source")
    if src and Path(src, "slmedge.json").is_file():
        return _artifact_base(Path(src))
    return src if src and Path(src).exists() else None


def _gguf_manifest(metadata: dict) -> dict | None:
    try:
        return json.loads(metadata["slmedge.manifest"]) if "slmedge.manifest" in metadata else None
    except ValueError:
        return None


def _cached_export(folder: Path, fmt: str) -> Path:
    """An export of ``folder`` in the cache (auto type: the artifact's codes where they fit)."""
    from ..export.gguf import export_gguf
    from ..export.onnx import export_onnx

    key = _sha256_files([p for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors")])[:16]
    root = cache_dir() / "exports"
    root.mkdir(parents=True, exist_ok=True)
    if fmt == "gguf":
        out = root / f"{key}.gguf"
        if not out.is_file():
            export_gguf(folder, out, "auto")
        return out
    out = root / f"{key}-onnx"
    if not (out / "slmedge-export.json").is_file():
        export_onnx(folder, out, "auto", overwrite=True)
    return out


def open_subject(spec: str | None, runtime: str | None = None, threads: int | None = None, n_ctx: int = 2048,
                 device: str = "cpu", trust_remote_code: bool = False, factory=None) -> Subject:
    """``factory(runtime, path, threads, n_ctx)``, when given, opens llama.cpp and onnxruntime files
    (a target's runner, a GPU back end); by default they open here on the CPU."""
    from ..models.source import load, resolve

    spec = None if spec is None else str(spec)
    spec_s = spec or "smollm2-135m"
    path = Path(spec_s).expanduser()
    implied = runtime_for_path(path) if path.exists() else "torch"
    rt = check_runtime_name(runtime) if runtime else implied
    if path.exists() and path.is_file() and path.suffix.lower() not in (".gguf", ".onnx"):
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                implied = rt = runtime or "llama.cpp"

    # --- files that are already in a runtime's format ----------------------------------------
    if implied == "llama.cpp":
        if rt == "onnxruntime":
            raise ConfigError(f"{path} is a GGUF file: run it in llama.cpp (or torch); onnxruntime needs an ONNX export")
        if rt == "torch":
            loaded = load(str(path))
            return _torch_subject(spec_s, loaded, threads, device, None, {"kind": "gguf", "path": str(path.resolve()),
                                                                          "sha256": sha256_file(path)})
        run = factory("llama.cpp", path, threads, n_ctx) if factory else LlamaCppRuntime(path, threads, n_ctx=n_ctx)
        manifest = _gguf_manifest(run.metadata)
        base = _export_base(manifest)
        ident = {"kind": "gguf", "path": str(path.resolve()), "sha256": sha256_file(path), "label": path.name,
                 "qtype": (manifest or {}).get("qtype")}
        return Subject(spec_s, run, LlamaCppEncoder(getattr(run, "llm", None) or _vocab(path)), ident, file=path,
                       params=run.n_params, base_spec=base)
    if implied == "onnxruntime":
        if rt != "onnxruntime":
            raise ConfigError(f"{path} is an ONNX export: it runs in onnxruntime (evaluate its source for {rt})")
        from ..runtimes.ort import model_file

        run = factory("onnxruntime", model_file(path), threads, n_ctx) if factory else OnnxRuntime(path, threads)
        folder = model_file(path).parent
        manifest = None
        if (folder / "slmedge-export.json").is_file():
            manifest = json.loads((folder / "slmedge-export.json").read_text(encoding="utf-8"))
        encoder = _hf_encoder(folder, trust_remote_code)
        onnx_file = model_file(path)
        files = [p for p in folder.iterdir() if p.is_file() and p.name.startswith(onnx_file.name)]
        ident = {"kind": "onnx", "path": str(onnx_file.resolve()), "sha256": _sha256_files(files),
                 "label": folder.name if onnx_file.name == "model.onnx" else onnx_file.name,
                 "qtype": (manifest or {}).get("type")}
        return Subject(spec_s, run, encoder, ident, file=onnx_file, params=_onnx_params(onnx_file),
                       base_spec=_export_base(manifest))

    # --- model sources: torch, or exported for the other runtimes ------------------------------
    source = resolve(spec, None)
    if rt == "torch":
        loaded = load(source, trust_remote_code=trust_remote_code)
        base = _artifact_base(source.path) if source.kind == "artifact" else None
        return _torch_subject(spec_s, loaded, threads, device, base, dict(loaded.identity))
    from ..export.api import source_folder

    folder = source_folder(spec)
    exported = _cached_export(folder, "gguf" if rt == "llama.cpp" else "onnx")
    sub = open_subject(str(exported), rt, threads, n_ctx, device, trust_remote_code, factory)
    sub.spec = spec_s
    sub.identity["exported_from"] = str(folder)
    sub.identity["label"] = f"{Path(spec_s).name} ({rt})"
    if source.kind == "artifact":
        sub.base_spec = _artifact_base(source.path)
    elif sub.base_spec is None:
        sub.base_spec = None
    return sub


def _vocab(path: Path):
    """llama.cpp's tokenizer of a GGUF file without its weights (the model runs elsewhere)."""
    from ..runtimes.native import quiet_native_stderr, require_llama_cpp

    with quiet_native_stderr():
        return require_llama_cpp().Llama(model_path=str(path), vocab_only=True, verbose=False)


def _torch_subject(spec, loaded, threads, device, base, identity) -> Subject:
    run = TorchRuntime(loaded.model, threads, device=device)
    params = sum(p.numel() for p in loaded.model.parameters())
    file = None
    if loaded.hf_dir is not None:
        file = loaded.hf_dir
    ident = dict(identity)
    if loaded.hf_dir is not None and (Path(loaded.hf_dir) / "slmedge.json").is_file():
        ident["sha256"] = sha256_file(Path(loaded.hf_dir) / "slmedge.json")
    elif loaded.hf_dir is not None and "sha256" not in ident:
        from ..models.source import weights_digest

        ident["sha256"] = ident.get("weights_sha256") or weights_digest(Path(loaded.hf_dir))
    ident.setdefault("label", Path(spec).name if spec else "model")
    ident["architecture"] = loaded.arch.model_type
    return Subject(spec, run, HFEncoder(loaded.tokenizer), ident, file=file, params=params,
                   config={"model_type": loaded.arch.model_type}, base_spec=base)


def _hf_encoder(folder: Path, trust_remote_code: bool) -> HFEncoder:
    from transformers import AutoTokenizer

    from ..models.source import tokenizer_kwargs

    try:
        return HFEncoder(AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code,
                                                       **tokenizer_kwargs(folder)))
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"{folder} has no tokenizer files beside the ONNX model; export with slmedge export "
                          f"(which copies them) ({str(exc).splitlines()[0][:150]})") from exc


def _onnx_params(path: Path) -> int | None:
    try:
        from ..export.inspect import inspect_onnx

        return inspect_onnx(path)["params"]
    except Exception:  # noqa: BLE001
        return None

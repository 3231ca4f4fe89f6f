"""What `slmedge evaluate` evaluates: a source opened in one runtime, with its tokenizer and identity.

The runtime follows from the file (``.gguf`` -> llama.cpp, ``.onnx`` or an ONNX export folder ->
onnxruntime, anything else -> torch) or ``--runtime``. An artifact or model asked for in
llama.cpp or onnxruntime is exported once (codes kept where the type allows, verified) into the
cache and run from there, so all three runtimes serve every source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..fsutil import sha256_file
from ..models.artifact_format import is_artifact, manifest_path, read_manifest
from ..paths import cache_dir
from ..runtimes import Runtime, TorchRuntime
from ..runtimes.memprobe import open_file_runtime
from ..runtimes.registry import RUNTIMES, check_runtime_name, file_runtime, get_runtime, source_runtime
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
        manifest = read_manifest(folder)
    except (OSError, ValueError):
        return None
    return base_spec_from_identity(manifest.get("base_model"))


def _export_base(manifest: dict | None) -> str | None:
    """The base model of an export: its source artifact's base, or the source folder itself."""
    if not manifest:
        return None
    src = manifest.get("source")
    if src and is_artifact(src):
        return _artifact_base(Path(src))
    return src if src and Path(src).exists() else None


def _manifest(fmt: str, path: Path, **kw) -> dict | None:
    """An export's manifest through its format's one reader (None: none, or unreadable)."""
    from ..export.formats import get_format

    try:
        return get_format(fmt).read_manifest(path, **kw)
    except ValueError:
        return None


def _cached_export(folder: Path, fmt: str) -> Path:
    """An export of ``folder`` in the cache (auto type: the artifact's codes where they fit)."""
    from ..export.formats import get_format

    export_format = get_format(fmt)
    key = _sha256_files([p for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors")])[:16]
    root = cache_dir() / "exports"
    root.mkdir(parents=True, exist_ok=True)
    out = root / export_format.output_name(f"{key}-{fmt}")
    if not export_format.complete(out):
        export_format.write(folder, out, "auto", overwrite=True)
    return out


def _file_format(path: Path) -> str | None:
    """The export format of a file or folder by its name, or by a format's magic bytes."""
    from ..export.formats import FORMATS

    found = file_runtime(path) if path.exists() else None
    if found is not None:
        return found.export_format
    if path.is_file():
        with open(path, "rb") as f:
            head = f.read(16)
        return next((name for name, f in FORMATS.items() if f.magic and head.startswith(f.magic)), None)
    return None


def _format_runtime(fmt: str, runtime: str | None) -> str:
    """``runtime`` if given, else the first registered runtime that runs files of ``fmt``."""
    if runtime:
        return check_runtime_name(runtime)
    return next(n for n, s in RUNTIMES.items() if s.export_format == fmt)


def open_subject(spec: str | None, runtime: str | None = None, threads: int | None = None, n_ctx: int = 2048,
                 device: str = "cpu", trust_remote_code: bool = False, factory=None) -> Subject:
    """``factory(runtime, path, threads, n_ctx)``, when given, opens model files (a transport's
    ``open_runtime``: a target's runner, a GPU back end); by default they open here on the CPU."""
    from ..models.source import load, resolve

    spec = None if spec is None else str(spec)
    spec_s = spec or "smollm2-135m"
    path = Path(spec_s).expanduser()
    factory = factory or open_file_runtime
    fmt = _file_format(path)
    rt = _format_runtime(fmt, runtime) if fmt else (check_runtime_name(runtime) if runtime else source_runtime().name)
    want = get_runtime(rt)

    # --- files that are already in a runtime's format ----------------------------------------
    if fmt is not None and want.runs_files and want.export_format != fmt:
        raise ConfigError(f"{path} is a {fmt.upper()} export: {rt} runs {want.export_format.upper()} exports; run it "
                          f"in {' or '.join(n for n, s in RUNTIMES.items() if s.export_format == fmt)} "
                          "(or evaluate its source)")
    if fmt == "gguf":
        if not want.runs_files:
            loaded = load(str(path))
            return _torch_subject(spec_s, loaded, threads, device, None, {"kind": "gguf", "path": str(path.resolve()),
                                                                          "sha256": sha256_file(path)})
        run = factory(rt, path, threads, n_ctx)
        manifest = _manifest(fmt, path, metadata=run.metadata)
        base = _export_base(manifest)
        ident = {"kind": "gguf", "path": str(path.resolve()), "sha256": sha256_file(path), "label": path.name,
                 "qtype": (manifest or {}).get("qtype")}
        return Subject(spec_s, run, LlamaCppEncoder(getattr(run, "llm", None) or _vocab(path)), ident, file=path,
                       params=run.n_params, base_spec=base)
    if fmt == "onnx":
        if not want.runs_files:
            raise ConfigError(f"{path} is an ONNX export: it runs in onnxruntime (evaluate its source for {rt})")
        from ..backends.ort import model_file

        run = factory(rt, model_file(path), threads, n_ctx)
        folder = model_file(path).parent
        manifest = _manifest(fmt, folder)
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
    if not want.runs_files:
        loaded = load(source, trust_remote_code=trust_remote_code)
        base = _artifact_base(source.path) if source.kind == "artifact" else None
        return _torch_subject(spec_s, loaded, threads, device, base, dict(loaded.identity))
    from ..export.api import source_folder

    folder = source_folder(spec)
    exported = _cached_export(folder, want.export_format)
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
    from ..backends.llamacpp import quiet_native_stderr, require_llama_cpp

    with quiet_native_stderr():
        return require_llama_cpp().Llama(model_path=str(path), vocab_only=True, verbose=False)


def _torch_subject(spec, loaded, threads, device, base, identity) -> Subject:
    run = TorchRuntime(loaded.model, threads, device=device)
    params = sum(p.numel() for p in loaded.model.parameters())
    file = None
    if loaded.hf_dir is not None:
        file = loaded.hf_dir
    ident = dict(identity)
    if loaded.hf_dir is not None and is_artifact(loaded.hf_dir):
        ident["sha256"] = sha256_file(manifest_path(loaded.hf_dir))
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


def open_on_target(spec, runtime: str | None, threads: int | None, n_ctx: int, profile) -> Subject:
    """``open_subject`` where the profile says: its transport opens the runtime (in this process, on
    a GPU, in a runner under qemu or over ssh) with the profile's threads."""
    from ..targets.registry import transport_for

    transport = transport_for(profile)
    threads = threads or profile.threads or None
    if runtime:
        runtime = check_runtime_name(runtime)
    if not transport.in_process:
        fmt = _file_format(Path(spec)) if spec else None
        if runtime is None:
            runtime = _format_runtime(fmt, None) if fmt else (profile.default_runtime or profile.runtimes[0])
        if not get_runtime(runtime).runs_files:
            raise ConfigError(f"target '{profile.name}' runs {' or '.join(profile.runtimes)}; a {runtime} model is "
                              f"exported for them: pass --runtime {' or --runtime '.join(profile.runtimes)}")
    return open_subject(spec, runtime, threads, n_ctx=n_ctx, device=transport.torch_device,
                        factory=transport.open_runtime)

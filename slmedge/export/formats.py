"""The export formats, registered by name where their writers are defined.

``@register_format("gguf", ...)`` on a writer function records what the rest of slmedge asks
about a format, so nothing else compares format names:

- the writer, ``write(source_folder, out, qtype, *, exact, verify, overwrite, n_threads, **options)``,
  which returns a report (at least ``path``, ``source``, ``source_kind``, ``bytes``,
  ``verification``, ``notes``, ``seconds``), and which of ``export()``'s options it takes;
- what an output is: one file ending in ``suffix``, or a folder (whose name must not end in it);
  its default name; when one on disk is complete;
- the one reader of the manifest an export carries: a dict (``format``, ``source``,
  ``source_kind``, ``source_manifest_sha256`` in every format), or None when it has none; and its
  checked form, which also verifies the output against the checksums the manifest records
  (everything slmedge reads back from its outputs or caches goes through it);
- the types it accepts besides ``auto``, its verification tolerances and the error it raises;
- how ``slmedge export`` and ``slmedge inspect`` show its report and its files.

Importing ``slmedge.export`` registers the built-in formats (GGUF, ONNX).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from ..errors import ConfigError, SlmedgeError
from ..registry import Registry
from .errors import ExportError


def _no_rows(info: dict) -> list[tuple[str, str]]:
    return []


@dataclass(frozen=True)
class ExportFormat:
    name: str
    write: Callable[..., dict]
    label: str  # how messages name it ("GGUF")
    single_file: bool  # one file ending in ``suffix``; else a folder
    suffix: str  # that file's suffix; a folder format: its model file's, refused as the folder's name
    complete: Callable[[Path], bool]  # an output on disk is whole (its last file is written last)
    read_manifest: Callable[..., dict | None]  # (path) -> the export's manifest, None when it has none
    types: tuple[str, ...]  # what the writer accepts besides "auto"
    tolerances: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # kind -> mean_kl, top1
    # (path) -> the manifest of an output slmedge wrote, after checking it and every file it covers
    # against the digests it records (ArtifactError when one changed); None: an output without one.
    # A format without it has only ``read_manifest`` (nothing recorded to check against).
    verified_manifest: Callable[[Path], dict | None] | None = None
    # (path) -> (manifest, note) of an output given as an input (evaluate, inspect): a format whose files
    # other tools derive carrying its manifest along (GGUF) reads those as files slmedge did not write,
    # with a note; without it, ``checked_manifest`` and no note.
    input_manifest: Callable[[Path], tuple[dict | None, str | None]] | None = None
    options: tuple[str, ...] = ()  # export()'s format-specific keyword arguments the writer takes
    packages: tuple[str, ...] = ()  # pip distributions its writer uses (a study's exports are rerun on a new version)
    # () -> None: raises the one-line error (exit 2) when its writer's libraries (an extra) are not installed;
    # a study file listing the format is refused with it before anything runs. None: nothing optional.
    require: Callable[[], None] | None = None
    # (recipe or None for the base model, type) -> why this format cannot write that row's model in that
    # type, as far as the recipe tells (a study file is refused with it before anything runs); None: it can.
    row_problem: Callable[..., str | None] | None = None
    error: type = ExportError  # what the writer raises when it cannot write as asked
    noun: str = ""  # how messages name one export (default "a <label> export")
    folder_holds: str = ""  # a folder format: what is in it (for the message refusing a file name)
    default_stem: str = "{model}-{type}"  # the default output's name, before a file format's suffix
    report_rows: Callable[[dict], list[tuple[str, str]]] = _no_rows  # `slmedge export`'s table rows
    inspect: Callable[[Path], dict] | None = None  # `slmedge inspect` of a file or folder in this format
    inspect_rows: Callable[[dict], list[tuple[str, str]]] = _no_rows  # its table rows
    recognizes: Callable[[Path], bool] | None = None  # a folder in this format, by a look inside
    magic: bytes = b""  # a file in this format by its first bytes, whatever its name
    # What evaluation and the targets ask of an output, so that none of them names a format:
    model_file: Callable[[Path], Path] = Path  # the file its runtime opens (a folder format: the one inside)
    model_files: Callable[[Path], list] = lambda p: [Path(p)]  # the files that are the model (size, copies)
    # (model file) -> config (HF names), params, quantized; kv_positions where its KV cache is static (the
    # positions every decode step reads, whatever the tokens so far: the roofline's KV term)
    model_facts: Callable[[Path], dict] | None = None
    tokenizer: str = "beside"  # "inside": the file carries its vocabulary; "beside": tokenizer files next to it
    type_key: str = "type"  # the manifest key naming the export's type
    torch_source: bool = False  # models.source can also load it as a model (into torch)

    @property
    def what(self) -> str:
        return self.noun or f"a {self.label} export"

    def check_type(self, qtype) -> str:
        """``qtype`` lower-cased, or the format's error naming the choices."""
        key = str(qtype).lower()
        if key != "auto" and key not in self.types:
            raise self.error(f"unknown {self.label} type '{qtype}'; choose {', '.join(('auto', *self.types))}")
        return key

    def output_name(self, stem: str) -> str:
        """The name of an output called ``stem``: a file format adds its suffix."""
        return stem + self.suffix if self.single_file else stem

    def default_output(self, model: str, qtype: str) -> str:
        return self.output_name(self.default_stem.format(model=model, type=qtype))

    def check_output(self, out: Path) -> None:
        """Refuse an output path of the wrong kind (a file format's name without its suffix, unless it
        exists; a folder format's name with its model file's suffix)."""
        if self.single_file:
            if out.suffix.lower() != self.suffix and not out.exists():
                raise ConfigError(f"{self.what} is one file: give an output path ending in {self.suffix}, not {out}")
        elif self.suffix and out.suffix.lower() == self.suffix:
            holds = f" ({self.folder_holds})" if self.folder_holds else ""
            raise ConfigError(f"{self.what} is a directory{holds}: give a folder, not {out}")

    def checked_manifest(self, out: Path) -> dict | None:
        """The output's manifest, checked against what it records where the format records digests."""
        return (self.verified_manifest or self.read_manifest)(out)

    def input_manifest_of(self, out: Path) -> tuple[dict | None, str | None]:
        """(manifest, note) of ``out`` given as an input; reuse as slmedge's own goes through ``reusable``."""
        if self.input_manifest is not None:
            return self.input_manifest(out)
        return self.checked_manifest(out), None

    def reusable(self, out: Path) -> bool:
        """Whether an output slmedge wrote before (a cache entry, a study's export) is whole and
        unchanged: complete, and its files match the checksums its manifest records."""
        if not self.complete(out):
            return False
        try:
            return self.checked_manifest(out) is not None
        except (SlmedgeError, OSError, ValueError):
            return False

    def writer_options(self, options: dict) -> dict:
        """The options of ``export()`` this format's writer takes."""
        return {k: options[k] for k in self.options if k in options}


FORMATS: Registry = Registry("export format")  # name -> ExportFormat


def register_format(name: str, **facts) -> Callable[[Callable[..., dict]], Callable[..., dict]]:
    """Decorator: register a writer function as the export format ``name`` (a duplicate name is refused).

    The writer registered (and returned, so a direct call is the same) holds its output's lock for the
    whole write (``fsutil.output_lock``): a second writer of the same output at the same time is refused
    with the first one's PID and command, before it reads anything, whoever calls it."""

    def wrap(write: Callable[..., dict]) -> Callable[..., dict]:
        locked = one_writer(write)
        FORMATS.add(name, ExportFormat(name=name, write=locked, **facts), write.__qualname__)
        return locked

    return wrap


def one_writer(write: Callable[..., dict]) -> Callable[..., dict]:
    """``write(source, out, ...)`` holding ``out``'s lock (a caller that holds it already re-enters)."""
    import functools

    from ..fsutil import output_lock

    @functools.wraps(write)
    def locked(source, out, *args, **kwargs):
        with output_lock(out):
            return write(source, out, *args, **kwargs)

    return locked


def unregister_format(name: str) -> None:
    """Remove a registration (for formats registered by tests or plug-ins)."""
    FORMATS.remove(name)


def format_for_path(path) -> str | None:
    """The format an output on disk is in, by a file's suffix (a folder format's model file too),
    a folder's contents, or a file's first bytes; None: not an export (a model source)."""
    p = Path(path)
    if not p.exists():
        return None
    for name, fmt in FORMATS.items():
        if p.is_file() and fmt.suffix and p.suffix.lower() == fmt.suffix:
            return name
        if p.is_dir() and fmt.recognizes is not None and fmt.recognizes(p):
            return name
    if p.is_file():
        with open(p, "rb") as f:
            head = f.read(16)
        return next((name for name, fmt in FORMATS.items() if fmt.magic and head.startswith(fmt.magic)), None)
    return None


def format_names() -> list[str]:
    return list(FORMATS)


def get_format(name: str) -> ExportFormat:
    key = str(name).lower()
    if key not in FORMATS:
        raise ConfigError(f"unknown format '{key}'; choose {' or '.join(FORMATS)}")
    return FORMATS[key]

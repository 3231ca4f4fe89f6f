"""What a study job reads, identified by content: a job's id hashes these with its settings, so a
changed model folder, calibration file, corpus, task file, target profile, package version or
slmedge source makes a new job (and the old one's result stays recorded, out of the grid).

- Model sources: a local HF folder by the sha256 of every file in it, a ``.gguf`` file by its
  sha256, an slmedge artifact by its manifest (which holds the sha256 of every file), an embedded
  model by its package's version (and the file's sha256 when the package ships it whole), a Hub id
  by the revision asked for.
- Data files (calibration, corpora, tasks): a file the package ships by the sha256 its index
  records (the file is checked against it when found), any other file by its sha256.
- Versions: only the packages whose code computes a job's numbers (``TORCH_STACK`` for every
  job, plus a file format's writer and runtime packages for its exports and their evaluations, and
  the GGUF reader for models read from a GGUF file), and slmedge itself as a digest of its source
  files (the version string stays the same while slmedge is being developed).

File hashes are remembered by (path, size, mtime_ns, ctime_ns, inode), in this process and in a
file in the cache folder, so running a study again hashes nothing that did not change. Files the
study wrote itself (artifacts, exports) are never hashed: their producing job's id stands for them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from ..errors import DataError, ModelNotFoundError

# Packages whose code makes every job's numbers (loading a model, tokenizing, the reference in torch).
TORCH_STACK = ("torch", "transformers", "safetensors", "numpy")
# Writer libraries counted for a format that names none (``ExportFormat.packages``; GGUF and ONNX
# name theirs): to be safe, its exports and their evaluations then count all of these.
FILE_FORMAT_PACKAGES = ("gguf", "onnx", "onnxruntime")
# A model source read from a GGUF file (a .gguf, an embedded model) is converted with this package.
GGUF_READER = ("gguf",)


# --- file content, remembered -----------------------------------------------------------------


class FileHashes:
    """sha256 of files by (path, size, mtime_ns, ctime_ns, inode), kept in memory and in ``store``."""

    def __init__(self, store: Path | None):
        self.store = store
        self.known: dict[str, list] = {}
        self.dirty = False
        if store is not None:
            try:
                data = json.loads(store.read_text(encoding="utf-8"))
                if isinstance(data, dict):
                    self.known = {k: v for k, v in data.items() if isinstance(v, list) and len(v) == 2}
            except (OSError, ValueError):
                pass

    def sha256(self, path: Path) -> str:
        from ..fsutil import sha256_file

        path = Path(path).resolve()
        try:
            st = path.stat()
        except OSError as exc:
            raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc
        key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        seen = self.known.get(str(path))
        if seen is not None and seen[0] == key:
            return seen[1]
        try:
            digest = sha256_file(path)
        except OSError as exc:
            raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc
        self.known[str(path)] = [key, digest]
        self.dirty = True
        return digest

    def save(self) -> None:
        """Write what was learned (entries of files that are gone are dropped); a failure is harmless."""
        if self.store is None or not self.dirty:
            return
        from ..fsutil import write_json_atomic

        keep = {p: v for p, v in self.known.items() if os.path.exists(p)}
        try:
            self.store.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.store, keep)
            self.dirty = False
        except OSError:
            pass


_HASHES: dict[str, FileHashes] = {}


def file_hashes() -> FileHashes:
    """The remembered hashes of the current cache folder."""
    from ..paths import cache_dir

    store = cache_dir() / "study" / "file-sha256.json"
    if str(store) not in _HASHES:
        _HASHES[str(store)] = FileHashes(store)
    return _HASHES[str(store)]


def save_hashes() -> None:
    for h in _HASHES.values():
        h.save()


# --- versions ---------------------------------------------------------------------------------


SOURCE_DIGEST_ENV = "SLMEDGE_SOURCE_DIGEST"


@functools.cache
def slmedge_digest() -> str:
    """sha256 over slmedge's source files (name and content): the code the jobs run, once per
    process (the code a process runs is what it imported). ``$SLMEDGE_SOURCE_DIGEST``, when set, is
    taken instead: a process that starts another slmedge process on the same study can pass its own,
    so that an edit made in between does not make the two see different jobs."""
    pinned = os.environ.get(SOURCE_DIGEST_ENV)
    if pinned:
        return pinned
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


@functools.cache
def package_version(dist: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def versions(packages, source: str | None = None) -> dict:
    """{package: version} of ``packages`` (None when absent), and slmedge's source digest (``source``:
    one computed already)."""
    out = {p.replace("-", "_"): package_version(p) for p in sorted(set(packages))}
    out["slmedge"] = source or slmedge_digest()
    return out


def format_packages(fmt: str) -> tuple[str, ...]:
    """The packages that shape an export in ``fmt`` and its evaluations: its writer's libraries and
    the runtime that verifies and runs it."""
    from ..export.formats import get_format
    from ..runtimes.registry import RUNTIMES

    writer = tuple(get_format(fmt).packages or FILE_FORMAT_PACKAGES)
    runtimes = tuple(r.package for r in RUNTIMES.values() if r.export_format == fmt and r.package)
    return writer + runtimes


# --- model sources ----------------------------------------------------------------------------


@functools.cache
def _folder_digest(folder: str, stamp: tuple) -> str:
    hashes = file_hashes()
    h = hashlib.sha256()
    for f in _folder_files(Path(folder)):
        h.update(f.relative_to(folder).as_posix().encode() + b"\0" + hashes.sha256(f).encode())
    return h.hexdigest()


def _folder_files(folder: Path) -> list[Path]:
    """Every file in a model folder, hidden ones (``.git``, ``.cache``) left out."""
    return sorted(p for p in folder.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def model_identity(spec: str) -> dict:
    """What a model source is, by content; an absent one is a ModelNotFoundError naming it."""
    from ..models.artifact_format import MANIFEST
    from ..models.source import EMBEDDED, resolve

    src = resolve(spec)
    if src.kind == "embedded":
        import importlib.util

        entry = EMBEDDED[src.spec]
        found = importlib.util.find_spec(entry.package)
        if found is None or not found.submodule_search_locations:
            raise ModelNotFoundError(f"the embedded model '{src.spec}' needs the "
                                     f"{entry.package.replace('_', '-')} package: {entry.pip}")
        out = {"kind": "embedded", "name": src.spec, "package": entry.package,
               "version": package_version(entry.package)}
        whole = Path(list(found.submodule_search_locations)[0]) / entry.filename
        if not entry.assembled and whole.is_file():
            out["sha256"] = file_hashes().sha256(whole)
        return out
    if src.kind == "gguf":
        return {"kind": "gguf", "sha256": file_hashes().sha256(src.path)}
    if src.kind == "artifact":  # its manifest holds the sha256 of every file (checked when loaded)
        return {"kind": "artifact", "manifest_sha256": file_hashes().sha256(src.path / MANIFEST)}
    if src.kind == "hf_dir":
        files = _folder_files(src.path)
        stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns, f.stat().st_ino) for f in files)
        return {"kind": "hf_dir", "sha256": _folder_digest(str(src.path), stamp)}
    return {"kind": src.kind, "id": src.spec, "revision": src.revision}  # the Hub: the revision asked for


def model_packages(identity: dict) -> tuple[str, ...]:
    """Packages beyond the torch stack that reading this model source uses."""
    return GGUF_READER if identity.get("kind") in ("gguf", "embedded") else ()


# --- data files -------------------------------------------------------------------------------


def _data_sha256(files, rel: str) -> str:
    """sha256 of the data file ``rel`` as the data folder ``files`` finds it (the overlay's, else the
    package's, by the sha256 its index records); a missing one is a DataError."""
    from ..data.files import SHIPPED, shipped_files

    path = files.path(rel)
    if rel in shipped_files() and Path(path) == SHIPPED / rel:
        return shipped_files()[rel]["sha256"]
    return file_hashes().sha256(path)


def calibration_inputs(spec: str, data_dir=None) -> dict:
    """The files a calibration spec reads (resolved as ``read_texts`` resolves them), by content."""
    from ..data.calibration import calibration_sources
    from ..data.files import data_files

    kind, where = calibration_sources(spec, data_dir)
    if kind == "mix":
        from ..data.calibration import spec_parts

        return {(f"hub:{part}" if k == "hub" else k): v
                for part in spec_parts(spec) for k, v in calibration_inputs(part, data_dir).items()}
    if kind == "hub":
        return {"hub": spec}  # a Hub dataset: by name (its content is not known before loading it)
    if kind == "file":
        return {spec: file_hashes().sha256(where)}
    files = data_files(data_dir)
    return {rel: _data_sha256(files, rel) for rel in where}


def _corpus_sha256(name: str, data_dir) -> str:
    """As ``slmedge.evaluate.corpora.load_corpus`` resolves ``name``."""
    from ..data.files import data_files

    path = Path(name).expanduser()
    if path.is_file():
        return file_hashes().sha256(path)
    files = data_files(data_dir)
    if name == "wikitext2":
        return _data_sha256(files, "perplexity/wikitext2/test.txt")
    lang = name.split(":", 1)[1] if name.startswith("ntrex128:") else name
    if lang and "/" not in lang and files.find(f"perplexity/ntrex128/{lang}.txt") is not None:
        return _data_sha256(files, f"perplexity/ntrex128/{lang}.txt")
    from ..evaluate.corpora import load_corpus

    load_corpus(name, data_dir)  # raises the error that names it
    raise DataError(f"unknown corpus '{name}'")


def evaluate_inputs(settings: dict, data_dir=None) -> dict:
    """The data files an evaluation with these [evaluate] settings reads, by what each metric reads:
    perplexity its corpora, fidelity and latency WikiText-2, tasks the task files."""
    from ..evaluate.api import EvalSettings
    from ..evaluate.tasks import task_file

    s = EvalSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}, data_dir=data_dir)
    metrics = set(s.metrics)
    corpora: list[str] = []
    if "perplexity" in metrics:
        corpora += (["wikitext2"] if s.wikitext else []) + [f"ntrex128:{lang}" for lang in s.langs] + list(s.corpora)
    if metrics & {"fidelity", "latency"}:
        corpora.append("wikitext2")
    out = {f"corpus:{c}": _corpus_sha256(c, data_dir) for c in dict.fromkeys(corpora)}
    if "tasks" in metrics:
        for t in s.task_list():
            out[f"task:{t}"] = file_hashes().sha256(task_file(t, data_dir))
    return out


def profile_sha256(target: str) -> str:
    """The content of a target's profile file."""
    from ..targets.profiles import get_profile

    prof = get_profile(target, detect=False)
    return file_hashes().sha256(Path(prof.file)) if prof.file else hashlib.sha256(
        json.dumps(prof.name).encode()).hexdigest()

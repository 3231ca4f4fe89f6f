"""The study file: a grid of models x methods x seeds x exports x targets, and what to measure.

    name = "quick"
    models = ["smollm2-135m"]
    seeds = [0]
    targets = ["cpu"]

    [calibration]          # shared by every method that calibrates
    dataset = "c4"
    nsamples = 32
    seqlen = 512

    [evaluate]             # EvalSettings fields
    metrics = ["perplexity", "fidelity", "tasks", "memory", "latency"]
    langs = ["en", "th"]
    tasks = ["arc_easy", "xcopa_th"]
    limit = 50

    [[methods]]            # one entry per compression setting; "none" is the base model
    method = "none"
    [[methods]]
    label = "awq-w4g64"
    method = "awq"
    bits = 4
    group_size = 64
    [[methods]]
    method = "wanda"
    sparsity = "0.5"

    [[exports]]            # each compressed model is evaluated in each export
    format = "none"        # the artifact itself, in torch
    [[exports]]
    format = "gguf"
    type = "auto"

Validated strictly before any work starts: an unknown key, a wrong type or an impossible
combination is an error that names the file and the line.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

_TOP = {"name": str, "description": str, "models": list, "seeds": list, "targets": list, "calibration": dict,
        "evaluate": dict, "methods": list, "exports": list, "workdir": str}
_CALIB = {"dataset": str, "nsamples": int, "seqlen": int, "batch_size": int}
_METHOD = {"label": str, "method": str, "bits": int, "group_size": int, "symmetric": bool, "sparsity": str,
           "act_order": bool, "damp": float, "awq_grid": int, "awq_max_tokens": int, "true_sequential": bool}
_EXPORT = {"format": str, "type": str, "label": str}
_EVAL = {"metrics": list, "langs": list, "tasks": list, "corpora": list, "limit": int, "seqlen": int, "stride": int,
         "ppl_windows": int, "wikitext": bool, "fidelity_windows": int, "pp": int, "tg": int, "repeats": int,
         "context": int, "threads": int}


class StudyError(ConfigError):
    """A study file that cannot run as written."""


@dataclass
class MethodSpec:
    label: str
    method: str
    settings: dict = field(default_factory=dict)  # Recipe fields

    @property
    def is_base(self) -> bool:
        return self.method == "none"


@dataclass
class ExportSpec:
    label: str
    format: str  # none | gguf | onnx
    type: str = "auto"


@dataclass
class Study:
    name: str
    path: Path
    models: list[str]
    seeds: list[int]
    targets: list[str]
    calibration: dict
    evaluate: dict
    methods: list[MethodSpec]
    exports: list[ExportSpec]
    description: str = ""
    workdir: str = ""


class _Lines:
    """Line numbers of keys in a TOML text: (table path, key) -> line (1-based)."""

    def __init__(self, text: str):
        self.where: dict[tuple, int] = {}
        table: tuple = ()
        counts: dict[str, int] = {}
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            m = re.match(r"^\[\[\s*([\w.-]+)\s*\]\]", line)
            if m:
                name = m.group(1)
                table = (name, counts.get(name, 0))
                counts[name] = counts.get(name, 0) + 1
                self.where.setdefault(table, n)
                continue
            m = re.match(r"^\[\s*([\w.-]+)\s*\]", line)
            if m:
                table = (m.group(1),)
                self.where.setdefault(table, n)
                continue
            m = re.match(r"^([\w-]+)\s*=", line)
            if m:
                self.where.setdefault((*table, m.group(1)), n)

    def line(self, *path) -> int | None:
        while path:
            if path in self.where:
                return self.where[path]
            path = path[:-1]
        return None


def _fail(file: Path, lines: _Lines, path: tuple, msg: str):
    n = lines.line(*path)
    raise StudyError(f"{file}" + (f", line {n}" if n else "") + f": {msg}")


def _check_types(table: dict, types: dict, file, lines, path: tuple) -> None:
    for key, value in table.items():
        if key not in types:
            _fail(file, lines, (*path, key), f"unknown key '{key}' (known: {', '.join(types)})")
        want = types[key]
        ok = isinstance(value, want) and not (isinstance(value, bool) and want is not bool)
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            _fail(file, lines, (*path, key), f"'{key}' must be a {want.__name__}, got {value!r}")


def load_study(path) -> Study:
    """Parse and validate a study file; every error names the file and line."""
    from ..compress.methods import METHODS
    from ..compress.recipe import Recipe
    from ..evaluate.api import EvalSettings
    from ..export.api import FORMATS
    from ..targets.profiles import get_profile

    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
        data = tomllib.loads(text)
    except FileNotFoundError as exc:
        raise StudyError(f"no study file at {file}") from exc
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise StudyError(f"{file}: {exc}") from exc
    lines = _Lines(text)
    _check_types(data, _TOP, file, lines, ())
    for key in ("methods", "models"):
        if not data.get(key):
            _fail(file, lines, (key,), f"'{key}' is required and must not be empty")
    seeds = data.get("seeds", [0])
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds) or not seeds:
        _fail(file, lines, ("seeds",), f"'seeds' must be a list of integers, got {seeds!r}")
    calib = data.get("calibration", {})
    _check_types(calib, _CALIB, file, lines, ("calibration",))
    ev = data.get("evaluate", {})
    _check_types(ev, _EVAL, file, lines, ("evaluate",))
    targets = data.get("targets", ["cpu"])
    for t in targets:
        try:
            get_profile(t)
        except ConfigError as exc:
            _fail(file, lines, ("targets",), str(exc))

    methods, labels = [], set()
    for i, m in enumerate(data["methods"]):
        where = ("methods", i)
        if not isinstance(m, dict):
            _fail(file, lines, where, "each [[methods]] entry must be a table")
        _check_types(m, _METHOD, file, lines, where)
        name = m.get("method")
        if name is None:
            _fail(file, lines, where, "'method' is required in every [[methods]] entry")
        settings = {k: v for k, v in m.items() if k not in ("label", "method")}
        if name == "none":
            if settings:
                _fail(file, lines, (*where, next(iter(settings))), "method 'none' (the base model) takes no settings")
        elif name not in METHODS:
            _fail(file, lines, (*where, "method"), f"unknown method '{name}' (known: none, {', '.join(METHODS)})")
        else:
            kind = METHODS[name].kind
            rec = dict(settings)
            if kind == "prune" and "bits" not in rec:
                rec["bits"] = None
            rec.update({"calibration": calib.get("dataset", "c4"), "nsamples": calib.get("nsamples", 128),
                        "seqlen": calib.get("seqlen", 512), "batch_size": calib.get("batch_size", 8)})
            try:
                Recipe(method=name, **rec).validate()
            except (ConfigError, TypeError, ValueError) as exc:
                _fail(file, lines, where, f"[[methods]] {name}: {exc}")
            settings = rec
        label = m.get("label") or _auto_label(name, settings)
        if label in labels:
            _fail(file, lines, where, f"two methods share the label '{label}'; give one a label = \"...\"")
        labels.add(label)
        methods.append(MethodSpec(label, name, settings))

    exports = []
    for i, e in enumerate(data.get("exports", [{"format": "none"}])):
        where = ("exports", i)
        _check_types(e, _EXPORT, file, lines, where)
        fmt = e.get("format", "none")
        if fmt != "none" and fmt not in FORMATS:
            _fail(file, lines, (*where, "format"), f"unknown format '{fmt}' (none, {', '.join(FORMATS)})")
        qtype = e.get("type", "auto")
        if fmt == "gguf":
            from ..export.gguf import QTYPES

            if qtype != "auto" and qtype not in QTYPES:
                _fail(file, lines, (*where, "type"), f"unknown GGUF type '{qtype}' (auto, {', '.join(QTYPES)})")
        elif fmt == "onnx":
            from ..export.onnx import ONNX_TYPES

            if qtype != "auto" and qtype not in ONNX_TYPES:
                _fail(file, lines, (*where, "type"), f"unknown ONNX type '{qtype}' (auto, {', '.join(ONNX_TYPES)})")
        exports.append(ExportSpec(e.get("label") or (fmt if fmt == "none" else f"{fmt}-{qtype}"), fmt, qtype))

    for t in targets:
        prof = get_profile(t)
        if prof.transport in ("ssh", "emulated") and all(x.format == "none" for x in exports):
            _fail(file, lines, ("targets",), f"target '{t}' runs exported files only: add a [[exports]] with "
                  "format = \"gguf\" or \"onnx\"")
    try:
        settings = EvalSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in ev.items()})
        settings.validate()
    except (ConfigError, TypeError) as exc:
        _fail(file, lines, ("evaluate",), f"[evaluate]: {exc}")
    return Study(name=data.get("name") or file.stem, path=file, models=list(data["models"]), seeds=list(seeds),
                 targets=list(targets), calibration=calib, evaluate=ev, methods=methods, exports=exports,
                 description=data.get("description", ""), workdir=data.get("workdir", ""))


def _auto_label(method: str, s: dict) -> str:
    if method == "none":
        return "base"
    parts = [method]
    if s.get("bits"):
        parts.append(f"w{s['bits']}" + (f"g{s['group_size']}" if s.get("group_size", 128) > 0 else "")
                     + ("sym" if s.get("symmetric") else ""))
    if s.get("sparsity"):
        parts.append(f"s{s['sparsity']}")
    return "-".join(parts)

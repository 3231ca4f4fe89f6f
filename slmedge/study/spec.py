"""The study file: a grid of models x methods x seeds x exports x targets, and what to measure.

    name = "quick"
    models = ["smollm2-135m"]
    seeds = [0]
    targets = ["cpu"]

    [calibration]          # shared by every method that calibrates
    dataset = "c4"
    nsamples = 32
    seqlen = 512

    [evaluate]             # EvalSettings fields (less those the study sets: see EVAL_SET_BY_STUDY)
    metrics = ["perplexity", "fidelity", "tasks", "memory", "latency"]
    langs = ["en", "th"]
    tasks = ["arc_easy", "xcopa_th"]
    limit = 50
    [evaluate.arm64]       # what differs on one target: here, exactness on fewer items
    metrics = ["perplexity", "fidelity", "tasks"]
    limit = 20
    same_as = "cpu"        # or: cpu's exactness numbers, once a probe shows arm64 computes them alike
    probe_tokens = 128     #   (per-token log-probs of the file's first WikiText-2 tokens on both
    probe_tolerance = 0.01 #   targets, max |difference| in nats; past it the target measures itself)

    [[methods]]            # one entry per compression setting; "none" is the base model; the keys
    method = "none"        # are Recipe fields (block_size, awq_clip, skip, ...) less [calibration]'s
    [[methods]]
    label = "awq-w4g64"
    method = "awq"
    bits = 4
    group_size = 64
    [[methods]]
    method = "wanda"
    sparsity = "0.5"
    [[methods]]            # a sweep of size budgets: one row per bits-per-weight target, each a mix
    label = "gptq-mix"     # of llama.cpp's grids picked by measured sensitivity (gptq-mix-bpw4, ...)
    method = "gptq"
    bpw = [4.0, 4.5, 5.0]

    [[exports]]            # each compressed model is evaluated in each export
    format = "none"        # the artifact itself, in torch
    [[exports]]
    format = "gguf"
    type = "auto"
    [[exports]]            # each method's natural files (DEPLOYABLE below): GGUF and ONNX with
    format = "deployable"  # the codes kept for quantized rows; dense f16 / 8-bit for pruned ones
    [[exports]]            # llama.cpp's quantizer weighted by an importance matrix of the row's model
    format = "gguf"        # on [calibration]'s windows (on the base row: llama-imatrix's baseline)
    type = "iq4_xs"
    imatrix = true
    [[exports]]            # an ExecuTorch .pte program (XNNPACK): an artifact's codes kept, the base in
    format = "executorch"  # fp32 (type = "8da4w": torchao's own scheme); needs pip install 'slmedge[executorch]'

Validated strictly before any work starts: an unknown key, a wrong type or an impossible
combination is an error that names the file and the line.

The keys of [[methods]], [calibration] and [evaluate] and their types are not listed here: they
are derived from the fields of ``Recipe`` (slmedge/compress/recipe.py) and ``EvalSettings``
(slmedge/evaluate/api.py), so a setting added to either is settable here with nothing else to
change; the values are then checked by ``Recipe.validate`` and ``EvalSettings.validate``. A
[[methods]] ``skip`` is the whole list of patterns left alone, as in the Recipe (its default is
``["lm_head", "*embed_tokens*"]``); ``sparsity`` is a ratio (``0.5`` or ``"0.5"``) or ``"N:M"``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, SlmedgeError
from ..limits import check_plain_name

_TOP = {"name": str, "description": str, "models": list, "seeds": list, "targets": list, "calibration": dict,
        "evaluate": dict, "methods": list, "exports": list, "workdir": str}
_EXPORT = {"format": str, "type": str, "label": str, "imatrix": bool}

# Recipe fields the study sets for every method at once: [calibration] key -> Recipe field.
CALIBRATION_FIELDS = {"dataset": "calibration", "nsamples": "nsamples", "seqlen": "seqlen", "batch_size": "batch_size"}
# Recipe fields a [[methods]] entry cannot set, and why (every other field is a [[methods]] key).
METHOD_SET_BY_STUDY = {
    **{f: "set for every method in [calibration]" for f in CALIBRATION_FIELDS.values()},
    "seed": "the study's seeds = [...] (each method runs once per seed)",
}
# [evaluate.<target>] keys that are no EvalSettings field: a target whose exactness numbers are
# another target's once a probe proves they compute the same (study/carry.py).
SAME_AS_KEYS = {"same_as": str, "probe_tokens": int, "probe_tolerance": float}
SAME_AS_DEFAULTS = {"probe_tokens": 128, "probe_tolerance": 0.01}
# The metrics a probe can prove identical: what the file computes. Memory and speed are the device's own.
CARRIED_METRICS = ("perplexity", "fidelity", "tasks")

# EvalSettings fields [evaluate] cannot set, and why (every other field is an [evaluate] key).
EVAL_SET_BY_STUDY = {
    "target": "each of the study's targets = [...]",
    "runtime": "follows from each [[exports]] entry's format",
    "data_dir": "slmedge study --data-dir",
    "reference": "fidelity is measured against each artifact's own base model",
    "reference_runtime": "follows from that reference",
    "memory_child": "internal: the memory probe runs in a child process (only tests switch it off)",
}


class _Kind:
    """What a TOML value must be to fill a dataclass field of a given type."""

    def __init__(self, name: str, check):
        self.name, self.check = name, check


def _scalar(t: type) -> _Kind:
    if t is bool:
        return _Kind("bool", lambda v: isinstance(v, bool))
    if t is int:
        return _Kind("int", lambda v: isinstance(v, int) and not isinstance(v, bool))
    if t is float:  # an integer is a float here (damp = 0 reads as an int)
        return _Kind("float", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
    if t is str:
        return _Kind("str", lambda v: isinstance(v, str))
    from ..compress.sparsity import Sparsity

    if t is Sparsity:  # its own parser says what is wrong with the value itself
        return _Kind('ratio such as 0.5 or "N:M" text such as "2:4"',
                     lambda v: isinstance(v, (str, int, float)) and not isinstance(v, bool))
    raise TypeError(f"a study file has no type for a field of type {t!r}: teach slmedge/study/spec.py its kind")


def field_kind(hint) -> _Kind:
    """The TOML kind of a field annotated ``hint``: Optional[X] is X (TOML has no null), a
    ``tuple[X, ...]`` is a list of X."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return field_kind(rest[0])
    elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = field_kind(args[0])
        return _Kind(f"list of {item.name}", lambda v: isinstance(v, list) and all(item.check(x) for x in v))
    elif origin is None:
        return _scalar(hint)
    raise TypeError(f"a study file has no type for a field of type {hint!r}: teach slmedge/study/spec.py its kind")


def dataclass_kinds(cls, exclude=()) -> dict[str, _Kind]:
    """Field name -> TOML kind, for every field of the dataclass ``cls`` not in ``exclude``."""
    hints = typing.get_type_hints(cls)
    return {f.name: field_kind(hints[f.name]) for f in dataclasses.fields(cls) if f.name not in exclude}


@functools.cache
def table_kinds() -> dict[str, dict[str, _Kind]]:
    """The keys and kinds of [calibration], [[methods]] and [evaluate], from the dataclasses."""
    from ..compress.recipe import Recipe
    from ..evaluate.api import EvalSettings

    recipe = dataclass_kinds(Recipe)
    return {
        "calibration": {key: recipe[f] for key, f in CALIBRATION_FIELDS.items()},
        "methods": {"label": _scalar(str), **{k: v for k, v in recipe.items() if k not in METHOD_SET_BY_STUDY}},
        "evaluate": dataclass_kinds(EvalSettings, exclude=EVAL_SET_BY_STUDY),
    }


class StudyError(ConfigError):
    """A study file that cannot run as written."""


class StudyFileMissingError(StudyError):
    """There is no study file where one was named: a missing input (exit 1)."""

    exit_code = 1


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
    format: str  # none | deployable | a registered export format (gguf, onnx, ...)
    type: str = "auto"
    # GGUF: llama.cpp's quantizer weighted by an importance matrix slmedge computes on the study's
    # [calibration] windows for the row's own model (`slmedge imatrix`): for the base rows, what
    # `llama-imatrix` + `llama-quantize --imatrix` give a llama.cpp user for free.
    imatrix: bool = False


# format = "deployable": each method's natural files, by its family (study/levels.py). Quantized
# rows keep their codes where the format's grid fits them (auto), else the closest type, flagged
# "requantized" in the store; pruned rows get what runtimes can do with them today (dense f16,
# 8-bit): whether sparsity gains anything there is measured, not assumed; the base as shipped (f16).
DEPLOYABLE = {
    "base": (("gguf", "f16"), ("onnx", "fp16")),
    "quantize": (("gguf", "auto"), ("onnx", "auto")),
    "both": (("gguf", "auto"), ("onnx", "auto")),
    "prune": (("gguf", "f16"), ("gguf", "q8_0"), ("onnx", "fp16"), ("onnx", "int8")),
}


def deployable_exports(method: "MethodSpec") -> list[ExportSpec]:
    """The natural files of a method's rows (``format = "deployable"``)."""
    from .levels import family

    fam = family({"method_name": method.method, "bits": method.settings.get("bits"),
                  "grid": method.settings.get("grid"), "bpw": method.settings.get("bpw"),
                  "sparsity": method.settings.get("sparsity")})
    return [ExportSpec(f"{fmt}-{qtype}", fmt, qtype) for fmt, qtype in DEPLOYABLE[fam]]


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
    per_target: dict = field(default_factory=dict)  # target -> [evaluate.<target>]
    same_as: dict = field(default_factory=dict)  # target -> {"target", "probe_tokens", "probe_tolerance"}

    def evaluate_for(self, target: str) -> dict:
        """The [evaluate] settings on ``target``: [evaluate] with its [evaluate.<target>] over it."""
        return {**self.evaluate, **self.per_target.get(target, {})}


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


def _check_types(table: dict, kinds: dict, file, lines, path: tuple) -> None:
    """Every key of ``table`` known and of its kind; ``kinds`` maps a key to a Python type (the
    file's own tables) or to a _Kind (the tables derived from the dataclasses)."""
    for key, value in table.items():
        if key not in kinds:
            _fail(file, lines, (*path, key), f"unknown key '{key}' (known: {', '.join(kinds)})")
        want = kinds[key]
        kind = want if isinstance(want, _Kind) else _scalar(want) if want in (bool, int, float, str) else \
            _Kind(want.__name__, lambda v, t=want: isinstance(v, t))
        if not kind.check(value):
            _fail(file, lines, (*path, key), f"'{key}' must be a {kind.name}, got {value!r}")


def load_study(path) -> Study:
    """Parse and validate a study file; every error names the file and line."""
    from ..compress.methods import METHODS
    from ..compress.recipe import UNIFORM_SETTINGS, Recipe
    from ..evaluate.api import EvalSettings
    from ..export.api import FORMATS, get_format
    from ..targets.profiles import get_profile
    from ..targets.registry import transport_class

    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
        data = tomllib.loads(text)
    except FileNotFoundError as exc:  # a missing input (exit 1), not a bad setting
        raise StudyFileMissingError(f"no study file at {file}") from exc
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise StudyError(f"{file}: {exc}") from exc
    lines = _Lines(text)
    _check_types(data, _TOP, file, lines, ())
    for key in ("methods", "models"):
        if not data.get(key):
            _fail(file, lines, (key,), f"'{key}' is required and must not be empty")
    _check_models(data["models"], file, lines)
    seeds = data.get("seeds", [0])
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds) or not seeds:
        _fail(file, lines, ("seeds",), f"'seeds' must be a list of integers, got {seeds!r}")
    for s in seeds:
        _limit(file, lines, ("seeds",), "seed", s, "a seed")
    study_name = data.get("name") or file.stem
    try:  # the default workdir is <cache>/studies/<name>: a name is never a path
        check_plain_name(study_name, "the study's name" if "name" in data else f"the study's name (its file's, {file.name})")
    except ConfigError as exc:
        _fail(file, lines, ("name",), str(exc) + ("" if "name" in data else '; give it a name = "..."'))
    kinds = table_kinds()
    calib = data.get("calibration", {})
    _check_types(calib, kinds["calibration"], file, lines, ("calibration",))
    ev = data.get("evaluate", {})
    targets = data.get("targets", ["cpu"])
    for t in targets:
        try:
            get_profile(t)
        except ConfigError as exc:
            _fail(file, lines, ("targets",), str(exc))
    # [evaluate.<target>]: what differs on one target (e.g. the exactness metrics alone on an
    # emulated one, on fewer items); the rest of [evaluate] holds there too.
    per_target = {k: v for k, v in ev.items() if isinstance(v, dict)}
    ev = {k: v for k, v in ev.items() if k not in per_target}
    _check_types(ev, kinds["evaluate"], file, lines, ("evaluate",))
    same_as: dict = {}
    for t, table in per_target.items():  # a known target the study does not list now is allowed (unused)
        try:
            get_profile(t)
        except ConfigError as exc:
            _fail(file, lines, (f"evaluate.{t}",), f"[evaluate.{t}] names no target: {exc}")
        carry = {k: table[k] for k in SAME_AS_KEYS if k in table}
        table = per_target[t] = {k: v for k, v in table.items() if k not in SAME_AS_KEYS}
        _check_types(carry, SAME_AS_KEYS, file, lines, (f"evaluate.{t}",))
        _check_types(table, kinds["evaluate"], file, lines, (f"evaluate.{t}",))
        if carry:
            same_as[t] = _same_as(t, carry, ev, per_target, targets, file, lines)
    for t, carry in same_as.items():
        if carry["target"] in same_as:
            _fail(file, lines, (f"evaluate.{t}", "same_as"), f"{t} takes {carry['target']}'s numbers, which are "
                  f"themselves {same_as[carry['target']]['target']}'s: name {same_as[carry['target']]['target']}")

    methods, labels = [], set()
    for i, m, swept in _swept(data["methods"], file, lines):
        where = ("methods", i)
        _check_types(m, kinds["methods"], file, lines, where)
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
            defaults = {f.name: f.default for f in dataclasses.fields(Recipe)}
            rec.update({f: calib.get(key, defaults[f]) for key, f in CALIBRATION_FIELDS.items()})
            try:
                recipe = Recipe(method=name, **rec).validate(given=settings)
            except (ConfigError, TypeError, ValueError) as exc:
                _fail(file, lines, where, f"[[methods]] {name}: {exc}")
            # On a grid the uniform grid's settings shape nothing (one given equal to the grid's is
            # harmless): left out, so that the job, its label and its record are the grid's alone.
            settings = {k: v for k, v in rec.items() if not (recipe.on_grid and k in UNIFORM_SETTINGS)}
        if "label" in m:
            _plain(file, lines, (*where, "label"), m["label"], "the label")
        label = m.get("label") or _auto_label(name, settings)
        if swept and "label" in m:
            label = f"{label}-bpw{m['bpw']:g}"
        if label in labels:
            _fail(file, lines, where, f"two methods share the label '{label}'; give one a label = \"...\"")
        labels.add(label)
        methods.append(MethodSpec(label, name, settings))

    exports = []
    for i, e in enumerate(data.get("exports", [{"format": "none"}])):
        where = ("exports", i)
        _check_types(e, _EXPORT, file, lines, where)
        if "label" in e:
            _plain(file, lines, (*where, "label"), e["label"], "the label")
        fmt = e.get("format", "none")
        if fmt not in ("none", "deployable") and fmt not in FORMATS:
            _fail(file, lines, (*where, "format"), f"unknown format '{fmt}' (none, deployable, {', '.join(FORMATS)})")
        qtype = e.get("type", "auto")
        if fmt == "deployable":
            if "type" in e:
                _fail(file, lines, (*where, "type"), "format = \"deployable\" picks each method's types itself: "
                      "give no type (or list the exports one by one)")
            exports.append(ExportSpec(e.get("label") or "deployable", fmt))
            continue
        if fmt != "none":
            known = get_format(fmt)
            if qtype != "auto" and qtype not in known.types:
                _fail(file, lines, (*where, "type"),
                      f"unknown {known.label} type '{qtype}' (auto, {', '.join(known.types)})")
        imatrix = bool(e.get("imatrix", False))
        if imatrix and (fmt != "gguf" or qtype in ("auto", "f16", "f32")):
            _fail(file, lines, (*where, "imatrix"), "imatrix = true weights llama.cpp's quantizer: it needs format = "
                  "\"gguf\" and a type llama.cpp quantizes (q4_k_m, iq4_xs, q4_0, ...), not auto, f16 or f32")
        label = e.get("label") or (fmt if fmt == "none" else f"{fmt}-{qtype}" + ("-imatrix" if imatrix else ""))
        exports.append(ExportSpec(label, fmt, qtype, imatrix))

    for t in targets:
        prof = get_profile(t)
        if not transport_class(prof.transport).in_process and all(x.format == "none" for x in exports):
            _fail(file, lines, ("targets",), f"target '{t}' runs exported files only: add a [[exports]] with "
                  "format = \"gguf\" or \"onnx\"")
        for i, x in enumerate(exports):  # each export's runtime, where the target can run it
            for runtime in _format_runtimes(x.format):
                why = transport_class(prof.transport).runtime_refusal(prof, runtime)
                if why:
                    _fail(file, lines, ("exports", i, "format"), f"format = \"{x.format}\": {why}")
    for i, x in enumerate(exports):  # what a format cannot write of a row, as the row's recipe tells
        known = get_format(x.format) if x.format not in ("none", "deployable") else None
        if known is None or known.row_problem is None:
            continue
        for m in methods:
            why = known.row_problem(None if m.is_base else Recipe(method=m.method, **m.settings), x.type)
            if why:
                _fail(file, lines, ("exports", i, "format"), f"[[methods]] {m.label} as format = \"{x.format}\": {why}")
    required = set()
    for i, x in enumerate(exports):  # what this machine lacks last (an extra a format needs), once per format
        known = get_format(x.format) if x.format not in ("none", "deployable") else None
        if known is not None and known.require is not None and x.format not in required:
            required.add(x.format)
            try:
                known.require()
            except SlmedgeError as exc:
                _fail(file, lines, ("exports", i, "format"), f"format = \"{x.format}\": {exc}")
    for t in targets:
        table = f"evaluate.{t}" if t in per_target else "evaluate"
        try:
            settings = EvalSettings(**{k: tuple(v) if isinstance(v, list) else v
                                       for k, v in {**ev, **per_target.get(t, {})}.items()})
            settings.validate()
        except (ConfigError, TypeError) as exc:
            _fail(file, lines, (table,), f"[{table}]: {exc}")
    _check_bounds(data["models"], methods, exports, targets, ev, per_target, file, lines)
    return Study(name=study_name, path=file, models=list(data["models"]), seeds=list(seeds),
                 targets=list(targets), calibration=calib, evaluate=ev, methods=methods, exports=exports,
                 description=data.get("description", ""), workdir=data.get("workdir", ""), per_target=per_target,
                 same_as={t: v for t, v in same_as.items() if t in targets})


def _format_runtimes(fmt: str) -> list[str]:
    """The runtimes that evaluate the exports ``format = fmt`` makes (none for the artifact in torch, or
    a format no file runtime runs)."""
    from ..runtimes.registry import RUNTIMES

    formats = {f for rows in DEPLOYABLE.values() for f, _ in rows} if fmt == "deployable" else {fmt}
    return [n for n, s in RUNTIMES.items() if s.export_format in formats]


def _same_as(t: str, carry: dict, ev: dict, per_target: dict, targets: list, file: Path, lines: "_Lines") -> dict:
    """[evaluate.<t>]'s same_as, probe_tokens and probe_tolerance, checked."""
    where = (f"evaluate.{t}",)
    other = carry.get("same_as")
    if other is None:
        key = next(iter(carry))
        _fail(file, lines, (*where, key), f"'{key}' goes with same_as = \"<target>\" (whose numbers {t} takes)")
    if other == t:
        _fail(file, lines, (*where, "same_as"), f"[evaluate.{t}] same_as names {t} itself")
    if other not in targets:
        _fail(file, lines, (*where, "same_as"), f"same_as = \"{other}\": the study's targets are "
              f"{', '.join(targets)}; the target whose numbers {t} takes must be one of them")
    from ..evaluate.api import BUILTIN_METRICS

    def metrics_of(target: str) -> list:
        found = {**ev, **per_target.get(target, {})}.get("metrics")
        return list(BUILTIN_METRICS if found is None else found)

    mine, theirs = metrics_of(t), metrics_of(other)
    own = [m for m in mine if m not in CARRIED_METRICS]
    if own:
        _fail(file, lines, (*where, "metrics"), f"with same_as, [evaluate.{t}] takes only {other}'s "
              f"{', '.join(CARRIED_METRICS)} (what a probe can prove the same); {', '.join(own)} is the device's own: "
              "measure it without same_as")
    missing = [m for m in mine if m not in theirs]
    if missing:
        _fail(file, lines, (*where, "metrics"), f"[evaluate.{t}] takes {', '.join(missing)} from {other}, "
              f"which does not measure it (add it to [evaluate] or [evaluate.{other}])")
    out = {"target": other, **SAME_AS_DEFAULTS, **{k: v for k, v in carry.items() if k != "same_as"}}
    for key in ("probe_tokens", "probe_tolerance"):
        _limit(file, lines, (*where, key), key, out[key], key)
    return out


def _limit(file: Path, lines: _Lines, path: tuple, key: str, value, name: str) -> None:
    """``value`` in the range slmedge/limits.py declares for ``key``, or an error naming the line."""
    from ..limits import check

    try:
        check(key, value, name)
    except ConfigError as exc:
        _fail(file, lines, path, str(exc))


def _plain(file: Path, lines: _Lines, path: tuple, value, what: str) -> None:
    try:
        check_plain_name(value, what)
    except ConfigError as exc:
        _fail(file, lines, path, str(exc))


def _check_bounds(models, methods, exports, targets, ev: dict, per_target: dict, file: Path, lines: _Lines) -> None:
    """What each model bounds the study's settings by, before anything runs (``slmedge.limits``): its
    positions (the calibration windows; each target's perplexity window, context and latency run),
    and the memory each compression's calibration and each target's evaluation allocate."""
    from ..compress.api import check_compress_bounds
    from ..compress.recipe import Recipe
    from ..evaluate.api import EvalSettings
    from ..evaluate.bounds import check_evaluation_bounds
    from ..export.formats import get_format
    from ..runtimes.registry import RUNTIMES
    from ..targets.profiles import get_profile

    # the runtimes the evaluations run in: the source's (None: as the target decides) and each export's
    formats = {f for e in exports for f in ([fmt for fmt, _ in DEPLOYABLE["quantize"] + DEPLOYABLE["prune"]]
                                              if e.format == "deployable" else [e.format]) if f != "none"}
    runtimes = [None] + sorted({next((n for n, s in RUNTIMES.items() if s.export_format == f), None)
                                for f in formats if get_format(f)} - {None})

    for model in models:
        for m in methods:
            if m.is_base:
                continue
            try:
                check_compress_bounds(model, Recipe(method=m.method, **m.settings), option="seqlen")
            except ConfigError as exc:
                _fail(file, lines, ("calibration",), f"model {model}, [[methods]] {m.label}: {exc}")
        for t in targets:
            table = f"evaluate.{t}" if t in per_target else "evaluate"
            settings = EvalSettings(**{k: tuple(v) if isinstance(v, list) else v
                                       for k, v in {**ev, **per_target.get(t, {})}.items()}, target=t)
            profile = get_profile(t, detect=False)
            for runtime in runtimes:
                if runtime is not None and runtime not in profile.runtimes:
                    continue
                try:
                    check_evaluation_bounds(model, dataclasses.replace(settings, runtime=runtime), profile)
                except ConfigError as exc:
                    _fail(file, lines, (table,), f"[{table}] on model {model}: {exc}")


def _check_models(models: list, file: Path, lines: _Lines) -> None:
    """Every model names a source that exists (as ``slmedge.models.source.resolve`` sees it): one
    that does not is refused before anything runs, naming the file, the line and the model, with
    the resolver's own error class (a missing model exits 1, not 2)."""
    from ..errors import SlmedgeError
    from ..models.source import resolve

    for m in models:
        if not isinstance(m, str) or not m:
            _fail(file, lines, ("models",), f"'models' must be a list of model sources (text), got {m!r}")
        try:
            src = resolve(m)
            if src.kind == "artifact":  # its manifest's seal now (its files are checked when a job opens it)
                from ..models.artifact_format import check_manifest_seal, open_manifest_bytes

                check_manifest_seal(src.path, open_manifest_bytes(src.path, verify=False)[0])
        except SlmedgeError as exc:
            n = lines.line("models")
            msg = f"{file}" + (f", line {n}" if n else "") + f": {exc}"
            try:
                err = type(exc)(msg)
            except TypeError:  # an error class that takes other arguments: same exit code
                err = SlmedgeError(msg)
                err.exit_code = exc.exit_code
            raise err from exc


def _swept(entries: list, file: Path, lines: _Lines):
    """The [[methods]] entries with a budget sweep (``bpw = [4.0, 4.5, 5.0]``) expanded: one entry per
    budget, in the order given, each labelled ``<label>-bpw<B>`` (or its own automatic label)."""
    for i, m in enumerate(entries):
        where = ("methods", i)
        if not isinstance(m, dict):
            _fail(file, lines, where, "each [[methods]] entry must be a table")
        budgets = m.get("bpw")
        if not isinstance(budgets, list):
            yield i, m, False
            continue
        if not budgets or not all(_scalar(float).check(b) for b in budgets):
            _fail(file, lines, (*where, "bpw"), f"'bpw' must be a number or a non-empty list of numbers (a sweep of "
                  f"bits-per-weight budgets), got {budgets!r}")
        if len(set(budgets)) != len(budgets):
            _fail(file, lines, (*where, "bpw"), f"'bpw' lists a budget twice: {budgets!r}")
        for b in budgets:
            yield i, {**m, "bpw": float(b)}, True


def _auto_label(method: str, s: dict) -> str:
    if method == "none":
        return "base"
    from ..compress.recipe import Recipe
    from ..compress.sparsity import Sparsity

    parts = [method]
    if s.get("grid"):
        parts.append(s["grid"] + ("-imp" if s.get("importance") else ""))
    elif s.get("bpw"):
        parts.append(f"bpw{s['bpw']:g}" + "".join(f"-{g}" for g in s.get("bpw_grids") or ()))
    elif s.get("bits"):
        group = s.get("group_size", Recipe.group_size)
        parts.append(f"w{s['bits']}" + (f"g{group}" if group > 0 else "") + ("sym" if s.get("symmetric") else ""))
    if s.get("sparsity"):
        parts.append(f"s{Sparsity.parse(s['sparsity']).describe()}")
    return "-".join(parts)

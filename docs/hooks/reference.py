"""MkDocs hook: the reference pages, generated from slmedge itself each time the site is built, so
that they cannot drift from the code.

- ``reference/cli.md``: every command of the typer app (``slmedge.cli.tree``): usage, help,
  arguments, options (as ``--help`` shows them, defaults and environment variables included) and
  the examples from its help.
- ``reference/api.md``: the plug-in registries (compression methods, export formats, runtimes,
  transports, metrics) with what is registered in them now, the decorator that fills each one,
  the fields an entry holds and the methods a plug-in implements (from the docstrings and the
  field comments in the source), and the architecture table.

Neither page exists in ``docs/``: MkDocs is handed them as generated files (``on_files``).
"""

from __future__ import annotations

import ast
import dataclasses
import html
import inspect
import re
import textwrap

from mkdocs.structure.files import File

CLI_PAGE = "reference/cli.md"
API_PAGE = "reference/api.md"


def on_files(files, config):
    files.append(File.generated(config, CLI_PAGE, content=cli_page()))
    files.append(File.generated(config, API_PAGE, content=api_page()))
    return files


# --- text helpers -------------------------------------------------------------------------------


def _md_text(text: str) -> str:
    """Help text as Markdown: paragraphs kept, HTML-escaped outside `code spans`."""
    return "\n\n".join(_escape(" ".join(line.strip() for line in para.splitlines()))
                       for para in re.split(r"\n\s*\n", text.strip()))


def _escape(text: str) -> str:
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") and p.endswith("`") and len(p) > 1 else html.escape(p, quote=False)
                   for p in parts)


def _cell(text: str) -> str:
    return _escape(" ".join(str(text).split())).replace("|", "\\|")


def _code_cell(text: str) -> str:
    return "`" + " ".join(str(text).split()).replace("|", "\\|") + "`" if text else ""


def _anchor(path: str) -> str:
    return "slmedge-" + path.replace(" ", "-") if path else "slmedge"


# --- the command line ---------------------------------------------------------------------------

EXIT_CODES = """\
| code | meaning |
|---|---|
| 0 | done |
| 1 | a bad or missing input (a model, file or folder that is not there, unreadable, corrupt, or refused such as pickled weights), an output location that cannot be used (not writable, a folder where a file is needed, an input of the same command, something `--overwrite` may not replace, an output another slmedge process is writing right now), or a failure while working |
| 2 | a bad setting: an unknown name (method, format, type, runtime, target, metric, task, language), a value out of range, an impossible combination, a malformed profile or study file; the command line's own usage errors |
| 130 | interrupted (Ctrl-C): one line, `interrupted`; outputs in progress are removed |
| 128+N | stopped by SIGTERM (143) or SIGHUP (129): one line, `terminated (SIGTERM)`, and the clean-up of an interrupt (the evaluation being recorded marked failed, temporary files and locks removed); `evaluate`, `export` and `run` ended by another signal N (137 for SIGKILL, 139 for a segmentation fault in a runtime's native code): one `error:` line naming what was running and on which file; nothing half-written is left and no worker outlives the command ([Safety](../concepts/safety.md)) |
"""


def cli_page() -> str:
    from slmedge import __version__
    from slmedge.cli.tree import commands

    tree = commands()
    root = tree[""]
    parts = [
        "# Command reference",
        "",
        f"Generated from the command line of slmedge {__version__} when this site was built "
        "(`docs/hooks/reference.py` walks the typer app), so it lists exactly the commands and options "
        "the code has. The same text is in `slmedge COMMAND --help`.",
        "",
        "Every command checks all its options, its inputs' existence and its output locations before it "
        "starts work; a refusal is one `error:` line naming the option or path, and nothing is written, "
        "deleted or recorded. `slmedge --debug COMMAND ...` shows tracebacks instead of one-line errors, "
        "and lets the libraries slmedge uses print their own notices and warnings.",
        "",
        "## Exit codes",
        "",
        EXIT_CODES,
        "## Commands",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for path, cmd in tree.items():
        if path:
            parts.append(f"| [`slmedge {path}`](#{_anchor(path)}) | {_cell(cmd.short_help)} |")
    parts.append("")
    parts += _command_section(root, "")
    for path, cmd in tree.items():
        if path:
            parts += _command_section(cmd, path)
    return "\n".join(parts) + "\n"


def _command_section(cmd, path: str) -> list[str]:
    level = "##" if " " not in path else "###"
    title = f"slmedge {path}".strip()
    out = [f"{level} {title} {{#{_anchor(path)}}}", "", _md_text(cmd.description), "",
           "```text", f"Usage: {cmd.usage}", "```", ""]
    args = [p for p in cmd.params if p.kind == "argument"]
    opts = [p for p in cmd.params if p.kind == "option"]
    if args:
        out += ["| argument | |", "|---|---|"]
        out += [f"| {_code_cell(p.shown or p.names[0])} | {_cell(p.help)}{' (required)' if p.required else ''} |"
                for p in args]
        out.append("")
    if opts:
        out += ["| option | |", "|---|---|"]
        out += [f"| {_code_cell(p.shown)} | {_cell(p.help)}{' (required)' if p.required else ''} |" for p in opts]
        out.append("")
    if cmd.passes_options_on:
        out += ["Every other option is handed to lm-evaluation-harness as it is (see `lm_eval --help`).", ""]
    if cmd.group and path:
        subs = [f"`slmedge {p}`" for p in _children(path)]
        out += [f"Commands: {', '.join(subs)}.", ""]
    if cmd.examples:
        out += ["Examples:", "", "```bash", *cmd.examples, "```", ""]
    return out


def _children(path: str) -> list[str]:
    from slmedge.cli.tree import commands

    return [p for p in commands() if p.startswith(path + " ") and p.count(" ") == path.count(" ") + 1]


# --- the plug-in API ----------------------------------------------------------------------------


def _doc(obj) -> str:
    return inspect.cleandoc(obj.__doc__ or "")


def _first_paragraph(obj) -> str:
    return re.split(r"\n\s*\n", _doc(obj))[0].replace("\n", " ") if _doc(obj) else ""


def _where(obj) -> str:
    mod = getattr(obj, "__module__", "")
    return f"`{mod}.{obj.__qualname__}`"


def _field_comments(cls) -> dict[str, str]:
    """The comment on (or just above) each field of a dataclass, from its source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    tree = ast.parse(source)
    out: dict[str, str] = {}
    body = tree.body[0].body
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            line = lines[node.lineno - 1]
            comment = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            above, j = [], node.lineno - 2
            while j >= 0 and lines[j].strip().startswith("#"):
                above.insert(0, lines[j].strip().lstrip("#").strip())
                j -= 1
            out[node.target.id] = " ".join(x for x in (" ".join(above), comment) if x)
    return out


def _fields_table(cls) -> list[str]:
    comments = _field_comments(cls)
    rows = ["| field | type | default | what it says |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default) if not callable(f.default) else getattr(f.default, "__name__", "")
        elif f.default_factory is not dataclasses.MISSING:
            default = f"{getattr(f.default_factory, '__name__', 'factory')}()"
        else:
            default = "(required)"
        rows.append(f"| `{f.name}` | {_code_cell(str(f.type))} | {_code_cell(default)} | {_cell(comments.get(f.name, ''))} |")
    return rows + [""]


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _members(cls, names: list[str] | None = None) -> list[str]:
    """The public methods and properties ``cls`` itself defines: signature and docstring."""
    out = []
    for name, member in cls.__dict__.items():
        if names is not None and name not in names:
            continue
        if name.startswith("_") and name not in ("_prefill", "_step"):
            continue
        fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
        if not callable(fn):
            continue
        kind = "property " if isinstance(member, property) else ""
        doc = _doc(fn)
        out += [f"- {kind}`{name}{'' if kind else _signature(fn)}`" + (f": {_escape(doc.splitlines()[0])}" if doc else "")]
        rest = " ".join(doc.splitlines()[1:]).strip()
        if rest:
            out.append(f"    {_escape(rest)}")
    return out + [""]


def api_page() -> str:
    import slmedge.export  # noqa: F401 - registers the formats
    import slmedge.runtimes  # noqa: F401 - registers the runtimes
    import slmedge.targets  # noqa: F401 - registers the transports
    from slmedge.compress.methods import METHODS, register_method
    from slmedge.compress.methods.base import Method
    from slmedge.evaluate.api import METRICS, EvalSettings, Evaluation, register_metric
    from slmedge.export.formats import FORMATS, ExportFormat, register_format
    from slmedge.models.architectures import ARCHITECTURES
    from slmedge.runtimes.base import Runtime
    from slmedge.runtimes.registry import RUNTIMES, RuntimeSpec, register_runtime
    from slmedge.targets.registry import TRANSPORTS, register_transport
    from slmedge.targets.transports import Transport

    p = [
        "# Plug-in API",
        "",
        "Generated from slmedge's registries and docstrings when this site was built "
        "(`docs/hooks/reference.py`): the tables list what is registered in this version. How to write "
        "a plug-in, with examples, is in [Extending slmedge](../guides/extending.md).",
        "",
        "Each kind of plug-in has one registry, filled by a decorator at the definition site; a second "
        "entry under a name already taken is refused (`ValueError`), and nothing outside the registry "
        "compares names. Import the module that defines your plug-in before calling slmedge (or from "
        "your own entry point) so that its decorator runs.",
        "",
    ]
    # Compression methods
    p += ["## Compression methods", "",
          f"`@register_method(name)` on a subclass of {_where(Method)}; the registry is "
          f"`slmedge.compress.methods.METHODS`. {_escape(_first_paragraph(register_method))}", "",
          "| name | kind | what it does | class |", "|---|---|---|---|"]
    p += [f"| `{m.name}` | {m.kind} | {_cell(m.summary)} | {_where(m.cls)} |" for m in METHODS.values()]
    p += ["", f"{_escape(_doc(Method))}", "", "What a method defines:", ""]
    p += _members(Method, ["resolve", "compress", "compress_shared", "compress_block", "needs_calibration"])
    p += ["Class attributes: `kind` (`\"quantize\"` or `\"prune\"`), `stats_class` (the statistics of a "
          "linear's inputs it needs, e.g. `HessianStats`, `InputNormStats`; None for data-free methods), "
          "`summary` (one line for `slmedge methods`), `true_sequential`, `block_level`.", ""]
    # Export formats
    p += ["## Export formats", "",
          f"`@register_format(name, **facts)` on a writer function; the registry is "
          f"`slmedge.export.formats.FORMATS`. {_escape(_first_paragraph(register_format))}", "",
          "| name | label | output | types besides `auto` | writer |", "|---|---|---|---|---|"]
    for f in FORMATS.values():
        output = f"one `{f.suffix}` file" if f.single_file else "a folder"
        p.append(f"| `{f.name}` | {f.label} | {output} | {_cell(', '.join(f.types))} | {_where(f.write)} |")
    p += ["", _md_text(_doc(inspect.getmodule(ExportFormat))), "", "The facts a format registers "
          f"({_where(ExportFormat)}):", ""]
    p += _fields_table(ExportFormat)
    # Runtimes
    p += ["## Runtimes", "",
          f"`@register_runtime(name, **facts)` on a subclass of {_where(Runtime)}; the registry is "
          f"`slmedge.runtimes.registry.RUNTIMES`. {_escape(_first_paragraph(register_runtime))}", "",
          "| name | runs | export format it is given | package | KV bytes per value |", "|---|---|---|---|---|"]
    for r in RUNTIMES.values():
        runs = ", ".join(f"`{s}`" for s in r.suffixes) or ("export folders" if r.recognizes else "model sources")
        p.append(f"| `{r.name}` | {runs} | {r.export_format or '-'} | {r.package or '-'} | {r.kv_bytes_per_value} |")
    p += ["", "The facts a runtime registers:", ""]
    p += _fields_table(RuntimeSpec)
    p += ["What a runtime implements (the metrics call only these):", ""]
    p += _members(Runtime)
    # Transports
    p += ["## Transports", "",
          f"`@register_transport(name)` on a subclass of {_where(Transport)}; the registry is "
          f"`slmedge.targets.registry.TRANSPORTS`, and a target profile names its transport "
          f"(`transport = \"ssh\"`). {_escape(_first_paragraph(register_transport))}", "",
          "| name | class | runtimes in this process | timings emulated | what it is |", "|---|---|---|---|---|"]
    for name, cls in TRANSPORTS.items():
        p.append(f"| `{name}` | {_where(cls)} | {'yes' if cls.in_process else 'no (a runner)'} | "
                 f"{'yes' if cls.emulated else 'no'} | {_cell(_first_paragraph(cls))} |")
    p += ["", _escape(_doc(Transport)), "", "What a transport defines:", ""]
    p += _members(Transport, ["check_profile", "detect", "is_set_up", "setup", "open_runtime", "runner_argv",
                              "runner_env", "put", "checks", "versions"])
    p += ["Class attributes: `emulated` (its timings are not the device's), `in_process` (runtimes, torch "
          "too, run in this process), `torch_device`.", ""]
    # Metrics
    p += ["## Metrics", "",
          f"`@register_metric(name)` on a function of the evaluation; the registry is "
          f"`slmedge.evaluate.api.METRICS`. {_escape(_doc(register_metric))}", "",
          "| name | in registration order (the order they run) |", "|---|---|"]
    p += [f"| `{name}` | {_cell(_first_paragraph(fn)) or _where(fn)} |" for name, fn in METRICS.items()]
    p += ["", f"A metric receives the {_where(Evaluation)}: {_escape(_first_paragraph(Evaluation))} "
          "It reads `ev.settings` (below), `ev.sub` (the model: `runtime`, `encoder`, `label`, `spec`) and "
          "`ev.profile` (the target), writes its numbers to `ev.results[\"metrics\"][name]` and one store row "
          "per number with `ev._row(metric, value, subset, stderr, unit)`.", "",
          "The settings an evaluation carries (`slmedge.evaluate.api.EvalSettings`):", ""]
    p += _fields_table(EvalSettings)
    # Architectures
    p += ["## Architectures", "",
          "Architecture knowledge is data (`slmedge/models/architectures.py`): one default for the Llama "
          "family and small overrides. The methods and exporters read the entry of a model's `model_type`.", "",
          "| `model_type` | known as | GGUF (llama.cpp architecture) | q/k rows permuted for llama.cpp | "
          "AWQ mappings | linears per block |", "|---|---|---|---|---|---|"]
    for key, arch in ARCHITECTURES.items():
        gguf = arch.gguf.arch.lower() if arch.gguf else "not written"
        permute = "yes" if arch.gguf and arch.gguf.permute else "no"
        p.append(f"| `{key}` | {_cell(', '.join(arch.examples))} | {gguf} | {permute} | {len(arch.awq)} | "
                 f"{len(arch.linear_names)} |")
    p.append("")
    return "\n".join(p) + "\n"

"""``--help`` as a newcomer meets it: at once (the command line imports none of the heavy libraries
before a command runs), readable in an 80-column terminal without a word split at a hyphen, with
arguments named as click names them, and listing every method, format and runtime slmedge has."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slmedge.cli import app
from slmedge.cli.tree import commands

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "onnx", "onnxruntime", "onnxruntime_genai", "llama_cpp", "safetensors",
         "compressed_tensors")

# Every command's --help in one fresh interpreter, as `slmedge ... --help` runs it (main()), one after
# the other; after each, the heavy libraries loaded so far.
HELP_ALL = textwrap.dedent('''
    import json, sys
    from slmedge.cli import main
    loaded = {}
    for path in json.loads(sys.argv[1]):
        sys.argv = ["slmedge", *path, "--help"]
        try:
            main()
        except SystemExit:
            pass
        loaded[" ".join(path)] = [m for m in HEAVY if m in sys.modules]
    print("\\n" + json.dumps(loaded))
''')


def _paths() -> list[list[str]]:
    return [path.split() for path in commands()]


def _help_imports(paths: list[list[str]], setup: str = "") -> dict:
    code = f"HEAVY = {HEAVY!r}\n{setup}\n" + HELP_ALL
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code, json.dumps(paths)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_no_help_imports_torch_or_a_runtime():
    """slmedge --help and every command's --help (lm-eval's is lm-evaluation-harness's own) load none
    of torch, transformers, onnx, onnxruntime, llama.cpp: they are imported when a command runs."""
    loaded = _help_imports(_paths())
    assert set(loaded) == {" ".join(p) for p in _paths()} and len(loaded) > 15
    assert not any(loaded.values()), {path: mods for path, mods in loaded.items() if mods}


def test_the_import_check_sees_a_heavy_import():
    """The same check, with a command module importing torch at its top, reports it."""
    loaded = _help_imports([["methods"]], setup="import slmedge.cli.methods, torch")
    assert "torch" in loaded["methods"]


# --- 80 columns -------------------------------------------------------------------------------------


def _help(path: str, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    res = CliRunner().invoke(app, [*path.split(), "--help"])
    assert res.exit_code == 0, res.output
    return res.output


def _problems(text: str) -> list[str]:
    """Lines over 80 columns, and words split at a hyphen (a line ending in letter + "-")."""
    return [f"{len(line)} columns: {line}" for line in text.splitlines() if len(line) > 80] + \
        [f"split at a hyphen: {line}" for line in text.splitlines() if re.search(r"\w-$", line)]


def test_every_help_fits_80_columns_with_words_whole(monkeypatch):
    """Every command's --help at COLUMNS=80: no line past 80 columns (examples included), no word
    broken at a hyphen (`compressed-` / `tensors`: a copied option would not run), and the usage line
    names arguments as click does (PATH, [MODEL]), not `{path}`."""
    problems = []
    for path, cmd in commands().items():
        if cmd.passes_options_on:  # lm-eval: its --help is lm-evaluation-harness's own
            continue
        text = _help(path, monkeypatch)
        problems += [f"slmedge {path} --help: {p}" for p in _problems(text)]
        usage = text.splitlines()[0]
        if "{" in usage or re.search(r"\[[a-z_]+\]", usage):
            problems.append(f"slmedge {path} --help: usage {usage!r}")
    assert not problems, "\n".join(problems)
    assert _help("inspect", monkeypatch).splitlines()[0] == "Usage: slmedge inspect [OPTIONS] PATH"


def test_clicks_own_wrapping_would_split_at_the_hyphen(monkeypatch):
    """Without slmedge's formatter click wraps `onnxruntime-genai` across two lines at 80 columns
    (where the line ends inside it); with it, the word stays whole (and the check above sees the
    difference)."""
    import typer

    from slmedge.cli.helptext import plain_help

    monkeypatch.setenv("COLUMNS", "80")

    def text(words: int, whole: bool) -> str:
        demo = typer.Typer(add_completion=False, rich_markup_mode=None)

        @demo.command()
        def one(fmt: str = typer.Option("gguf", "--format", help="a " * words + "onnxruntime-genai or gguf.")):
            """A demo."""

        @demo.command()
        def two():
            """Another."""

        group = typer.main.get_command(demo)
        if whole:
            plain_help(group)
        ctx = group.make_context("demo", ["one"], resilient_parsing=True)
        sub = group.get_command(ctx, "one")
        return sub.get_help(sub.make_context("one", [], parent=ctx))

    split = [n for n in range(40) if any("split at a hyphen" in p for p in _problems(text(n, False)))]
    assert split, "click no longer wraps at hyphens: this test (and cli/helptext.py) can go"
    for n in split:
        assert _problems(text(n, True)) == [] and "onnxruntime-genai" in text(n, True)


# --- the lists in the help and the registries ---------------------------------------------------------


def _builtin(registry, module_of) -> list[str]:
    """The names a registry holds from slmedge's own modules (not a plug-in a test registered)."""
    return [name for name, entry in registry.items() if module_of(entry).startswith("slmedge.")]


def test_the_help_lists_every_method_format_and_runtime():
    """The help texts name what the registries hold (they are written out, since reading the
    registries would import torch): compress --method every method, export --format and the
    export and inspect descriptions every format, evaluate --runtime every runtime."""
    import slmedge.export  # noqa: F401 - registers the formats
    import slmedge.runtimes  # noqa: F401 - registers the runtimes
    from slmedge.compress.methods import METHODS
    from slmedge.export.formats import FORMATS
    from slmedge.runtimes.registry import RUNTIMES

    tree = commands()

    def names(text: str) -> set[str]:
        return set(re.findall(r"[\w.]+(?:-[\w.]+)*", text))

    methods = _builtin(METHODS, lambda m: m.cls.__module__)
    formats = _builtin(FORMATS, lambda f: f.write.__module__)
    runtimes = _builtin(RUNTIMES, lambda r: r.cls.__module__)
    assert len(methods) >= 6 and len(formats) >= 4 and len(runtimes) >= 4
    missing = {
        "compress --method": set(methods) - names(tree["compress"].options["--method"].help),
        "export --format": set(formats) - names(tree["export"].options["--format"].help),
        "export": {FORMATS[f].label for f in formats} - names(tree["export"].description),
        "inspect": {FORMATS[f].label for f in formats} - names(tree["inspect"].description),
        "evaluate --runtime": set(runtimes) - names(tree["evaluate"].options["--runtime"].help),
    }
    assert not any(missing.values()), {where: m for where, m in missing.items() if m}

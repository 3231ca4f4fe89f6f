"""The documentation: the site builds with --strict (a broken link, page or anchor fails it),
every `slmedge ...` line shown in README.md and docs/ names a real command with real options,
the Python examples of the extending guide run, and the Results page is what its one command makes
from the store kept in the repository."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import missing_prerequisite

from slmedge.cli.tree import check_command_line, check_markdown, command_lines, commands

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.parts)]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "NO_MKDOCS_2_WARNING": "1"}


def _mkdocs() -> None:
    import importlib.util

    for module, package in (("mkdocs", "mkdocs"), ("material", "mkdocs-material")):
        if importlib.util.find_spec(module) is None:
            missing_prerequisite(f"{package} is not installed (pip install -e '.[docs]'; scripts/setup.sh installs it)")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, env=_env(), cwd=config.parent, timeout=600)


# --- the site ----------------------------------------------------------------------------------------


def test_the_site_builds_with_strict_and_has_every_page(tmp_path):
    _mkdocs()
    site = tmp_path / "site"
    res = _build(REPO / "mkdocs.yml", site)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for page in ("index.html", "getting-started/index.html", "guides/targets/index.html", "results/index.html",
                 "benchmarks/index.html", "development/notebook/index.html", "reference/cli/index.html",
                 "reference/api/index.html"):
        assert (site / page).is_file(), page
    cli = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    for path, cmd in commands().items():  # generated from the app: every command and option is there
        if path:
            assert f'id="slmedge-{path.replace(" ", "-")}"' in cli, path
        for param in cmd.params:
            assert param.names[0] in cli, (path, param.names)
    api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("gptq", "sparsegpt", "gguf", "onnxruntime-genai", "compressed-tensors", "llama.cpp", "ssh",
                 "emulated", "perplexity", "latency", "gemma3_text"):
        assert f"<code>{name}</code>" in api, name
    results = (site / "results" / "index.html").read_text(encoding="utf-8")
    assert results.count("<img") >= 3 and "Caveats" in results
    details = results[results.index("<details"):]  # the full tables a click away, rendered as tables
    assert "<table>" in details[:details.index("</details>")]


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    _mkdocs()
    copy = tmp_path / "repo"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    page = copy / "docs" / "guides" / "compress.md"
    page.write_text(page.read_text(encoding="utf-8") + "\nSee [the missing page](nothing-here.md) and "
                    "[a missing anchor](export.md#no-such-heading).\n", encoding="utf-8")
    res = _build(copy / "mkdocs.yml", tmp_path / "site")
    assert res.returncode != 0
    assert "nothing-here.md" in res.stderr and "no-such-heading" in res.stderr, res.stderr[-2000:]


# --- every command line shown ------------------------------------------------------------------------


def test_every_slmedge_command_line_shown_exists_with_its_options():
    tree = commands()
    problems, found = [], 0
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        found += len(command_lines(text))
        problems += [f"{page.relative_to(REPO)}:{p.line}: {p.command}\n    {p.why}" for p in check_markdown(text, tree)]
    for path, cmd in tree.items():  # the examples in each command's --help (the command reference shows them)
        block = "```bash\n" + "\n".join(cmd.examples) + "\n```"
        problems += [f"`slmedge {path} --help`: {p.command}\n    {p.why}" for p in check_markdown(block, tree)]
    assert not problems, "command lines that would not run as written:\n" + "\n".join(problems)
    assert found >= 60, f"only {found} slmedge command lines found in README.md and docs/: is the reader broken?"


@pytest.mark.parametrize("line,why", [
    ("slmedge compress smollm2-135m --methd gptq", "'--methd' is not an option of 'slmedge compress'"),
    ("slmedge compres smollm2-135m", "'compres' is not a command of slmedge"),
    ("slmedge targets lst", "'lst' is not a command of 'slmedge targets'"),
    ("slmedge export out/gptq --format gguf --group-size 64", "'--group-size' is not an option of 'slmedge export'"),
    ("slmedge compress --bits four", "--bits"),  # parsed by click: not an integer
    ("slmedge methods extra-word", "unexpected extra argument"),
    ("slmedge --verbose compress", "'--verbose' is not an option of slmedge itself"),
])
def test_a_made_up_command_line_fails_the_check(line, why):
    got = check_command_line(line)
    assert got is not None and why in got, got


def test_a_renamed_option_fails_the_check_where_the_docs_show_it():
    """The same reader the docs go through: an option that no longer exists, in a shell block, in an
    inline span, after a prompt and continued on the next line, is reported with its line."""
    text = ("Intro `slmedge evaluate m.gguf --metric perplexity`.\n\n"
            "```bash\nslmedge compress smollm2-135m --method rtn \\\n    --group 32   # a comment\n```\n\n"
            "```console\n$ slmedge targets list --wide --tall\nname  transport\n```\n\n"
            "```text\nslmedge compress: this is output, not a command --anything\n```\n")
    problems = check_markdown(text)
    assert [(p.line, p.why) for p in problems] == [
        (1, "'--metric' is not an option of 'slmedge evaluate'"),
        (4, "'--group' is not an option of 'slmedge compress'"),
        (9, "'--tall' is not an option of 'slmedge targets list'"),
    ], problems
    good = text.replace("--metric ", "--metrics ").replace("--group ", "--group-size ").replace(" --tall", "")
    assert check_markdown(good) == []


def test_readme_links_point_at_files_that_exist():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local and not [link for link in local if not (REPO / link).exists()]
    assert len(text.splitlines()) <= 150


# --- examples that run ------------------------------------------------------------------------------


def test_the_extending_guides_python_examples_run(tiny_models, tmp_path):
    """Each Python block of docs/guides/extending.md as the file it names, with the tiny model in
    place of smollm2-135m: the plug-ins register and work from the command line and from Python."""
    model = str(tiny_models("llama"))
    text = (DOCS / "guides" / "extending.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    names = []
    for block in blocks:
        name = re.match(r"# ([\w.]+\.py)", block).group(1)
        (tmp_path / name).write_text(block.replace('"smollm2-135m"', repr(model)), encoding="utf-8")
        names.append(name)
    assert names == ["my_slmedge.py", "my_method.py", "evaluate.py"]
    env = {**_env(), "SLMEDGE_RESULTS_DB": str(tmp_path / "r.sqlite")}

    def run(*args):
        res = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=tmp_path, env=env,
                             timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        return res.stdout

    # The command line shown under the first block, on the tiny model and a short window.
    run("my_slmedge.py", "evaluate", model, "--runtime", "my-llama", "--metrics", "perplexity,token_count",
        "--langs", "en", "--no-wikitext", "--seqlen", "32", "--ppl-windows", "1", "--json", "out.json")
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["runtime"] == "my-llama" and got["metrics"]["token_count"]["tokens"] > 0
    run("my_method.py")
    manifest = json.loads((tmp_path / "out" / "rtn-clip90" / "slmedge.json").read_text())
    assert manifest["recipe"]["method"] == "rtn-clip90"
    assert float(run("evaluate.py").strip().splitlines()[-1]) > 1


# --- the results page ------------------------------------------------------------------------------


def test_the_results_page_is_what_its_command_makes_from_the_store(tmp_path):
    """`python scripts/docs_results.py` on the store kept in the repository gives the committed page
    (text; the plots are the report's own, tested with the report), and its picture for the README."""
    out = tmp_path / "results.md"
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "docs_results.py"), "--out", str(out),
                          "--meta", str(DOCS / "results" / "store.json")],
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    made = out.read_text(encoding="utf-8")
    committed = (DOCS / "results.md").read_text(encoding="utf-8")
    assert made == committed, "docs/results.md is not what scripts/docs_results.py makes: run it and commit"
    plots = json.loads((tmp_path / "results" / "plots.json").read_text())["files"]
    assert "front.png" in plots and set(plots) == set(json.loads((DOCS / "results" / "plots.json").read_text())["files"])
    for name in plots:
        assert (DOCS / "results" / name).is_file(), name
    # It replaces only what it wrote: a foreign file where a plot goes stops it.
    (tmp_path / "results" / PLOTS_FOREIGN).write_text("mine")
    index = tmp_path / "results" / "plots.json"
    index.write_text(json.dumps({"files": [n for n in plots if n != PLOTS_FOREIGN]}))
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "docs_results.py"), "--out", str(out),
                          "--meta", str(DOCS / "results" / "store.json")],
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert res.returncode != 0 and "not written by this script" in res.stderr
    assert (tmp_path / "results" / PLOTS_FOREIGN).read_text() == "mine"


PLOTS_FOREIGN = "front.png"


def test_a_model_measured_again_shows_only_its_new_studys_rows():
    """store.json's model_studies: that model's rows come from the named study alone (the grid measured
    again), other models' from wherever they are; a named study with no rows of its model stops the
    script rather than showing the old rows."""
    dr = _docs_results()

    def row(model, study, method):
        return {"labels": {"model": model, "method": method}, "study": study}

    rows = [row("a", "grid", "base"), row("b", "grid", "base"), row("b", "grid", "awq"), row("b", "again", "base"),
            row("b", "again", "awq")]
    kept = dr.from_studies(rows, {"b": "again"})
    assert [(r["labels"]["model"], r["study"]) for r in kept] == [("a", "grid"), ("b", "again"), ("b", "again")]
    assert dr.from_studies(rows, {}) == rows
    # the earlier rows kept, in a section of their own right after the model's new one
    kept = dr.from_studies([*rows[1:], rows[0]], {"b": "again"}, ["b"])
    assert [(r["labels"]["model"], r["study"]) for r in kept] == [
        ("b", "again"), ("b", "again"), ("b@grid", "grid"), ("b@grid", "grid"), ("a", "grid")]
    with pytest.raises(SystemExit, match="model_studies names study 'later' for b"):
        dr.from_studies(rows, {"b": "later"})


def test_the_command_lines_shown_that_read_nothing_of_yours_run(monkeypatch):
    """The lines that need no model or file of the reader's (listing methods, targets, data, a
    profile) are run as shown: exit 0."""
    from typer.testing import CliRunner

    from slmedge.cli import app

    runnable = {"methods", "targets list", "targets show", "data", "data verify", "data path"}
    tree = commands()
    ran = set()
    for page in _pages():
        for line, command in command_lines(page.read_text(encoding="utf-8")):
            words = command.split()[1:]
            path = next((" ".join(words[:n]) for n in (2, 1) if " ".join(words[:n]) in tree), "")
            if path not in runnable or "--model" in words or "--data-dir" in words or "--remeasure" in words:
                continue
            res = CliRunner().invoke(app, words)
            assert res.exit_code == 0, (f"{page.relative_to(REPO)}:{line}", command, res.output[-1000:])
            ran.add(path)
    assert {"methods", "targets list", "data"} <= ran, ran


# --- the results page as a reader sees it ------------------------------------------------------------


def _docs_results():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_results", REPO / "scripts" / "docs_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _front_rows(dr, model="smollm2-135m"):
    from slmedge.evaluate.store import ResultsStore
    from slmedge.study import report

    meta = json.loads((DOCS / "results" / "store.json").read_text(encoding="utf-8"))
    store = ResultsStore(DOCS / "results" / "store.sqlite", readonly=True)
    try:
        rows = [r for r in report.load_rows(store, meta.get("study")) if r["labels"].get("model") == model]
        dr.attach_files(store, rows, meta)
    finally:
        store.close()
    return rows


def test_the_front_picture_puts_each_row_at_its_gguf_files_size_with_labels_apart():
    """x is the GGUF file a row exports to: a pruned model's is the base's f16 file, a W4 row's its
    4-bit file; no two labels overlap; the 75%-pruned rows are drawn at the top with their value, not
    stretching the axis; the title names the model and the target."""
    dr = _docs_results()
    rows = _front_rows(dr)
    by = {dr.short_name(r): r for r in rows}
    base = by["base"]["gguf"]
    assert base["type"] == "f16" and base["bytes"] > 200e6
    for name in ("Wanda 50%", "SparseGPT 2:4", "Wanda 75%"):
        assert by[name]["gguf"] == base, name
    assert by["AWQ W4 g64"]["gguf"]["type"] == "q4_1" and by["AWQ W4 g64"]["gguf"]["kept"]
    assert by["AWQ W4 g64"]["gguf"]["bytes"] < base["bytes"] / 2.5
    fig = dr.front_figure(rows, "SmolLM2-135M on cpu")
    ax = fig.axes[0]
    labels = {t.get_text().rsplit(": ", 1)[0]: t for t in ax.texts if hasattr(t, "xy")}  # annotations: one per row
    assert sorted(labels) == sorted(by) and not dr.label_overlaps(fig), dr.label_overlaps(fig)
    top = ax.get_ylim()[1]
    on_scale = max(dr._ppl(r) for r in rows if "75%" not in dr.short_name(r))
    assert top < 3 * on_scale < min(dr._ppl(by[n]) for n in ("Wanda 75%", "SparseGPT 75%"))
    for name in ("Wanda 75%", "SparseGPT 75%"):  # drawn at the top edge, their value written
        assert labels[name].xy[1] > top / 1.2 and dr._num(dr._ppl(by[name])) in labels[name].get_text()
    assert labels["base"].xy == (base["bytes"] / 1e6, dr._ppl(by["base"]))
    assert any("off scale" in t.get_text() for t in ax.texts)


def test_off_scale_is_the_top_of_a_wide_jump_and_labels_spread_apart():
    dr = _docs_results()
    assert dr.off_scale([15.8, 19.8, 46.1, 145, 2635, 8149]) == 145
    assert dr.off_scale([15.8, 19.8, 46.1, 145]) is None
    assert dr._spread([100, 101, 102], 10, 0, 1000) == [100, 110, 120]
    assert dr._spread([995, 996], 10, 0, 1000) == [985, 995]


def _md_tables(text: str) -> list[tuple[bool, list[list[str]]]]:
    """(inside a <details> block, rows of cells) of each Markdown table of a page."""
    out, rows, inside = [], [], False
    for line in [*text.splitlines(), ""]:
        inside = inside or line.startswith("<details")
        if line.startswith("|"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
            continue
        if rows:
            out.append((inside, [r for r in rows if not set("".join(r)) <= set(":-")]))
            rows = []
        inside = inside and not line.startswith("</details>")
    return out


def test_the_results_page_reads_as_a_report():
    """Picture first, findings in sentences, tables that fit the content column at 1280 px (at most
    nine columns, short row labels without the model or target, no column of nothing but '–'), the
    full tables a click away in a details block, and the Gemma caveat stated once at its table."""
    text = (DOCS / "results.md").read_text(encoding="utf-8")
    body = text.split("\n## ", 1)
    assert body[0].index("![") < len(body[0]) and "|" not in body[0], "the first screen is the picture, not tables"
    assert "-> holds" not in text and "kl_mean" not in text
    tables = _md_tables(text)
    shown = [rows for inside, rows in tables if not inside]
    assert len(shown) >= 4 and any(inside for inside, _ in tables)
    for inside, rows in tables:
        head, *data = rows
        for i, col in enumerate(head):
            assert any(r[i] not in ("–", "") for r in data if len(r) > i), f"column '{col}' holds nothing"
        for r in data:
            assert "smollm2" not in r[0].lower() and "gemma" not in r[0].lower() and " · cpu" not in r[0], r[0]
        if not inside:
            assert len(head) <= 9 and max(len(r[0]) for r in data) <= 24, head
    assert text.count("without the BOS") + text.count("without BOS") >= 1
    # each section's caveat (store.json's model_notes) stated once, at its section
    meta = json.loads((DOCS / "results" / "store.json").read_text(encoding="utf-8"))
    names = meta.get("model_names") or {}
    shown = [k for k in meta.get("model_notes") or {} if f"\n## {names.get(k, k)}\n" in text]
    assert shown and text.count("> **Caveat.**") == len(shown), shown


# --- example output -----------------------------------------------------------------------------------


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readmes_example_output_is_what_its_commands_print():
    """The README's output of the three core commands is an excerpt of the full outputs on Getting
    started (one run, shown once), and what the commands as shown print: the calibration row is the
    compress command's settings (its defaults where it gives none), the paths are its -o values, the
    corpora are its languages."""
    readme = _section((REPO / "README.md").read_text(encoding="utf-8"), "The three core commands")
    guide = _section((DOCS / "getting-started.md").read_text(encoding="utf-8"), "The three core commands")
    shown = re.findall(r"^(slmedge [^\n#]+?)\s*$", re.search(r"```bash\n(.*?)```", readme, re.S).group(1), re.M)
    excerpt = [ln for ln in re.search(r"```text\n(.*?)```", readme, re.S).group(1).splitlines() if ln.strip()]
    full = {cmd: out.splitlines() for cmd, out in re.findall(r"```bash\n(slmedge [^\n]+)\n```\s*```text\n(.*?)```",
                                                             guide, re.S)}
    assert len(shown) == 3 and set(shown) <= set(full), (shown, list(full))
    every = {ln for out in full.values() for ln in out}
    assert excerpt and [ln for ln in excerpt if ln not in every] == [], "README output lines not in Getting started"
    tree = commands()

    def params(cmd):
        words = cmd.split()[1:]
        return tree[words[0]].click_command.make_context(words[0], words[1:]).params

    compress, export, evaluate = (next(c for c in shown if c.startswith(f"slmedge {w} ")) for w in
                                  ("compress", "export", "evaluate"))
    p = params(compress)
    calib = f"{p['calibration']}: {p['nsamples']} x {p['seqlen']} tokens, seed {p['seed']}"
    for out in (excerpt, full[compress]):
        row = next(ln for ln in out if "│ calibration " in ln)
        assert calib in row, (row, calib)
    assert any(f"│ {p['output']} " in ln for ln in full[compress] if "│ artifact " in ln)
    assert any(f"│ {params(export)['output']} " in ln for ln in full[export] if "│ output " in ln)
    e = params(evaluate)
    corpora = [ln.split("│")[1].strip() for ln in full[evaluate]  # the perplexity table: corpus, ppl, bits/byte, tokens
               if ln.startswith("│") and len(ln.split("│")) == 6 and "±" in ln.split("│")[2]]
    assert corpora == ([] if e["no_wikitext"] else ["wikitext2"]) + e["langs"].split(","), corpora

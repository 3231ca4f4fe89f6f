"""No absolute local path in anything slmedge writes for others (issue 59, item 4).

Everything runs under an absolute temporary HOME whose name is distinctive, with every path on the
command line absolute (as a user's shell completion writes them): the artifact, its GGUF, ONNX,
onnxruntime-genai and compressed-tensors exports, an importance matrix and the GGUF weighted by it, and
a study's HTML and Markdown reports are then read byte by byte for that HOME, the temporary folder
above it and the distinctive name. What later commands need is still found: the artifact's base model
(the default fidelity reference) from the artifact and from its export, after the whole work folder
moved.
"""

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import require_import, tiny_study_file

from slmedge.cli import app
from tiny import calib_text, save_tiny

runner = CliRunner()
MARK = "home-Qz7private"  # a path component nothing else would write


def cli(*args):
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res


def leaks(root: Path, *needles: str) -> list[str]:
    """'file: needle' for every file under ``root`` (or ``root`` itself) holding one of ``needles``."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return [f"{p}: {n}" for p in files for n in needles if n.encode() in p.read_bytes()]


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / MARK
    (home / "work").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home / "work")
    return home


def test_nothing_written_for_others_names_the_users_home(home, tmp_path):
    require_import("llama_cpp")
    require_import("onnxruntime")
    genai = require_import("onnxruntime_genai", "onnxruntime-genai is not installed (pip install 'slmedge[genai]')")
    assert genai
    work = home / "work"
    model = save_tiny("llama", work / "models" / "tiny")
    (work / "data").mkdir()
    calib = calib_text(work / "data" / "calib.txt")
    out = work / "out"
    art = out / "art"
    cli("compress", model, "--method", "gptq", "--bits", 4, "--group-size", 32, "--calibration", calib,
        "--nsamples", 6, "--seqlen", 32, "--batch-size", 4, "-o", art)
    imx = out / "tiny.imatrix.gguf"
    cli("imatrix", model, "-o", imx, "--calibration", calib, "--nsamples", 6, "--seqlen", 32, "--batch-size", 4)
    cli("export", model, "--format", "gguf", "--type", "q4_0", "--imatrix", imx, "-o", out / "weighted.gguf")
    cli("export", art, "--format", "gguf", "-o", out / "art.gguf")
    cli("export", art, "--format", "onnx", "--type", "int4", "-o", out / "onnx")
    cli("export", art, "--format", "onnxruntime-genai", "--type", "int4", "-o", out / "genai", "--no-verify")
    cli("export", art, "--format", "compressed-tensors", "-o", out / "ct")

    # a study of the model at its absolute path, reported as HTML and Markdown
    study = tiny_study_file(work, model, "paths", ['method = "rtn"\nbits = 4\ngroup_size = 32'],
                            exports=('"gguf"',))
    db = work / "results.sqlite"
    cli("study", study, "--results-db", db)
    cli("report", db, "--study", "paths", "-o", out / "report.html")
    cli("report", db, "--study", "paths", "--format", "md", "-o", out / "report.md")

    # evaluate's --json copy: the model, its default reference (the artifact's base) and a corpus, all absolute
    cli("evaluate", out / "art.gguf", "--metrics", "perplexity,fidelity", "--corpus", calib, "--no-wikitext",
        "--langs", "", "--seqlen", 32, "--ppl-windows", 1, "--json", out / "results.json", "--results-db", db)
    assert '"art.gguf"' in (out / "results.json").read_text()  # the model is still named (relative to the file)

    found = leaks(out, str(home), str(tmp_path), MARK, str(home.resolve()))
    assert not found, "\n".join(found)
    assert (out / "report_files").is_dir() or (out / "report.md").is_file()

    # What reads these records still finds the base model: beside the artifact, and after the work moved
    from slmedge.evaluate.subject import _artifact_base, open_subject

    assert Path(_artifact_base(art)).resolve() == model.resolve()
    moved = tmp_path / "elsewhere" / "work"
    shutil.copytree(work, moved)
    shutil.rmtree(work)
    assert Path(_artifact_base(moved / "out" / "art")).resolve() == (moved / "models" / "tiny").resolve()
    sub = open_subject(str(moved / "out" / "art.gguf"))
    try:
        assert Path(sub.base_spec).resolve() == (moved / "models" / "tiny").resolve()
    finally:
        sub.close()


def test_a_path_is_recorded_relative_or_by_name(tmp_path, monkeypatch):
    from slmedge.paths import given_path, recorded_path, relative_path, resolve_recorded, shareable_source

    home = tmp_path / "h" / "alice"
    monkeypatch.setenv("HOME", str(home))
    assert relative_path(home / "models" / "m", home / "out" / "art") == "../../models/m"
    assert relative_path("/opt/models/m", home / "out") is None  # only "/" in common: the path would be spelled out
    assert relative_path(home / "m", tmp_path / "out") is None  # down into the home from above it: its name spelled
    assert relative_path(tmp_path / "m", home / "out") == "../../../m"  # up out of the home: no name in it
    assert recorded_path("/opt/models/m", home) == "m"
    assert given_path("data/c.txt") == "data/c.txt" and given_path(str(home / "c.txt")) == "c.txt"
    assert given_path("../c.txt") == "c.txt" and given_path("~/c.txt") == "c.txt"
    ident = shareable_source({"kind": "hf_dir", "path": str(home / "models" / "m"), "weights_sha256": "ab"},
                             home / "out" / "art")
    assert ident == {"kind": "hf_dir", "name": "m", "path": "../../models/m", "weights_sha256": "ab"}
    (home / "models" / "m").mkdir(parents=True)
    (home / "out" / "art").mkdir(parents=True)  # the folder holding the record (where the manifest is)
    assert resolve_recorded(ident["path"], home / "out" / "art") == home / "out" / "art" / "../../models/m"
    assert resolve_recorded(str(home / "models" / "m"), tmp_path) == home / "models" / "m"  # earlier versions'
    assert resolve_recorded("../nowhere", home) is None
    # an artifact compressed again: its source artifact's base, recorded relative to that artifact, re-anchored
    again = shareable_source({"kind": "artifact", "path": str(home / "out" / "art"), "base_model": ident},
                             home / "out" / "more" / "art2")
    assert again["path"] == "../../art" and again["base_model"]["path"] == "../../../models/m"


def test_a_model_evaluated_in_llamacpp_keeps_its_default_reference(tmp_path, monkeypatch, session_cache):
    """The cached export of a model under HOME, in a cache outside it, names its source by name alone (a
    relative path would spell the home's name); the evaluation still knows the model it exported."""
    require_import("llama_cpp")
    from slmedge.evaluate.subject import open_subject

    home = tmp_path / MARK
    monkeypatch.setenv("HOME", str(home))
    model = save_tiny("llama", home / "models" / "tiny")
    sub = open_subject(str(model), runtime="llama.cpp")
    try:
        assert Path(sub.base_spec) == model
    finally:
        sub.close()


def test_a_results_record_names_local_paths_relative_or_by_name(tmp_path):
    """evaluate --json's record: a path of its own, one inside a note (before a full stop), a path that is
    not on this machine left as text, a URL untouched."""
    from slmedge.paths import shareable_record

    out = tmp_path / "out"
    (out / "m").mkdir(parents=True)
    corpus = tmp_path / "data" / "c.txt"
    corpus.parent.mkdir()
    corpus.write_text("x")
    rec = {"spec": str(out / "m"), "identity": {"path": str(out / "m"), "sha256": "ab"},
           "notes": [f"reference {out / 'm'} (torch); corpus {corpus}.", "see https://x.org/a/b", "/no/such/place"],
           "n": 3}
    got = shareable_record(rec, out, [str(out / "m")])
    assert got == {"spec": "m", "identity": {"path": "m", "sha256": "ab"},
                   "notes": ["reference m (torch); corpus ../data/c.txt.", "see https://x.org/a/b", "/no/such/place"],
                   "n": 3}

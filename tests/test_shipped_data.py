"""The data slmedge ships: indexed with sha256, licence and source, inside the wheel and the sdist,
checked on every read, and a user's folder laid over it."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import one_line_error
from slmedge.cli import app
from slmedge.data import files as data_files_module
from slmedge.data.files import SHIPPED, data_files, index, shipped_files
from slmedge.errors import DataError
from slmedge.evaluate.corpora import load_corpus, ntrex_languages
from slmedge.evaluate.tasks import load_task, task_names

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_every_shipped_file_is_indexed_with_its_sha256_licence_and_source():
    files = shipped_files()
    on_disk = {p.relative_to(SHIPPED).as_posix() for p in SHIPPED.rglob("*") if p.is_file()}
    assert on_disk - set(files) == {"README.md", "datasets.json"}, "a shipped file without an index entry"
    assert set(files) <= on_disk
    for rel, rec in files.items():
        data = (SHIPPED / rel).read_bytes()
        assert _sha(data) == rec["sha256"] and len(data) == rec["bytes"] < 5_000_000, rel
        assert rec["items"] > 0, rel
    for name, s in index().items():
        assert s["licence"] and s["what"] and s["source"]["repository"] and s["source"]["commit"], name
    # What the defaults need: C4 and the multilingual calibration text, WikiText-2, NTREX-128 in 14
    # languages, the eight English tasks and XCOPA.
    assert {"calibration/c4_en.jsonl", "perplexity/wikitext2/test.txt", "tasks/xcopa/th.jsonl"} <= set(files)
    assert len(ntrex_languages()) == 14 and len(data_files().names("calibration/multilingual", ".txt")) == 8
    assert all(load_task(t, limit=1) for t in task_names())
    assert 15e6 < sum(r["bytes"] for r in files.values()) < 25e6
    assert index()["ntrex128"]["licence"] == "CC BY-SA 4.0"


def test_no_product_file_test_or_help_names_the_source_folder():
    needle = ".." + "/shared"  # spelled in two parts so that this file does not match itself
    paths = [REPO / "README.md", REPO / "pyproject.toml"]
    for top in ("slmedge", "scripts", "tests"):
        paths += [p for p in (REPO / top).rglob("*") if p.is_file() and p.suffix in {".py", ".sh", ".md", ".toml", ".json"}]
    offenders = [str(p.relative_to(REPO)) for p in paths if needle in p.read_text(encoding="utf-8", errors="replace")]
    assert not offenders
    commands = [[], ["compress"], ["export"], ["evaluate"], ["run"], ["study"], ["report"], ["data"], ["data", "verify"],
                ["targets", "setup"], ["inspect"], ["methods"]]
    for cmd in commands:
        res = runner.invoke(app, [*cmd, "--help"])
        assert res.exit_code == 0 and needle not in res.output and "shared/data" not in res.output, cmd


def test_data_cli_lists_verifies_and_prints_the_folder():
    res = runner.invoke(app, ["data"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for name in ("c4", "multilingual", "wikitext2", "ntrex128", "arc_easy", "hellaswag", "xcopa"):
        assert name in res.output
    assert "CC BY-SA 4.0" in res.output and "MicrosoftTranslator/NTREX" in res.output and "27,958" in res.output
    res = runner.invoke(app, ["data", "verify"])
    assert res.exit_code == 0 and f"ok: {len(shipped_files())} data files" in res.output
    res = runner.invoke(app, ["data", "path"])
    assert res.exit_code == 0 and Path(res.output.strip()) == SHIPPED


@pytest.fixture
def shipped_copy(tmp_path, monkeypatch):
    """The shipped folder copied to tmp_path and put in its place, so a test may damage it."""
    copy = tmp_path / "shipped"
    shutil.copytree(SHIPPED, copy)
    monkeypatch.setattr(data_files_module, "SHIPPED", copy)
    monkeypatch.setattr(data_files_module, "INDEX", copy / "datasets.json")
    data_files_module.index.cache_clear()
    yield copy
    data_files_module.index.cache_clear()


def test_one_changed_byte_fails_verify_and_every_read(shipped_copy):
    f = shipped_copy / "perplexity" / "ntrex128" / "de.txt"
    assert len(load_corpus("de")) > 0  # intact: read (and hashed) once
    data = bytearray(f.read_bytes())
    data[1000] ^= 0x01
    f.write_bytes(bytes(data))
    res = runner.invoke(app, ["data", "verify"])
    one_line_error(res, "1 of 43", str(f), "damaged", "reinstall")
    with pytest.raises(DataError, match=r"de\.txt is damaged .*reinstall"):
        load_corpus("de")
    assert len(load_corpus("fr")) > 0  # the others still read
    f.unlink()
    res = runner.invoke(app, ["data", "verify"])
    one_line_error(res, str(f), "missing", "reinstall")
    with pytest.raises(DataError, match=r"de\.txt is missing"):
        load_corpus("de")


def test_an_overlay_with_one_corpus_uses_it_and_the_shipped_rest(tmp_path, tiny_models):
    from slmedge.evaluate.api import EvalSettings, evaluate

    overlay = tmp_path / "my-data"
    (overlay / "perplexity" / "ntrex128").mkdir(parents=True)
    mine = "Ein ganz eigener Satz, den nur dieser Ordner hat. " * 400
    (overlay / "perplexity" / "ntrex128" / "de.txt").write_text(mine, encoding="utf-8")
    files = data_files(overlay)
    assert files.find("perplexity/ntrex128/de.txt") == overlay.resolve() / "perplexity/ntrex128/de.txt"
    assert files.find("perplexity/ntrex128/fr.txt") == SHIPPED / "perplexity/ntrex128/fr.txt"
    assert load_corpus("de", overlay) == mine
    assert load_corpus("fr", overlay) == (SHIPPED / "perplexity/ntrex128/fr.txt").read_text(encoding="utf-8")
    assert load_corpus("wikitext2", overlay).startswith(load_corpus("wikitext2")[:100])
    assert ntrex_languages(overlay) == ntrex_languages()
    # The same through an evaluation: German is the overlay's text, Spanish the shipped one.
    res = evaluate(str(tiny_models("llama")), EvalSettings(metrics=("perplexity",), langs=("de", "es"), wikitext=False,
                                                           seqlen=32, ppl_windows=None, data_dir=str(overlay),
                                                           memory_child=False))
    from slmedge.models.source import load

    tok = load(str(tiny_models("llama"))).tokenizer
    n_mine = len(tok(mine, add_special_tokens=False)["input_ids"])
    assert res["metrics"]["perplexity"]["de"]["windows"] == n_mine // 32
    assert res["metrics"]["perplexity"]["es"]["windows"] > n_mine // 32
    res = runner.invoke(app, ["data", "--data-dir", str(overlay)], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "1 of 14" in res.output and "adds: nothing new" in res.output


def test_an_overlay_can_add_a_task_and_must_be_a_data_folder(tmp_path, monkeypatch):
    overlay = tmp_path / "d"
    (overlay / "tasks").mkdir(parents=True)
    (overlay / "tasks" / "mytask.jsonl").write_text(json.dumps({"query": "Q", "choices": ["a", "b"], "gold": 1}) + "\n")
    assert "mytask" in task_names(overlay) and load_task("mytask", overlay)[0].gold == 1
    monkeypatch.setenv("SLMEDGE_DATA_DIR", str(overlay))  # the environment variable does the same
    assert load_task("mytask")[0].gold == 1 and load_task("piqa", limit=1)
    monkeypatch.delenv("SLMEDGE_DATA_DIR")
    with pytest.raises(DataError, match="unknown task 'mytask'"):
        load_task("mytask")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds none of calibration/, perplexity/, tasks/"):
        data_files(tmp_path / "empty")
    res = runner.invoke(app, ["data", "--data-dir", str(tmp_path / "nope")])
    one_line_error(res, "nope", "does not exist")


def _source_tree(dest: Path) -> Path:
    """The files a build reads (pyproject, README, the package), without caches or build output."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dest / name)
    shutil.copytree(REPO / "slmedge", dest / "slmedge", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def _check_members(read, names, prefix: str):
    for rel, rec in shipped_files().items():
        member = f"{prefix}slmedge/data/shipped/{rel}"
        assert member in names, member
        assert _sha(read(member)) == rec["sha256"], member
    assert f"{prefix}slmedge/data/shipped/datasets.json" in names and f"{prefix}slmedge/data/shipped/README.md" in names


def test_wheel_and_sdist_carry_every_data_file_and_its_licence(tmp_path):
    src = _source_tree(tmp_path / "src")
    dist = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src),
                           "-w", str(dist)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = dist.glob("slmedge-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        _check_members(z.read, names, "")
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = z.read(meta).decode()
    assert "License-Expression: Apache-2.0 AND CC-BY-SA-4.0 AND CC-BY-SA-3.0" in metadata
    assert "License-File: slmedge/data/shipped/README.md" in metadata

    # Installed from the wheel (dependencies: the ones this environment has), the data is found
    # and verified where the wheel put it.
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("SLMEDGE_DATA_DIR", None)
    code = ("import slmedge.data.files as f, sys; from slmedge.cli import app; print(f.SHIPPED); "
            "sys.argv = ['slmedge', 'data', 'verify']; app()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == str(site / "slmedge" / "data" / "shipped")
    assert f"ok: {len(shipped_files())} data files" in proc.stdout
    # The target profiles travel with the package too (the repository's targets/ links to them).
    profiles = sorted(p.name for p in (REPO / "targets").glob("*.toml"))
    assert len(profiles) >= 6 and all(f"slmedge/targets/shipped/{n}" in names for n in profiles)
    code = "import sys; from slmedge.cli import app; sys.argv = ['slmedge', 'targets', 'list']; app()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, "COLUMNS": "200"},
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0 and "raspberry-pi-5" in proc.stdout and "snapdragon-8-gen-3" in proc.stdout, proc.stderr

    code = "from setuptools import build_meta; import sys; print(build_meta.build_sdist(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-c", code, str(dist)], capture_output=True, text=True, cwd=src, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sdist = dist / proc.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as t:
        names = set(t.getnames())
        _check_members(lambda m: t.extractfile(m).read(), names, "slmedge-0.1.0/")

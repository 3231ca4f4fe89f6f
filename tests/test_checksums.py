"""Everything slmedge reads back from its own outputs and caches is checked against what it recorded.

A flipped byte in an export's model file, an edited manifest (bits 4 -> 8), a changed file in the
cache: each is refused on read (outputs) or rebuilt (caches), and nothing is evaluated or recorded
from it.
"""

import json
import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import one_line_error

from slmedge.cli import app
from slmedge.errors import ArtifactError
from slmedge.export.formats import get_format
from slmedge.fsutil import SEAL_KEY, check_seal, manifest_digest, sealed, sha256_file
from slmedge.models.gguf_seal import FILE_KEY, check_gguf

runner = CliRunner()
EVAL = ["--metrics", "perplexity", "--langs", "", "--no-wikitext", "--seqlen", "32", "--ppl-windows", "1"]


def flip(path: Path, at: int | None = None) -> None:
    """Flip one bit of one byte (by default, one three quarters of the way in)."""
    data = bytearray(path.read_bytes())
    i = len(data) * 3 // 4 if at is None else at
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def runs_recorded(db: Path) -> int:
    if not db.exists() or db.stat().st_size == 0:
        return 0
    with sqlite3.connect(db) as con:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        return con.execute("SELECT COUNT(*) FROM runs").fetchone()[0] if "runs" in tables else 0


@pytest.fixture
def corpus(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text(" ".join(["The quick brown fox jumps over the lazy dog."] * 40), encoding="utf-8")
    return f


# --- the seal -------------------------------------------------------------------------------------


def test_a_seal_covers_every_value_and_survives_a_round_trip():
    m = sealed({"format": "x", "layers": {"a": {"bits": 4}}, "path": Path("/x"), "f": 0.1})
    again = json.loads(json.dumps(m, default=str))
    check_seal(again, "m")  # as written and read back: the same digest
    assert m[SEAL_KEY] == manifest_digest(again)
    again["layers"]["a"]["bits"] = 8
    with pytest.raises(Exception, match="was changed after slmedge wrote it"):
        check_seal(again, "m")
    del again[SEAL_KEY]
    check_seal(again, "m")  # unsealed (written before seals): nothing to compare


# --- artifacts --------------------------------------------------------------------------------------


def _edit(path: Path, change) -> None:
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(m, indent=2, sort_keys=True))


@pytest.mark.parametrize("change,words", [
    (lambda m: m["layers"][next(iter(m["layers"]))].update(bits=8), "was changed after slmedge wrote it"),
    (lambda m: m["recipe"].update(bits=8), "was changed after slmedge wrote it"),
    # A format-2 manifest is always written sealed: without its seal it is refused, whatever else changed
    # (tests/test_seals.py: everywhere; an unsealed version-1 manifest's edit still shows there).
    (lambda m: (m.pop(SEAL_KEY), m["layers"][next(iter(m["layers"]))].update(bits=8)), f"has no {SEAL_KEY}"),
])
def test_an_edited_artifact_manifest_is_refused_everywhere(change, words, artifacts, tmp_path, corpus):
    art = tmp_path / "art"
    shutil.copytree(artifacts("llama", "gptq"), art)
    assert SEAL_KEY in json.loads((art / "slmedge.json").read_text())
    _edit(art / "slmedge.json", change)
    db = tmp_path / "db.sqlite"
    one_line_error(runner.invoke(app, ["inspect", str(art)]), words)
    one_line_error(runner.invoke(app, ["evaluate", str(art), *EVAL, "--corpus", str(corpus), "--results-db", str(db)]),
                   words)
    one_line_error(runner.invoke(app, ["export", str(art), "--format", "gguf", "-o", str(tmp_path / "m.gguf")]), words)
    assert runs_recorded(db) == 0 and not (tmp_path / "m.gguf").exists()


def test_an_unchanged_artifact_opens(artifacts):
    r = runner.invoke(app, ["inspect", str(artifacts("llama", "gptq")), "--json"])
    assert r.exit_code == 0, r.output


# --- exports ----------------------------------------------------------------------------------------


def test_a_flipped_byte_in_an_onnx_export_is_refused(exports, tmp_path, corpus):
    folder = tmp_path / "onnx"
    shutil.copytree(exports["onnxruntime"], folder)
    assert json.loads(inspect_json(folder))["checksums"] == "match the manifest"
    flip(folder / "model.onnx")
    db = tmp_path / "db.sqlite"
    r = runner.invoke(app, ["evaluate", str(folder), *EVAL, "--corpus", str(corpus), "--results-db", str(db)])
    one_line_error(r, "checksum mismatch for model.onnx", str(folder))
    assert runs_recorded(db) == 0
    one_line_error(runner.invoke(app, ["inspect", str(folder)]), "checksum mismatch for model.onnx")
    assert not get_format("onnx").reusable(folder)


def test_an_edited_onnx_manifest_is_refused(exports, tmp_path, corpus):
    folder = tmp_path / "onnx"
    shutil.copytree(exports["onnxruntime"], folder)
    _edit(folder / "slmedge-export.json", lambda m: m.update(type="int4"))
    r = runner.invoke(app, ["evaluate", str(folder), *EVAL, "--corpus", str(corpus),
                            "--results-db", str(tmp_path / "db.sqlite")])
    one_line_error(r, "slmedge-export.json was changed after slmedge wrote it")


def inspect_json(path) -> str:
    r = runner.invoke(app, ["inspect", str(path), "--json"])
    assert r.exit_code == 0, r.output
    return r.output


def test_a_gguf_export_carries_its_own_checksum(exports, tmp_path, corpus):
    src = Path(exports["llama.cpp"])
    manifest = check_gguf(src)
    assert len(manifest[FILE_KEY]) == 64 and manifest[FILE_KEY] != "0" * 64
    assert json.loads(inspect_json(src))["checksums"] == "match the manifest"
    data = src.read_bytes()
    # A byte in the tensor data; a byte of a metadata value before the manifest (a token's text, so
    # the file still parses and only the digest can tell).
    cases = {"tensors": len(data) - 100, "metadata": data.index(b"<pad>") + 3}
    for name, at in cases.items():
        copy = tmp_path / f"{name}.gguf"
        shutil.copyfile(src, copy)
        flip(copy, at)
        with pytest.raises(ArtifactError):
            check_gguf(copy)
        db = tmp_path / f"{name}.sqlite"
        # Evaluated as a file slmedge did not write (what llama-quantize's output from slmedge's export
        # is, issue 40), with one note; never reused as slmedge's own output.
        r = runner.invoke(app, ["evaluate", str(copy), *EVAL, "--corpus", str(corpus), "--results-db", str(db)])
        assert r.exit_code == 0 and "manifest is ignored" in r.output, r.output
        assert not get_format("gguf").reusable(copy)
    edited = tmp_path / "edited.gguf"
    assert data.count(b'"qtype":"f32"') == 1
    edited.write_bytes(data.replace(b'"qtype":"f32"', b'"qtype":"q80"'))  # same length: no offset moves
    one_line_error(runner.invoke(app, ["inspect", str(edited)]), "was changed after slmedge wrote it")


def test_a_gguf_slmedge_did_not_write_has_nothing_to_check(tmp_path):
    import gguf

    bare = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(bare), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert check_gguf(bare) is None


def test_the_manifest_is_found_by_walking_the_header_as_ggufs_reader_finds_it(exports, tmp_path):
    """The header walk (no object per vocabulary entry) finds the string where gguf.GGUFReader does,
    past every value type; a truncated header is refused (ValueError), a missing key is None."""
    import gguf

    from slmedge.models.gguf_seal import MANIFEST_KEY, _reader_span, string_value_span

    src = Path(exports["llama.cpp"])
    assert string_value_span(src, MANIFEST_KEY) == _reader_span(src) is not None
    odd = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(odd), "llama")
    w.add_uint8("a.u8", 1)
    w.add_int16("a.i16", -2)
    w.add_float64("a.f64", 0.5)
    w.add_bool("a.b", True)
    w.add_array("a.strs", ["x", "yy", ""])
    w.add_array("a.ints", [1, 2, 3])
    w.add_string("a.text", "hello")
    w.add_uint64("a.u64", 7)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    start, length = string_value_span(odd, "a.text")
    assert odd.read_bytes()[start:start + length] == b"hello"
    assert (start, length) == gguf_span(odd, "a.text")
    assert string_value_span(odd, "a.missing") is None
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(odd.read_bytes()[:start - 3])
    with pytest.raises(ValueError):
        string_value_span(cut, "a.text")


def gguf_span(path, key):
    import gguf

    field = gguf.GGUFReader(str(path)).fields[key]
    return field.offset + sum(int(p.nbytes) for p in field.parts[:field.data[0]]), int(field.parts[field.data[0]].nbytes)


# --- caches -----------------------------------------------------------------------------------------


def test_a_changed_cached_export_is_written_again(tiny_models, tmp_path, corpus, session_cache):
    model = tiny_models("llama")
    args = ["evaluate", str(model), "--runtime", "onnxruntime", *EVAL, "--corpus", str(corpus)]
    r = runner.invoke(app, [*args, "--json", str(tmp_path / "a.json"), "--results-db", str(tmp_path / "db")])
    assert r.exit_code == 0, r.output
    cached = json.loads((tmp_path / "a.json").read_text())["identity"]["path"]  # relative to the JSON's folder
    onnx_file = Path(os.path.normpath(tmp_path / cached))
    assert onnx_file.is_file() and str(session_cache) in str(onnx_file)
    flip(onnx_file)
    r = runner.invoke(app, [*args, "--json", str(tmp_path / "b.json"), "--results-db", str(tmp_path / "db")])
    assert r.exit_code == 0, r.output
    assert get_format("onnx").reusable(onnx_file.parent)  # written again, not evaluated as it was
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert a["metrics"]["perplexity"] == b["metrics"]["perplexity"]


def test_a_changed_cached_gguf_import_is_converted_again(exports, tmp_path, capsys):
    from slmedge.models.source import SOURCE_FILE, gguf_to_hf_dir

    gguf_path = tmp_path / "m.gguf"
    shutil.copyfile(exports["llama.cpp"], gguf_path)
    dest = gguf_to_hf_dir(gguf_path)
    record = json.loads((dest / SOURCE_FILE).read_text())
    assert "model.safetensors" in record["files"]
    weights = dest / "model.safetensors"
    good = sha256_file(weights)
    flip(weights)
    assert gguf_to_hf_dir(gguf_path) == dest
    assert sha256_file(weights) == good
    assert "converting it again" in capsys.readouterr().err


def test_a_cached_gguf_import_is_keyed_by_the_libraries_that_wrote_it(exports, tmp_path, monkeypatch):
    """A tokenizer saved by one transformers release can load with other ids under another (4.57's SmolLM2
    tokenizer under 5.x: perplexity 81 instead of 24.8): another release converts again, in a folder of its own."""
    from slmedge.models import source

    gguf_path = tmp_path / "m.gguf"
    shutil.copyfile(exports["llama.cpp"], gguf_path)
    now = source.gguf_to_hf_dir(gguf_path)
    assert json.loads((now / source.SOURCE_FILE).read_text())["libraries"] == source.conversion_libraries()
    other = {**source.conversion_libraries(), "transformers": "9.9.9"}
    monkeypatch.setattr(source, "conversion_libraries", lambda: other)
    then = source.gguf_to_hf_dir(gguf_path)
    assert then != now and "transformers9.9.9" in then.name
    assert json.loads((then / source.SOURCE_FILE).read_text())["libraries"] == other
    # a record naming other libraries than the folder's key (copied in by hand) is not trusted
    record = json.loads((then / source.SOURCE_FILE).read_text())
    record["libraries"] = {**other, "transformers": "0.0"}
    (then / source.SOURCE_FILE).write_text(json.dumps(record))
    assert not source._cache_intact(then)


def test_the_reference_task_cache_is_used_only_as_written_and_keyed_by_the_task_file(artifacts, tmp_path,
                                                                                      session_cache):
    art = artifacts("llama", "rtn")
    tasks = tmp_path / "data" / "tasks"
    tasks.mkdir(parents=True)
    rows = [{"query": f"Question {i}: which word comes next?", "choices": [" yes", " no", " maybe"], "gold": i % 3}
            for i in range(4)]
    (tasks / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    args = ["evaluate", str(art), "--metrics", "tasks,fidelity", "--seqlen", "32", "--tasks", "mine", "--data-dir", str(tmp_path / "data"),
            "--results-db", str(tmp_path / "db")]
    before = set((session_cache / "reference").glob("task-*.json"))
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    made = set((session_cache / "reference").glob("task-*.json")) - before
    assert len(made) == 1
    cache = made.pop()
    good = cache.read_text()
    edited = json.loads(good)
    edited["scores"][0]["pred"] = (edited["scores"][0]["pred"] + 1) % 3
    cache.write_text(json.dumps(edited))  # its seal no longer matches: scored again, written again
    assert runner.invoke(app, args).exit_code == 0
    assert json.loads(cache.read_text()) == json.loads(good)
    # Another task file under the same name is another cache entry.
    (tasks / "mine.jsonl").write_text("".join(json.dumps({**r, "gold": (r["gold"] + 1) % 3}) + "\n" for r in rows),
                                      encoding="utf-8")
    assert runner.invoke(app, args).exit_code == 0
    assert len(set((session_cache / "reference").glob("task-*.json")) - before) == 2


def test_reference_outputs_are_keyed_by_the_libraries_that_computed_them(monkeypatch):
    """Cached reference log-probs and task predictions are not reused under another torch or transformers."""
    from slmedge.compress import artifact
    from slmedge.evaluate.fidelity import identity_key

    ident = {"sha256": "abc", "path": "/m", "name": "m"}
    now = identity_key(ident, "torch")
    other = {**artifact.library_versions(), "transformers": "9.9.9"}
    monkeypatch.setattr(artifact, "library_versions", lambda: other)
    assert identity_key(ident, "torch") != now


def test_reference_outputs_of_other_windows_over_the_same_tokens_are_not_reused(session_cache):
    """Two windows of 16 tokens hold the same tokens as one window of their 32: the cache entry of one
    is not the other's (it was, and fidelity failed on mismatched shapes: a study's export after the
    main job on the same model, issue 42)."""
    import numpy as np

    from slmedge.evaluate.fidelity import reference_outputs

    class Echo:  # logits (T, 4) for a window of T tokens
        name = "echo"

        def sequence_outputs(self, windows, with_hidden):
            for w in windows:
                yield np.zeros((len(w), 4), dtype=np.float32), None

    tokens = list(range(1, 33))
    two, _, _ = reference_outputs(Echo(), [tokens[:16], tokens[16:]], "echo-model", False)
    one, _, cached = reference_outputs(Echo(), [tokens], "echo-model", False)
    assert [lp.shape for lp in two] == [(15, 4), (15, 4)]
    assert not cached and [lp.shape for lp in one] == [(31, 4)]

"""A seal cannot be removed: every manifest of a format slmedge always writes sealed is refused without
its seal, by every command that reads it (inspect, export, evaluate, the study), and nothing is sealed
again from content that was not checked.

Removing the seal is the edit a careless (or hurried) hand makes: delete ``manifest_sha256`` and the
other edit (bits 4 -> 8 in the recipe) goes unseen, since nothing else records the recipe.
"""

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import one_line_error, tiny_study_file

from slmedge.cli import app
from slmedge.errors import ArtifactError
from slmedge.export.formats import get_format
from slmedge.fsutil import SEAL_KEY
from slmedge.models.gguf_seal import FILE_KEY, ModifiedGGUFError, check_gguf, seal_gguf

runner = CliRunner()
EVAL = ["--metrics", "perplexity", "--langs", "", "--no-wikitext", "--seqlen", "32", "--ppl-windows", "1"]
NO_SEAL = f"has no {SEAL_KEY}"


@pytest.fixture
def corpus(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text(" ".join(["The quick brown fox jumps over the lazy dog."] * 40), encoding="utf-8")
    return f


def _edit_json(path: Path, change) -> None:
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(m, indent=2, sort_keys=True))


def _unseal_and_edit_recipe(m: dict) -> None:
    """The probe's edit: the seal deleted, the recipe's bits 4 -> 8."""
    del m[SEAL_KEY]
    assert m["recipe"]["bits"] == 4
    m["recipe"]["bits"] = 8


def _refused_everywhere(path: Path, tmp_path: Path, corpus: Path, *words, export: bool = True) -> None:
    db = tmp_path / "db.sqlite"
    one_line_error(runner.invoke(app, ["inspect", str(path)]), *words)
    r = runner.invoke(app, ["evaluate", str(path), *EVAL, "--corpus", str(corpus), "--results-db", str(db)])
    one_line_error(r, *words)
    assert r.exit_code == 1
    if export:
        out = tmp_path / "again.gguf"
        r = runner.invoke(app, ["export", str(path), "--format", "gguf", "-o", str(out)])
        one_line_error(r, *words)
        assert r.exit_code == 1 and not out.exists()
    if db.exists():
        with sqlite3.connect(db) as con:
            assert con.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0


# --- artifacts --------------------------------------------------------------------------------------


def test_an_artifact_whose_seal_was_removed_is_refused_on_inspect_export_and_evaluate(artifacts, tmp_path, corpus):
    art = tmp_path / "art"
    shutil.copytree(artifacts("llama", "rtn", bits=4), art)
    _edit_json(art / "slmedge.json", _unseal_and_edit_recipe)
    _refused_everywhere(art, tmp_path, corpus, str(art / "slmedge.json"), NO_SEAL)


def test_lowering_the_format_version_does_not_let_an_unsealed_artifact_pass(artifacts, tmp_path, corpus):
    """Version 1 manifests may be unsealed; a version-2 artifact whose manifest claims version 1 is
    caught by its quantization file, which records the version it was written in."""
    art = tmp_path / "art"
    shutil.copytree(artifacts("llama", "rtn", bits=4), art)

    def downgrade(m):
        _unseal_and_edit_recipe(m)
        m["format_version"] = 1

    _edit_json(art / "slmedge.json", downgrade)
    _refused_everywhere(art, tmp_path, corpus, "says format version 1", "was written in version 2")
    _edit_json(art / "slmedge.json", lambda m: m.pop("format_version"))  # a missing version reads as 1
    one_line_error(runner.invoke(app, ["inspect", str(art)]), "was written in version 2")


def test_an_unsealed_version_1_artifact_still_opens_and_its_edits_still_show(tiny_models, calib_file, tmp_path):
    """Version 1 was written before seals existed: one without a seal opens (its quantization file
    checks its per-layer facts); the same manifest with a layer edited is refused."""
    from conftest import small_recipe
    from slmedge.compress.api import compress
    from slmedge.compress.artifact import write_artifact

    out = compress(str(tiny_models("llama")), small_recipe(calib_file, method="rtn", bits=4), write=False, device="cpu")
    v1 = write_artifact(tmp_path / "v1", out.loaded.model, out.loaded.tokenizer, out.result.layers, out.result.extras,
                        out.manifest, version=1)
    _edit_json(v1 / "slmedge.json", lambda m: m.pop(SEAL_KEY))  # as written before seals
    r = runner.invoke(app, ["inspect", str(v1), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["format_version"] == 1
    _edit_json(v1 / "slmedge.json", lambda m: m["layers"][next(iter(m["layers"]))].update(bits=8))
    one_line_error(runner.invoke(app, ["inspect", str(v1)]), "disagrees with quantization.safetensors")


def test_an_export_names_the_manifest_it_checked(artifacts, tmp_path):
    """``source_manifest_sha256`` is the digest of the bytes that were checked, not of the file as it
    is read again later."""
    from slmedge.compress.artifact import Artifact
    from slmedge.fsutil import sha256_file

    art = artifacts("llama", "rtn", bits=4)
    opened = Artifact.open(art)
    assert opened.manifest_sha256 == sha256_file(art / "slmedge.json")
    r = runner.invoke(app, ["export", str(art), "--format", "gguf", "-o", str(tmp_path / "m.gguf"), "--no-verify"])
    assert r.exit_code == 0, r.output
    assert check_gguf(tmp_path / "m.gguf")["source_manifest_sha256"] == opened.manifest_sha256


# --- GGUF exports -----------------------------------------------------------------------------------


def _blank_key(data: bytes, key: str) -> bytes:
    """The GGUF's manifest JSON with one key and its value blanked out by spaces (the same length: no
    offset in the file moves, and the file's own digest, which leaves the manifest out, still holds)."""
    start = data.index(f'"{key}":'.encode())  # stored without spaces (gguf_seal.manifest_text)
    end = data.index(b'"', data.index(b'"', start + len(key) + 3) + 1) + 1  # the value's closing quote
    if data[end:end + 1] == b",":
        end += 1
    else:  # the last key: the comma before it goes instead
        assert data[start - 1:start] == b","
        start -= 1
    return data[:start] + b" " * (end - start) + data[end:]


def test_a_gguf_whose_seal_was_removed_is_refused(exports, tmp_path, corpus, artifacts):
    art = artifacts("llama", "rtn", bits=4)
    src = tmp_path / "m.gguf"
    r = runner.invoke(app, ["export", str(art), "--format", "gguf", "-o", str(src), "--no-verify"])
    assert r.exit_code == 0, r.output
    data = src.read_bytes()
    assert data.count(b'"bits":4') == 1
    unsealed = tmp_path / "unsealed.gguf"
    unsealed.write_bytes(_blank_key(data, SEAL_KEY).replace(b'"bits":4', b'"bits":8'))
    _refused_everywhere(unsealed, tmp_path, corpus, str(unsealed), NO_SEAL, export=False)
    with pytest.raises(ArtifactError, match=NO_SEAL):
        check_gguf(unsealed)
    assert not get_format("gguf").reusable(unsealed)
    # Without its file digest (and its seal, which covered it): refused as well.
    nofile = tmp_path / "nofile.gguf"
    nofile.write_bytes(_blank_key(_blank_key(data, SEAL_KEY), FILE_KEY))
    with pytest.raises(ArtifactError, match=NO_SEAL):
        check_gguf(nofile)


def test_a_modified_gguf_is_told_apart_from_an_unsealed_one(exports, tmp_path):
    """``check_gguf`` is the one place that says a GGUF slmedge wrote was modified since (its manifest
    intact): ModifiedGGUFError, which a caller may treat differently from a removed seal."""
    data = Path(exports["llama.cpp"]).read_bytes()
    changed = tmp_path / "changed.gguf"
    body = bytearray(data)
    body[-100] ^= 1
    changed.write_bytes(bytes(body))
    with pytest.raises(ModifiedGGUFError, match="checksum mismatch"):
        check_gguf(changed)
    unsealed = tmp_path / "unsealed.gguf"
    unsealed.write_bytes(_blank_key(data, SEAL_KEY))
    with pytest.raises(ArtifactError) as err:
        check_gguf(unsealed)
    assert not isinstance(err.value, ModifiedGGUFError)


def test_only_the_writers_placeholders_are_ever_sealed(exports, tmp_path):
    """``seal_gguf`` writes digests only into a manifest holding the placeholders the writer left:
    a finished (or edited) GGUF is never sealed again from what it says."""
    copy = tmp_path / "m.gguf"
    shutil.copyfile(exports["llama.cpp"], copy)
    with pytest.raises(ArtifactError, match="not one this export left to seal"):
        seal_gguf(copy)
    unsealed = tmp_path / "unsealed.gguf"
    unsealed.write_bytes(_blank_key(copy.read_bytes(), SEAL_KEY))
    with pytest.raises(ArtifactError, match="not one this export left to seal"):
        seal_gguf(unsealed)
    assert copy.read_bytes() == Path(exports["llama.cpp"]).read_bytes()


# --- folder exports ---------------------------------------------------------------------------------


def test_an_onnx_export_whose_seal_was_removed_is_refused(exports, tmp_path, corpus):
    folder = tmp_path / "onnx"
    shutil.copytree(exports["onnxruntime"], folder)

    def unseal(m):
        del m[SEAL_KEY]
        m["type"] = "int4"

    _edit_json(folder / "slmedge-export.json", unseal)
    _refused_everywhere(folder, tmp_path, corpus, "slmedge-export.json", NO_SEAL, export=False)
    assert not get_format("onnx").reusable(folder)


# --- the study --------------------------------------------------------------------------------------


def _study_file(tmp_path: Path, model: Path, name: str, methods: list[str], exports=('"none"',)) -> Path:
    return tiny_study_file(tmp_path, model, name, methods, exports)


def test_the_study_refuses_an_unsealed_artifact_it_is_given(artifacts, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(artifacts("llama", "rtn", bits=4), art)
    _edit_json(art / "slmedge.json", _unseal_and_edit_recipe)
    f = _study_file(tmp_path, art, "given", ['method = "none"'])
    r = runner.invoke(app, ["study", str(f), "--results-db", str(tmp_path / "s.sqlite")])
    one_line_error(r, str(f), "line 2", NO_SEAL)
    assert r.exit_code == 1 and not (tmp_path / "work-given").exists()


def test_the_study_never_uses_its_own_outputs_once_their_seal_is_removed(tiny_models, tmp_path):
    """A study's artifact and GGUF export, their seals removed and their recipes edited after the study
    ran: a job that needs the artifact fails with the refusal (nothing is measured on it), and the
    GGUF is not reused: it is exported again, sealed."""
    f = _study_file(tmp_path, tiny_models("llama"), "own",
                    ['label = "rtn-w4"\nmethod = "rtn"\nbits = 4\ngroup_size = 32'], exports=('"gguf"',))
    db = tmp_path / "own.sqlite"
    r = runner.invoke(app, ["study", str(f), "--results-db", str(db)])
    assert r.exit_code == 0, r.output
    work = tmp_path / "work-own"
    (gguf_file,) = list((work / "exports").rglob("*.gguf"))
    (art,) = [p for p in (work / "artifacts").iterdir() if p.is_dir()]
    gguf_file.write_bytes(_blank_key(gguf_file.read_bytes(), SEAL_KEY).replace(b'"bits":4', b'"bits":8'))
    # Another measurement of the same export joins the grid: the export is needed again.
    f.write_text(f.read_text().replace("ppl_windows = 1", "ppl_windows = 2"))
    r = runner.invoke(app, ["study", str(f), "--results-db", str(db)])
    assert r.exit_code == 0, r.output
    assert check_gguf(gguf_file)[SEAL_KEY]  # exported again: sealed, its recipe the artifact's
    assert check_gguf(gguf_file)["recipe"]["bits"] == 4
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT COUNT(*) FROM study_events WHERE event = 'rebuilding'").fetchone()[0] == 1
    # The artifact: its export and the evaluations that need it refuse it.
    _edit_json(art / "slmedge.json", _unseal_and_edit_recipe)
    gguf_file.unlink()
    f.write_text(f.read_text().replace("ppl_windows = 2", "ppl_windows = 3"))
    r = runner.invoke(app, ["study", str(f), "--results-db", str(db)])
    assert r.exit_code == 1 and NO_SEAL in r.output and "Traceback" not in r.output, r.output
    assert not gguf_file.exists()
    with sqlite3.connect(db) as con:
        failed = con.execute("SELECT detail FROM study_events WHERE event = 'failed'").fetchall()
        assert failed and all(NO_SEAL in d for (d,) in failed), failed
        runs = con.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    assert runs == 2  # the two measurements made before the edit, nothing since

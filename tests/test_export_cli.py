"""`slmedge export` and `slmedge inspect` from the command line: outputs, refusals, one-line errors."""

import errno
import json

import gguf
import pytest
from typer.testing import CliRunner

from conftest import one_line_error

from slmedge.cli import app
from slmedge.compress.api import compress
from slmedge.compress.recipe import Recipe

runner = CliRunner()


@pytest.fixture(scope="module")
def gptq_artifact(tiny_models, calib_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-art") / "gptq"
    compress(str(tiny_models("qwen2")), Recipe(method="gptq", bits=4, group_size=32, symmetric=True,
                                               calibration=str(calib_file), nsamples=6, seqlen=32, batch_size=4),
             out, device="cpu")
    return out




def test_export_gguf_then_inspect(gptq_artifact, tmp_path):
    out = tmp_path / "m.gguf"
    r = runner.invoke(app, ["export", str(gptq_artifact), "--format", "gguf", "--type", "q4_0", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "verified against torch" in r.output and "codes kept exactly" in r.output
    r = runner.invoke(app, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.replace("│", " ").split())  # a cell's text, wherever the table wrapped it
    assert "qwen2" in flat and "Q4_0" in flat and "codes kept exactly in 14 of" in flat
    r = runner.invoke(app, ["inspect", str(out), "--json"])
    info = json.loads(r.output)
    assert info["by_type"]["Q4_0"]["bits_per_weight"] == 4.5 and info["manifest"]["qtype"] == "q4_0"


def test_export_onnx_then_inspect(gptq_artifact, tmp_path):
    out = tmp_path / "onnx"
    r = runner.invoke(app, ["export", str(gptq_artifact), "--format", "onnx", "--type", "int4", "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)  # progress lines go to stderr
    assert report["exact"] and report["ops"]["MatMulNBits"] >= 14
    r = runner.invoke(app, ["inspect", str(out), "--json"])
    info = json.loads(r.output)
    assert info["kv_cache"] and info["layers"] == 2 and "MatMulNBits int4 b32" in info["by_type"]
    r = runner.invoke(app, ["inspect", str(gptq_artifact)])
    assert r.exit_code == 0 and "compressed linears" in r.output


def test_exact_refusal_is_one_line_and_leaves_nothing(gptq_artifact, tmp_path):
    out = tmp_path / "m.gguf"
    r = runner.invoke(app, ["export", str(gptq_artifact), "--type", "q4_k_m", "--exact", "-o", str(out)])
    one_line_error(r, "cannot be kept as q4_k_m")
    assert not list(tmp_path.iterdir())


def test_unwritable_output_is_one_clear_error(gptq_artifact, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = runner.invoke(app, ["export", str(gptq_artifact), "--type", "q4_0", "-o", str(blocker / "m.gguf")])
    one_line_error(r)
    r = runner.invoke(app, ["export", str(gptq_artifact), "--format", "onnx", "-o", str(blocker / "onnx")])
    one_line_error(r)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_full_disk_while_writing_gguf_leaves_nothing(gptq_artifact, tmp_path, monkeypatch):
    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full)
    r = runner.invoke(app, ["export", str(gptq_artifact), "--type", "q4_0", "-o", str(tmp_path / "m.gguf")])
    one_line_error(r, f"no space left on {tmp_path / 'm.gguf'} (needed about")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args,words", [
    (["--format", "tflite"], ["unknown format 'tflite'"]),
    (["--type", "q3_0"], ["unknown GGUF type 'q3_0'"]),
    (["--format", "onnx", "--type", "int3"], ["unknown ONNX type 'int3'"]),
    (["--format", "onnx", "-o", "x.onnx"], ["is a directory"]),
    (["--format", "gguf", "-o", "out_dir"], ["ending in .gguf"]),
])
def test_impossible_settings(args, words, gptq_artifact, tmp_path):
    r = runner.invoke(app, ["export", str(gptq_artifact), *args])
    one_line_error(r, *words)


def test_existing_output_needs_overwrite(gptq_artifact, tmp_path):
    out = tmp_path / "m.gguf"
    r = runner.invoke(app, ["export", str(gptq_artifact), "--no-verify", "--type", "f32", "-o", str(out)])
    assert r.exit_code == 0, r.output
    first = out.read_bytes()
    r = runner.invoke(app, ["export", str(gptq_artifact), "--no-verify", "-o", str(out)])
    one_line_error(r, "exists", "--overwrite")
    assert out.read_bytes() == first
    r = runner.invoke(app, ["export", str(gptq_artifact), "--no-verify", "--overwrite", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "skipped (--no-verify)" in r.output
    assert out.read_bytes()[:4] == b"GGUF" and out.read_bytes() != first


def test_overwrite_never_replaces_what_slmedge_did_not_write(gptq_artifact, tiny_models, calib_file, tmp_path):
    # A file that is not slmedge's GGUF is kept, --overwrite or not.
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    r = runner.invoke(app, ["export", str(gptq_artifact), "--no-verify", "--overwrite", "-o", str(out)])
    one_line_error(r, "not a GGUF file slmedge wrote")
    assert out.read_bytes() == b"keep me"
    # A folder holding a file slmedge did not write is not replaced by an ONNX export or a compress...
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    r = runner.invoke(app, ["export", str(gptq_artifact), "--format", "onnx", "--overwrite", "-o", str(folder)])
    one_line_error(r, "notes.txt", "did not write")
    r = runner.invoke(app, ["compress", str(tiny_models("llama")), "--method", "rtn", "--overwrite", "-o", str(folder)])
    one_line_error(r, "notes.txt", "did not write")
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    # ...nor an artifact with a file added by hand, and never the input of the same command.
    art = tmp_path / "art"
    assert runner.invoke(app, ["compress", str(tiny_models("llama")), "--method", "rtn", "-o", str(art)]).exit_code == 0
    (art / "extra.bin").write_bytes(b"x")
    r = runner.invoke(app, ["compress", str(tiny_models("llama")), "--method", "rtn", "--overwrite", "-o", str(art)])
    one_line_error(r, "extra.bin")
    assert (art / "extra.bin").is_file()
    (art / "extra.bin").unlink()
    r = runner.invoke(app, ["compress", str(tiny_models("llama")), "--method", "rtn", "--overwrite", "-o", str(art)])
    assert r.exit_code == 0, r.output  # an artifact slmedge wrote is replaced
    r = runner.invoke(app, ["compress", str(art), "--method", "rtn", "--overwrite", "-o", str(art)])
    one_line_error(r, "is (or holds, or is inside) the input")
    assert (art / "slmedge.json").is_file()


def test_inspect_refuses_what_it_cannot_read(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    one_line_error(runner.invoke(app, ["inspect", str(bad)]), "not a readable GGUF")
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    one_line_error(runner.invoke(app, ["inspect", str(other)]), "is not a .gguf file")
    one_line_error(runner.invoke(app, ["inspect", str(tmp_path / "missing.gguf")]), "does not exist")

"""The export-format registry: formats are registered by name, a new one needs no other module, and
each format's manifest has one reader."""

import json
from pathlib import Path

import gguf
import pytest
from typer.testing import CliRunner

from conftest import one_line_error

from slmedge.cli import app
from slmedge.export import FORMATS, export_gguf, export_onnx, get_format, register_format, unregister_format
from slmedge.export.inspect import inspect_path
from slmedge.study import engine

runner = CliRunner()


def test_a_duplicate_format_name_is_refused():
    before = dict(FORMATS)
    with pytest.raises(ValueError, match="export format 'gguf' registered twice"):
        register_format("gguf", label="X", single_file=True, suffix=".x", complete=bool, read_manifest=dict,
                        types=())(lambda *a, **k: {})
    assert FORMATS == before and FORMATS["gguf"].write is export_gguf and FORMATS["onnx"].write is export_onnx
    try:
        register_format("twice", label="T", single_file=True, suffix=".t", complete=bool, read_manifest=dict,
                        types=())(lambda *a, **k: {})
        with pytest.raises(ValueError, match="registered twice"):
            register_format("twice", label="T", single_file=True, suffix=".t", complete=bool, read_manifest=dict,
                            types=())(lambda *a, **k: {})
    finally:
        unregister_format("twice")
    assert "twice" not in FORMATS


@pytest.fixture
def fake_format():
    """A format that exists only in this test: one .fake file holding its manifest as JSON."""
    calls = []

    def read(path):
        p = Path(path)
        return json.loads(p.read_text()) if p.is_file() else None

    @register_format("fake", label="FAKE", single_file=True, suffix=".fake", complete=lambda out: Path(out).is_file(),
                     read_manifest=read, types=("tiny", "small"), options=("block_size",),
                     report_rows=lambda report: [("fake rows", f"{report['qtype']} written")],
                     inspect=lambda p: {"path": str(p), "format": "fake", "architecture": "none",
                                        "file_bytes": p.stat().st_size, "params": 1, "bits_per_weight": 8.0,
                                        "by_type": {}, "manifest": read(p)},
                     inspect_rows=lambda info: [("fake inspect", "looked inside")])
    def write_fake(folder, out, qtype, *, exact, verify, overwrite, n_threads, **options):
        key = get_format("fake").check_type(qtype)
        calls.append({"folder": folder, "out": out, "qtype": key, "exact": exact, "verify": verify, **options})
        out.parent.mkdir(parents=True, exist_ok=True)
        manifest = {"format": "slmedge-fake-export", "source": str(folder), "source_kind": "hf_dir",
                    "source_manifest_sha256": None, "qtype": key, "tensors": {}}
        out.write_text(json.dumps(manifest))
        return {"path": str(out), "source": str(folder), "source_kind": "hf_dir", "qtype": key,
                "bytes": out.stat().st_size, "verification": None, "notes": [], "seconds": 0.0}

    try:
        yield calls
    finally:
        unregister_format("fake")


def test_a_format_registered_in_a_test_is_reachable_from_the_command_line(fake_format, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    out = tmp_path / "m.fake"
    r = runner.invoke(app, ["export", str(src), "--format", "fake", "--type", "tiny", "-o", str(out),
                            "--block-size", "64", "--no-verify"])
    assert r.exit_code == 0, r.output
    assert "slmedge export: fake tiny" in r.output and "tiny written" in r.output
    assert fake_format == [{"folder": src.resolve(), "out": out, "qtype": "tiny", "exact": False, "verify": False,
                            "block_size": 64}]  # only the options the format says it takes
    assert get_format("fake").read_manifest(out)["qtype"] == "tiny"
    # Its default output name, its output rule and its types come from the registration.
    r = runner.invoke(app, ["export", str(src), "--format", "fake", "--type", "small"])
    assert r.exit_code == 0, r.output
    assert Path("slmedge-out/src-small.fake").is_file()
    one_line_error(runner.invoke(app, ["export", str(src), "--format", "fake", "-o", str(tmp_path / "dir")]),
                   "a FAKE export is one file", "ending in .fake")
    one_line_error(runner.invoke(app, ["export", str(src), "--format", "fake", "--type", "huge", "-o", str(out)]),
                   "unknown FAKE type 'huge'; choose auto, tiny, small")
    one_line_error(runner.invoke(app, ["export", str(src), "--format", "nope"]),
                   f"unknown format 'nope'; choose {' or '.join(FORMATS)}", "gguf or onnx", "or fake")
    # inspect finds it by its suffix; a study knows when such an export is complete.
    r = runner.invoke(app, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    assert "looked inside" in r.output
    assert engine._made("export", {"format": "fake"}, out)
    assert not engine._made("export", {"format": "fake"}, tmp_path / "missing.fake")


def test_both_manifests_are_read_through_the_one_reader(exports, tiny_models, tmp_path):
    gguf_path, onnx_dir = Path(exports["llama.cpp"]), Path(exports["onnxruntime"])
    g = get_format("gguf").read_manifest(gguf_path)
    o = get_format("onnx").read_manifest(onnx_dir)
    assert get_format("onnx").read_manifest(onnx_dir / "model.onnx") == o  # the folder or its model file
    shared = ("format", "source_kind", "source_manifest_sha256")
    assert {k: g[k] for k in shared} == {"format": "slmedge-gguf-export", "source_kind": "hf_dir",
                                         "source_manifest_sha256": None}
    assert {k: o[k] for k in shared} == {**{k: g[k] for k in shared}, "format": "slmedge-onnx-export"}
    # the source, relative to the folder holding each manifest (no absolute local path for others)
    from slmedge.paths import resolve_recorded

    assert not Path(g["source"]).is_absolute() and not Path(o["source"]).is_absolute()
    assert resolve_recorded(g["source"], gguf_path.parent).resolve() == tiny_models("llama").resolve()
    assert resolve_recorded(o["source"], onnx_dir).resolve() == tiny_models("llama").resolve()
    assert g["qtype"] == "f32" and o["type"] == "fp32" and "files" in o
    # inspect shows what the reader reads (less the ONNX file list), and both exports are complete.
    assert inspect_path(gguf_path)["manifest"] == g
    assert inspect_path(onnx_dir)["manifest"] == {k: v for k, v in o.items() if k != "files"}
    assert get_format("gguf").complete(gguf_path) and get_format("onnx").complete(onnx_dir)
    # An export without a manifest reads as None.
    bare = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(bare), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert get_format("gguf").read_manifest(bare) is None
    (tmp_path / "onnx").mkdir()
    assert get_format("onnx").read_manifest(tmp_path / "onnx") is None and not get_format("onnx").complete(tmp_path / "onnx")

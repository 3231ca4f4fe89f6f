"""A GGUF llama-quantize derived from slmedge's export carries slmedge's manifest along (issue 40): it is
evaluated as a file slmedge did not write, with one note saying the manifest was ignored and why, while
slmedge's own reuse of its outputs (``reusable``: caches, a study's exports) still refuses it."""

import ctypes
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import one_line_error, require_import

from slmedge.cli import app
from slmedge.export.formats import get_format
from slmedge.models.gguf_seal import MANIFEST_KEY, ModifiedGGUFError, check_gguf, input_gguf_manifest

runner = CliRunner()
EVAL = ["--metrics", "perplexity", "--langs", "", "--no-wikitext", "--seqlen", "32", "--ppl-windows", "1"]


def _llama_quantize(src: Path, dst: Path, ftype: int) -> None:
    """What `llama-quantize src dst TYPE` does, through llama.cpp's own API (llama-cpp-python)."""
    llama_cpp = require_import("llama_cpp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0 and dst.is_file()


def test_a_file_llama_quantize_derived_is_evaluated_with_its_manifest_ignored(exports, tmp_path):
    import llama_cpp

    src = Path(exports["llama.cpp"])
    derived = tmp_path / "derived-q8_0.gguf"
    _llama_quantize(src, derived, llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0)
    assert MANIFEST_KEY.encode() in derived.read_bytes()  # llama.cpp copied slmedge's manifest along
    with pytest.raises(ModifiedGGUFError):
        check_gguf(derived)
    manifest, note = input_gguf_manifest(derived)
    assert manifest is None and "manifest is ignored" in note
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(["The quick brown fox jumps over the lazy dog."] * 40), encoding="utf-8")
    r = runner.invoke(app, ["evaluate", str(derived), *EVAL, "--corpus", str(corpus),
                            "--results-db", str(tmp_path / "r.sqlite")])
    assert r.exit_code == 0, r.output
    assert sum("manifest is ignored" in line for line in r.output.splitlines()) == 1, r.output
    inspected = runner.invoke(app, ["inspect", str(derived), "--json"])
    assert inspected.exit_code == 0 and "manifest ignored" in inspected.output, inspected.output
    # slmedge's own reuse still refuses it: never reused as slmedge's output (a cache, a study's export).
    assert not get_format("gguf").reusable(derived)
    assert get_format("gguf").reusable(src)


def test_a_tampered_manifest_is_still_refused_as_input(exports, tmp_path):
    """Only the tensors changing is a derived file; a manifest edited in place is refused everywhere."""
    data = Path(exports["llama.cpp"]).read_bytes()
    edited = tmp_path / "edited.gguf"
    assert data.count(b'"qtype":"f32"') == 1
    edited.write_bytes(data.replace(b'"qtype":"f32"', b'"qtype":"q80"'))
    with pytest.raises(Exception) as err:
        input_gguf_manifest(edited)
    assert not isinstance(err.value, ModifiedGGUFError)
    one_line_error(runner.invoke(app, ["evaluate", str(edited), *EVAL]), "was changed after slmedge wrote it")

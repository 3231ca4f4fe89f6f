"""Bad input: one clear line, a non-zero exit, and nothing written."""

import os

import pytest
from conftest import safetensors_full_disk
from typer.testing import CliRunner

from slmedge.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["compress", *map(str, args)])


def assert_clean_failure(result, out, *words):
    assert result.exit_code != 0
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    text = result.output.strip()
    assert text.startswith("error:") and len(text.splitlines()) == 1, text
    assert "Traceback" not in text
    for w in words:
        assert w in text.replace("\n", " "), text
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".slmedge-tmp")]


@pytest.mark.parametrize("args,words", [
    (["--method", "zip"], ["unknown method 'zip'", "gptq"]),
    (["--method", "rtn", "--bits", "0"], ["bits must be an integer from 2 to 8"]),
    (["--method", "rtn", "--bits", "9"], ["bits must be an integer from 2 to 8"]),
    (["--method", "wanda", "--sparsity", "-0.1"], ["sparsity"]),
    (["--method", "wanda", "--sparsity", "1"], ["below 1"]),
    (["--method", "sparsegpt", "--sparsity", "4:4"], ["1 <= N < M"]),
    (["--method", "sparsegpt", "--sparsity", "6:4"], ["1 <= N < M"]),
    (["--method", "wanda"], ["give --sparsity"]),
    (["--method", "gptq", "--sparsity", "0.5"], ["does not prune"]),
    (["--method", "rtn", "--group-size", "0"], ["--group-size", "got 0"]),
    (["--method", "wanda", "--sparsity", "1:3"], ["divisible by 3", "model.layers.0.self_attn.q_proj"]),
])
def test_impossible_settings(args, words, tiny_models, tmp_path):
    out = tmp_path / "out"
    assert_clean_failure(invoke(tiny_models("llama"), *args, "-o", out), out, *words)


def test_missing_model(tmp_path):
    out = tmp_path / "out"
    assert_clean_failure(invoke(tmp_path / "nope", "--method", "rtn", "-o", out), out, "not found")
    assert_clean_failure(invoke("missing.gguf", "--method", "rtn", "-o", out), out, "not found")
    assert_clean_failure(invoke("not a model", "--method", "rtn", "-o", out), out, "not found")


def test_corrupt_model(tiny_models, tmp_path):
    import shutil

    src = tmp_path / "corrupt"
    shutil.copytree(tiny_models("llama"), src)
    (src / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    out = tmp_path / "out"
    assert_clean_failure(invoke(src, "--method", "rtn", "-o", out), out, "cannot load the weights")


def test_pickled_weights_are_refused(tiny_models, tmp_path):
    import shutil

    src = tmp_path / "pickled"
    shutil.copytree(tiny_models("llama"), src)
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"not read")
    out = tmp_path / "out"
    assert_clean_failure(invoke(src, "--method", "rtn", "-o", out), out, "safetensors")


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    src = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(src)
    out = tmp_path / "out"
    assert_clean_failure(invoke(src, "--method", "rtn", "-o", out), out, "gpt2", "not supported", "llama")


def test_non_empty_output_needs_overwrite(tiny_models, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    result = invoke(tiny_models("llama"), "--method", "rtn", "-g", "32", "-o", out)
    assert result.exit_code != 0 and "--overwrite" in result.output
    assert (out / "keep.txt").read_text() == "precious" and len(os.listdir(out)) == 1
    # --overwrite replaces an artifact slmedge wrote, never a folder holding someone's file.
    result = invoke(tiny_models("llama"), "--method", "rtn", "-g", "32", "-o", out, "--overwrite")
    assert result.exit_code != 0 and "keep.txt" in result.output
    assert (out / "keep.txt").read_text() == "precious" and len(os.listdir(out)) == 1
    (out / "keep.txt").unlink()
    assert invoke(tiny_models("llama"), "--method", "rtn", "-g", "32", "-o", out).exit_code == 0
    result = invoke(tiny_models("llama"), "--method", "rtn", "-g", "32", "-o", out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert (out / "slmedge.json").is_file()


def test_interrupted_run_leaves_nothing_that_looks_complete(tiny_models, calib_file, tmp_path, monkeypatch):
    from slmedge.compress.methods import gptq

    calls = {"n": 0}
    original = gptq.gptq_quantize

    def interrupt_late(*args, **kwargs):  # each column loop (q/k/v together, o, gate/up together, down)
        calls["n"] += 1
        if calls["n"] == 5:  # the second block's first
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(gptq, "gptq_quantize", interrupt_late)
    out = tmp_path / "out"
    result = invoke(tiny_models("llama"), "--method", "gptq", "-g", "32", "--nsamples", "4", "--seqlen", "32",
                    "--calibration", calib_file, "-o", out)
    assert result.exit_code == 130
    assert "interrupted" in result.output
    assert not out.exists()


@pytest.mark.parametrize("raised", ["oserror", "safetensors"])
def test_a_full_disk_while_writing_leaves_no_artifact(tiny_models, tmp_path, monkeypatch, raised):
    import slmedge.compress.artifact as artifact

    def full_disk(*a, **k):
        if raised == "oserror":
            raise OSError(28, "No space left on device")
        safetensors_full_disk()

    monkeypatch.setattr(artifact, "save_file", full_disk)
    out = tmp_path / "out"
    result = invoke(tiny_models("llama"), "--method", "rtn", "-g", "32", "-o", out)
    assert_clean_failure(result, out, f"no space left on {out} (needed about", "nothing was written")
    assert "unexpected" not in result.output


def test_a_full_disk_inside_a_library_is_named_as_such(capsys):
    import typer

    from slmedge.cli.common import errors_to_exit

    with pytest.raises(typer.Exit) as exit_info:
        with errors_to_exit():
            try:
                raise OSError(28, "No space left on device")
            except OSError as exc:  # a library that wraps the OSError in its own error
                raise RuntimeError("could not write the file") from exc
    assert exit_info.value.exit_code == 1
    with pytest.raises(typer.Exit):
        with errors_to_exit():
            safetensors_full_disk()
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["error: no space left on the device"] * 2, lines


def test_a_killed_run_leaves_only_a_hidden_temporary_that_the_next_run_removes(tiny_models, tmp_path):
    stale = tmp_path / ".slmedge-tmp-999999999-out"  # as left by a process killed with -9
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    out = tmp_path / "out"
    result = invoke(tiny_models("llama"), "--method", "rtn", "-g", "32", "-o", out)
    assert result.exit_code == 0, result.output
    assert not stale.exists() and (out / "slmedge.json").is_file()


def test_debug_shows_the_traceback(tmp_path):
    result = runner.invoke(app, ["--debug", "compress", str(tmp_path / "nope"), "--method", "rtn"])
    assert result.exit_code != 0
    assert result.exception is not None and not isinstance(result.exception, SystemExit)


def test_help_has_examples():
    for cmd in ("compress", "run", "methods"):
        result = runner.invoke(app, [cmd, "--help"])
        assert result.exit_code == 0 and "Example" in result.output


def test_hub_id_without_network_is_one_clear_error(tmp_path):
    # HF_HUB_OFFLINE=1 in the tests: the real download code runs and fails as it would offline.
    out = tmp_path / "out"
    assert_clean_failure(invoke("someorg/no-such-model", "--method", "rtn", "-o", out), out, "Hugging Face Hub")


def test_unknown_device(tiny_models, tmp_path):
    out = tmp_path / "out"
    assert_clean_failure(invoke(tiny_models("llama"), "--method", "rtn", "--device", "tpu9", "-o", out), out, "device")

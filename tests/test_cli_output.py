"""What a person sees in a terminal: no library chatter between slmedge's tables (all of it under
--debug), and every table slmedge prints readable in an 80-column terminal."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slmedge.cli import app

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()

# A command added to slmedge's own app in a fresh process: the libraries speak the way they do in
# a real run (transformers' logger, a library's Python warning, a stray library logger), and so
# does slmedge (its own warning, its own table).
NOISY = textwrap.dedent('''
    import logging, sys, warnings
    import typer
    from slmedge.cli import app
    from slmedge.cli.common import console

    @app.command("noise")
    def noise():
        from transformers.utils import logging as hf_logging
        hf_logging.get_logger("transformers.models.llama.tokenization_llama_fast").warning(
            "You are using the default legacy behaviour of the LlamaTokenizerFast")
        warnings.warn_explicit("torch.tensor results are registered as constants", UserWarning,
                               "torch/onnx/utils.py", 1, module="torch.onnx.utils")
        logging.getLogger("optimum.exporters").warning("some weights were not used")
        import torch  # torch's own logger, as torch writes it when torchao registers its enums at import
        logging.getLogger("torch.utils._pytree").warning("<enum 'KernelPreference'> is an Enum subclass")
        warnings.warn_explicit("the calibration is not kept", UserWarning, "slmedge/export/gguf.py", 1,
                               module="slmedge.export.gguf")
        console.print("slmedge table")

    app(sys.argv[1:], standalone_mode=False)
''')

CHATTER = ("legacy behaviour", "registered as constants", "weights were not used", "is an Enum subclass")


def _noise(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSFORMERS_", "SLMEDGE_DEBUG", "HF_HUB_DISABLE"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", NOISY, *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout + proc.stderr


def test_library_chatter_is_kept_out_of_the_output_and_shown_under_debug():
    quiet = _noise("noise")
    assert "slmedge table" in quiet and "calibration is not kept" in quiet  # slmedge's own words stay
    for words in CHATTER:
        assert words not in quiet, quiet
    loud = _noise("--debug", "noise")
    assert "slmedge table" in loud and "calibration is not kept" in loud
    for words in CHATTER:
        assert words in loud, (words, loud)


def test_a_study_worker_is_as_quiet_as_the_command_and_as_loud_under_debug(monkeypatch):
    """The one switch reaches the processes slmedge starts: a worker started under --debug keeps
    every library's notices."""
    code = ("import warnings, logging; from slmedge.quiet import quiet_libraries; quiet_libraries(own_warnings=False); "
            "warnings.warn_explicit('library chatter', UserWarning, 'x.py', 1, module='torch.x'); "
            "logging.getLogger('optimum').warning('logger chatter')")
    env = {k: v for k, v in os.environ.items() if k != "SLMEDGE_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert quiet.returncode == 0 and "chatter" not in quiet.stderr, quiet.stderr
    loud = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "SLMEDGE_DEBUG": "1"}, timeout=120)
    assert "library chatter" in loud.stderr and "logger chatter" in loud.stderr, loud.stderr


# --- 80 columns --------------------------------------------------------------------------------------


def _slmedge(*args, cwd, progress="off"):
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "SLMEDGE_PROGRESS": progress}
    env.pop("SLMEDGE_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "slmedge", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def _fits(text: str, command) -> None:
    """Every line within 80 columns, and no cell cut short ("…")."""
    wide = [line for line in text.splitlines() if len(line) > 80]
    cut = [line for line in text.splitlines() if "…" in line]
    assert not wide and not cut, f"{command}:\n" + "\n".join(wide + cut) + "\n---\n" + text


def test_every_table_fits_an_80_column_terminal(tiny_models, tmp_path):
    """The commands that print tables, each on a tiny model, in a subprocess whose terminal is 80
    columns wide (paths under pytest's temporary folder are long: they must wrap, not be cut)."""
    model = tiny_models("llama")
    deep = tmp_path / ("a-rather-long-folder-name-" * 3) / "x"
    deep.mkdir(parents=True)
    art, gguf, db = deep / "rtn-w4g32", deep / "rtn-w4g32.gguf", deep / "results.sqlite"
    from slmedge.compress.methods import METHODS
    from slmedge.targets.profiles import all_profiles

    # (command, words that must appear whole: a column squeezed to a few letters loses them)
    commands = [
        (["compress", model, "--method", "rtn", "--bits", "4", "--group-size", "32", "-o", art], ["architecture"]),
        (["export", art, "--format", "gguf", "-o", gguf], ["q4_1"]),
        (["inspect", art], ["compressed linears"]),
        (["inspect", gguf], ["architecture", "tokenizer"]),
        (["evaluate", gguf, "--reference", model, "--metrics", "perplexity,fidelity,tasks,memory,latency", "--langs",
          "en,th", "--seqlen", "16", "--ppl-windows", "1", "--tasks", "arc_easy,xcopa_th", "--limit", "2", "--pp", "16",
          "--tg", "4", "--repeats", "1", "--results-db", db], ["perplexity", "acc_norm", "top-1 agreement", "decode"]),
        (["methods"], list(METHODS)),
        (["targets", "list"], [*all_profiles(), "transport", "emulated", "aarch64", "x86_64"]),
        (["targets", "show", "raspberry-pi-5", "--model", gguf], ["memory_bandwidth_gbs", "decode"]),
        (["targets", "check", "cpu"], ["runner starts", "llama.cpp"]),
        (["data"], ["wikitext2", "ntrex128", "hellaswag", "licence"]),
        (["study", REPO / "scripts" / "studies" / "quick.toml", "--dry-run", "--results-db", db], ["compress", "evaluate"]),
        (["report", db, "-o", deep / "r.html"], ["report"]),
    ]
    for args, words in commands:
        code, text = _slmedge(*args, cwd=tmp_path)
        assert code == 0, (args, text)
        _fits(text, args)
        for w in words:
            assert w in text, (args, w, text)


def test_the_main_job_fits_an_80_column_terminal(tiny_models, tmp_path):
    code, text = _slmedge("run", tiny_models("llama"), "--nsamples", "2", "--seqlen", "16", "--limit", "1",
                          "--results-db", tmp_path / "r.sqlite", "-o", tmp_path / "main", cwd=tmp_path,
                          progress="lines")  # as in a log: one line per stage
    assert code == 0, text
    _fits(text, "run")
    assert "llama: base vs gptq grid iq4_xs as GGUF" in text  # the model's own name, not SmolLM2's
    # where its outputs go, said at the start and at the end; its stages, one line each off a terminal
    assert text.count(f"{tmp_path}/:") == 2 and "main.gguf" in text, text
    for stage in ("compress: block 2/2 in ", "export: export tensors ", "evaluate compressed (llama.cpp): "
                  "perplexity wikitext2 1/1 in "):
        assert stage in text, (stage, text)
    for words in CHATTER:
        assert words not in text


def test_targets_list_shows_the_rest_under_wide():
    res = runner.invoke(app, ["targets", "list", "--wide"])
    assert res.exit_code == 0, res.output
    assert "onnxruntime-genai" in res.output and "Raspberry Pi 5 (BCM2712" in res.output

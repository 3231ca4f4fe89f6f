"""Impossible settings are refused before any work: one line naming the culprit, exit code 2 for a
bad setting, nothing written."""

import json

import pytest
from typer.testing import CliRunner

from conftest import one_line_error
from slmedge.cli import app

runner = CliRunner()


@pytest.mark.parametrize("args,words", [
    (["--threads", "0"], ["--threads must be at least 1, got 0"]),
    (["--threads", "-1"], ["--threads must be at least 1, got -1"]),
    (["--context", "0"], ["--context must be at least 2, got 0"]),
    (["--ppl-windows", "-1"], ["--ppl-windows must be at least 1, got -1"]),
    (["--pp", "0"], ["--pp must be at least 1, got 0"]),
    (["--tg", "0"], ["--tg must be at least 1, got 0"]),
    (["--repeats", "0"], ["--repeats must be at least 1, got 0"]),
    (["--limit", "0"], ["--limit must be positive, got 0"]),
])
def test_evaluate_ranges(args, words, tiny_models, tmp_path):
    db = tmp_path / "db.sqlite"
    res = runner.invoke(app, ["evaluate", str(tiny_models("llama")), *args, "--results-db", str(db)])
    one_line_error(res, *words)
    assert res.exit_code == 2 and not db.exists()


@pytest.mark.parametrize("args,words", [
    (["--format", "onnx", "--type", "int4", "--accuracy-level", "9"], ["--accuracy-level must be 0..4, got 9"]),
    (["--format", "gguf", "--threads", "0"], ["--threads must be at least 1, got 0"]),
])
def test_export_ranges(args, words, tiny_models, tmp_path):
    out = tmp_path / "out"
    res = runner.invoke(app, ["export", str(tiny_models("llama")), *args, "-o", str(out / "m.gguf")])
    one_line_error(res, *words)
    assert res.exit_code == 2 and not out.exists()


def test_a_negative_bandwidth_in_a_profile_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SLMEDGE_TARGETS", str(tmp_path))
    (tmp_path / "neg.toml").write_text('transport = "local"\nmemory_bandwidth_gbs = -5\n')
    res = runner.invoke(app, ["targets", "show", "neg"])
    one_line_error(res, "neg.toml", "'memory_bandwidth_gbs' must not be negative")
    assert res.exit_code == 2


@pytest.mark.parametrize("gold", ['"0"', "true", "1.0"])
def test_a_task_gold_that_is_not_an_integer_is_refused(gold, tiny_models, tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"query": "Q", "choices": ["a", "b"], "gold": %s}\n' % gold)
    res = runner.invoke(app, ["evaluate", str(tiny_models("llama")), "--metrics", "tasks", "--tasks", str(f),
                              "--results-db", str(tmp_path / "db.sqlite")])
    one_line_error(res, "t.jsonl:1", "'gold' must be an integer index", json.loads(gold).__repr__())

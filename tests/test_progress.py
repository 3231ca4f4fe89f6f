"""Long work shows its progress on stderr (slmedge.progress): live bars with done/total, elapsed and
remaining time on a terminal; one plain line per stage elsewhere (a log, CI); nothing from the
library API unless its caller asks; never a byte on stdout."""

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from slmedge import progress
from slmedge.cli import app

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def progress_on(monkeypatch):
    monkeypatch.setenv("SLMEDGE_PROGRESS", "auto")  # conftest turns it off for the other tests


def _lines(stream: io.StringIO) -> list[str]:
    return [ln for ln in stream.getvalue().splitlines() if ln.strip()]


def test_off_a_terminal_each_stage_is_one_line_with_done_of_total():
    out = io.StringIO()  # not a terminal
    with progress.reporter(stream=out) as rep:
        assert rep.mode == "lines"
        with rep.section("compress"):
            for i in range(1, 31):
                rep("block", i, 30)  # the library's callback
        with progress.stage("export tensors", total=4) as st:
            for _ in range(4):
                st.advance()
        for i in range(1, 6):
            rep("arc_easy", i * 8, 40)
        for i in range(1, 6):
            rep("arc_easy", i * 8, 40)  # the same name counted again: a second stage
    lines = _lines(out)
    assert lines[0] == "compress ..."
    assert re.fullmatch(r"compress: block 30/30 in \d+\.\ds", lines[1]), lines
    assert re.fullmatch(r"compress: done in \d+\.\ds", lines[2]), lines
    assert re.fullmatch(r"export tensors 4/4 in \d+\.\ds", lines[3]), lines
    assert [ln.split(" in ")[0] for ln in lines[4:]] == ["arc_easy 40/40", "arc_easy 40/40"], lines
    assert len(lines) == 6, lines


def test_off_a_terminal_a_long_stage_says_where_it_is_and_how_long_is_left():
    out = io.StringIO()
    with progress.reporter(stream=out, every_s=0.0) as rep:
        for i in range(1, 5):
            rep("perplexity en", i, 4)
    lines = _lines(out)
    assert len(lines) == 4, lines  # three on the way, one at the end
    assert re.fullmatch(r"perplexity en 2/4, \d+\.\ds so far, about \d+\.\ds left", lines[1]), lines
    assert lines[-1].startswith("perplexity en 4/4 in "), lines


def test_a_stage_first_heard_of_at_its_first_item_is_timed_from_the_end_of_the_last(monkeypatch):
    """The library's callback reports an item when it is done: a one-window perplexity says 1/1 at
    its end, and its time is the time since the stage before it ended."""
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    with progress.reporter(stream=out) as rep:
        rep("perplexity en", 1, 1)
        now[0] += 3.5  # the next window is scored
        rep("perplexity de", 1, 1)
    lines = _lines(out)
    assert lines == ["perplexity en 1/1 in 0.0s", "perplexity de 1/1 in 3.5s"], lines


def test_a_failed_stage_leaves_no_done_line():
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with progress.reporter(stream=out):
            with progress.stage("verify in llama.cpp"):
                raise RuntimeError("boom")
    assert _lines(out) == []


def test_slmedge_progress_chooses_the_display(monkeypatch):
    out = io.StringIO()
    monkeypatch.setenv("SLMEDGE_PROGRESS", "off")
    with progress.reporter(stream=out) as rep:
        assert rep is None and progress.active() is None
        with progress.stage("export tensors", total=1) as st:
            st.advance()
    assert out.getvalue() == ""
    monkeypatch.setenv("SLMEDGE_PROGRESS", "lines")
    tty = io.StringIO()
    tty.isatty = lambda: True
    with progress.reporter(stream=tty) as rep:
        assert rep.mode == "lines"  # even on a terminal
        rep("block", 1, 1)
    assert tty.getvalue().startswith("block 1/1 in ")


def test_the_library_api_is_quiet_unless_a_reporter_is_open(capsys):
    with progress.stage("export tensors", total=2) as st:
        st.advance()
        st.advance()
    assert progress.active() is None
    assert capsys.readouterr() == ("", "")


def test_on_a_terminal_bars_show_done_of_total_elapsed_and_time_left():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, color_system=None)
    with progress.reporter(mode="bar", console=console) as rep:
        with rep.section("compress"):
            for i in range(1, 3):
                rep("block", i, 30)
            rep._progress.refresh()
            shown = buf.getvalue()
    assert "compress" in shown and "block" in shown
    assert "2/30" in shown, shown
    assert re.search(r"\d:\d\d:\d\d", shown), shown  # elapsed
    assert re.search(r"about \d+\.\ds left", shown), shown
    assert re.search(r"compress: done in \d+\.\ds", buf.getvalue())  # the section's line stays


def test_the_command_line_shows_progress_on_stderr_and_keeps_stdout_for_json(tiny_models, calib_file, tmp_path):
    """Off a terminal (CliRunner's stderr is not one): compress's stages, one line each, on stderr;
    --json's stdout is JSON alone."""
    res = CliRunner().invoke(app, ["compress", str(tiny_models("llama")), "--method", "gptq", "--bits", "4", "-g", "32",
                                   "--calibration", str(calib_file), "--nsamples", "4", "--seqlen", "32",
                                   "-o", str(tmp_path / "a"), "--json"])
    assert res.exit_code == 0, res.output
    json.loads(res.stdout)
    err = res.stderr.splitlines()
    blocks = [ln for ln in err if ln.startswith("block ")]
    assert len(blocks) == 1 and re.match(r"block (\d+)/\1 in ", blocks[0]), err
    assert any(ln.startswith("load the model in ") for ln in err), err


@pytest.mark.skipif(shutil.which("script") is None, reason="util-linux's script (a terminal for the command) is not installed")
def test_a_supervised_export_shows_live_bars_on_a_terminal(tiny_models, tmp_path):
    """slmedge export runs in a supervised child process (cli.common.supervised): on a terminal its
    bars still reach the user, with done of total."""
    out = tmp_path / "m.gguf"
    cmd = f"{sys.executable} -m slmedge export {tiny_models('llama')} --format gguf --type f32 -o {out}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "120"}
    r = subprocess.run(["script", "-qec", cmd, "/dev/null"], capture_output=True, text=True, env=env, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:]
    assert out.is_file()
    assert re.search(r"export tensors.*\d+/\d+", r.stdout), r.stdout[-3000:]

"""Bad input is refused before any work, by every command: one table.

Each case runs one command line in process (typer's CliRunner) on tiny random models built here and
asserts the exit code (README.md, "Exit codes": 2 a bad setting, 1 a bad or missing input or an
output location that cannot be used, 130 interrupted), one ``error:`` line naming the culprit (the
option or the path), no traceback, no temporary name, and that nothing was written, deleted or
recorded: the work folder, the shared fixtures, the tiny model and the cache are snapshotted (every
path, every file's size and mtime) before and after, and the results store stays absent.

Placeholders in a case's arguments and words: {tiny} the tiny Llama folder, {f} the shared
fixtures folder (built once for the module), {w} the case's own work folder (also the cwd).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from typer.testing import CliRunner

from slmedge.cli import app

runner = CliRunner()

SETTING, INPUT, INTERRUPTED = 2, 1, 130  # the documented exit codes


@dataclass
class Case:
    id: str
    args: list[str]
    code: int
    words: list[str]
    patch: Callable | None = None  # (monkeypatch, fixtures) -> None, before the command runs
    xfail: str = ""  # the area that still owes the fix (strict: the lead removes it once fixed)
    usage: bool = False  # click's own usage error ("Error: ..." after the usage line)
    absent: list[str] = field(default_factory=list)  # paths (under {w}) that must not exist afterwards
    seconds: float | None = None  # must finish within
    unwords: list[str] = field(default_factory=list)  # must not be in the line (advice that would not work)


# --- patches ------------------------------------------------------------------------------------


def no_network(monkeypatch, fx):
    """The Hub cannot be reached (and nothing asks it to be offline): the check must say so at once."""
    from slmedge import hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "_hub_reachable", {})

    def refuse(*args, **kwargs):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", refuse)


def ctrl_c_in(target: str):
    """Ctrl-C pressed while ``target`` (a dotted name) runs."""

    def patch(monkeypatch, fx):
        def interrupt(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(target, interrupt)

    return patch


def ctrl_c_on_print(module: str):
    def patch(monkeypatch, fx):
        import importlib

        class Console:
            def print(self, *args, **kwargs):
                raise KeyboardInterrupt

        monkeypatch.setattr(importlib.import_module(module), "console", Console())

    return patch


def profiles(monkeypatch, fx):
    monkeypatch.setenv("SLMEDGE_TARGETS", str(fx / "targets"))


def memory(available: int):
    """The machine has ``available`` bytes of memory free (MemAvailable), whatever it has now."""

    def patch(monkeypatch, fx):
        import slmedge.fsutil

        monkeypatch.setattr(slmedge.fsutil, "memory_available", lambda: available)

    return patch


def cores(n: int):
    """This process may run on ``n`` CPUs, whatever the machine has."""

    def patch(monkeypatch, fx):
        import slmedge.limits

        monkeypatch.setattr(slmedge.limits, "usable_cpus", lambda: n)

    return patch


def never_loads(monkeypatch, fx):
    """Loading a model fails the test: what is refused must be refused before."""
    import slmedge.compress.api
    import slmedge.evaluate.subject

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before its settings were refused")

    for module in (slmedge.compress.api, slmedge.evaluate.subject):
        monkeypatch.setattr(module, "load", load)
    monkeypatch.setattr(slmedge.evaluate.subject, "open_subject", load)


# --- the table ----------------------------------------------------------------------------------

C = ["compress", "{tiny}"]
E = ["export", "{tiny}"]
V = ["evaluate", "{tiny}"]
R = ["run", "{tiny}", "--nsamples", "2", "--seqlen", "16"]
OUT = ["-o", "{w}/out"]
MEM = ["--metrics", "memory"]

CASES = [
    # compress: settings
    Case("compress-bits-9", C + ["--bits", "9"] + OUT, SETTING, ["bits", "9"]),
    Case("compress-bits-1", C + ["--method", "wanda", "--sparsity", "0.5", "--bits", "1"] + OUT, SETTING, ["bits", "1"]),
    Case("compress-unknown-method", C + ["--method", "quantum"] + OUT, SETTING, ["unknown method 'quantum'"]),
    Case("compress-sparsity-word", C + ["--method", "wanda", "--sparsity", "half"] + OUT, SETTING, ["sparsity", "half"]),
    Case("compress-sparsity-1.5", C + ["--method", "wanda", "--sparsity", "1.5"] + OUT, SETTING, ["sparsity", "1.5"]),
    Case("compress-sparsity-3:2", C + ["--method", "magnitude", "--sparsity", "3:2"] + OUT, SETTING, ["3:2"]),
    Case("compress-sparsity-2:3-on-64-wide", C + ["--method", "magnitude", "--sparsity", "2:3"] + OUT, SETTING,
         ["2:3", "divisible by 3"]),
    Case("compress-quantizer-given-sparsity", C + ["--method", "rtn", "--sparsity", "0.5"] + OUT, SETTING,
         ["rtn", "does not prune"]),
    Case("compress-group-1024-on-64-wide", C + ["--method", "rtn", "-g", "1024"] + OUT, SETTING, ["group size 1024"]),
    Case("compress-grid-unknown", C + ["--grid", "q9_k"] + OUT, SETTING, ["unknown grid", "q9_k"]),
    Case("compress-grid-and-bpw", C + ["--grid", "q4_k", "--bpw", "4.5"] + OUT, SETTING, ["not both"]),
    Case("compress-bpw-huge", C + ["--bpw", "1e308"] + OUT, SETTING, ["bpw must be"]),
    Case("compress-bpw-nan", C + ["--bpw", "nan"] + OUT, SETTING, ["bpw must be"]),
    Case("compress-group-0", C + ["-g", "0"] + OUT, SETTING, ["--group-size", "got 0"]),
    Case("compress-nsamples-0", C + ["--nsamples", "0"] + OUT, SETTING, ["nsamples", "0"]),
    Case("compress-seqlen-0", C + ["--seqlen", "0"] + OUT, SETTING, ["seqlen", "0"]),
    Case("compress-seqlen-past-positions", C + ["--method", "gptq", "--seqlen", "1024"] + OUT, SETTING,
         ["seqlen 1024", "max_position_embeddings"]),
    Case("compress-batch-size-0", C + ["--batch-size", "0"] + OUT, SETTING, ["--batch-size", "got 0"]),
    Case("compress-damp-negative", C + ["--method", "gptq", "--damp", "-1"] + OUT, SETTING, ["damp", "-1"]),
    Case("compress-awq-grid-0", C + ["--awq-grid", "0"] + OUT, SETTING, ["--awq-grid", "got 0"]),
    Case("compress-awq-include-head", C + ["--include-head"] + OUT, SETTING, ["awq", "lm_head"]),
    Case("compress-unknown-device", C + ["--device", "tpu"] + OUT, SETTING, ["device 'tpu'"]),
    Case("compress-unknown-calibration", C + ["--calibration", "wikipedia"] + OUT, SETTING, ["'wikipedia'"]),
    Case("compress-calibration-language", C + ["--calibration", "multilingual:xx"] + OUT, SETTING, ["xx"]),
    Case("compress-calibration-mix-empty-part", C + ["--calibration", "c4++multilingual"] + OUT, SETTING,
         ["c4++multilingual", "empty part"]),
    Case("compress-calibration-mix-unknown-part", C + ["--calibration", "c4+wikipedia"] + OUT, SETTING, ["'wikipedia'"]),
    Case("compress-bits-option-not-a-number", C + ["--bits", "four"] + OUT, SETTING, ["--bits"], usage=True),
    # compress: inputs and outputs
    Case("compress-missing-calibration-file", C + ["--calibration", "{w}/calib.txt"] + OUT, INPUT, ["{w}/calib.txt"]),
    Case("compress-mix-missing-calibration-file", C + ["--calibration", "c4+{w}/calib.txt"] + OUT, INPUT,
         ["{w}/calib.txt"]),
    Case("compress-calibration-text-field", C + ["--calibration", "{f}/calib.jsonl", "--text-field", "body"] + OUT,
         INPUT, ["calib.jsonl", "'body'"]),
    Case("compress-output-is-the-input", C + ["-o", "{tiny}", "--overwrite"], INPUT, ["{tiny}", "the input"]),
    Case("compress-output-inside-the-input", C + ["-o", "{tiny}/out", "--overwrite"], INPUT, ["{tiny}/out", "input"]),
    Case("compress-overwrite-foreign-folder", C + ["-o", "{f}/foreign", "--overwrite"], INPUT, ["{f}/foreign", "mine.txt"]),
    # a folder of someone else's: no advice to pass --overwrite (it would be refused then too)
    Case("compress-non-empty-folder", C + ["-o", "{f}/foreign"], INPUT, ["{f}/foreign", "mine.txt", "choose another"],
         unwords=["pass --overwrite"]),
    Case("compress-output-is-a-file", C + ["-o", "{f}/existing.html"], INPUT, ["{f}/existing.html", "folder"]),
    Case("compress-output-unwritable", C + ["-o", "/proc/x/y"], INPUT, ["/proc/x/y"]),
    Case("compress-missing-model-makes-no-folders", ["compress", "{w}/nomodel", "-o", "a/b/c"], INPUT, ["{w}/nomodel"],
         absent=["a"]),
    Case("compress-pickled-weights", ["compress", "{f}/pickled"] + OUT, INPUT, ["{f}/pickled", ".bin"]),
    Case("compress-trust-remote-code", ["compress", "{f}/remote"] + OUT, INPUT, ["{f}/remote", "--trust-remote-code"]),
    Case("compress-truncated-safetensors", ["compress", "{f}/truncated"] + OUT, INPUT, ["{f}/truncated", "corrupt"]),
    Case("compress-corrupt-gguf", ["compress", "{f}/corrupt.gguf"] + OUT, INPUT, ["{f}/corrupt.gguf"]),
    Case("compress-truncated-gguf", ["compress", "{f}/truncated.gguf"] + OUT, INPUT, ["{f}/truncated.gguf"]),
    Case("compress-plain-folder", ["compress", "{f}/plain"] + OUT, INPUT, ["{f}/plain", "config.json"]),
    Case("compress-text-file", ["compress", "{f}/existing.html"] + OUT, INPUT, ["{f}/existing.html", ".gguf"]),
    Case("compress-edited-artifact-manifest", ["compress", "{f}/edited-artifact"] + OUT, INPUT,
         ["{f}/edited-artifact", "slmedge.json"]),
    Case("compress-offline-hub-id", ["compress", "nobody/nothing"] + OUT, INPUT, ["nobody/nothing", "no network"],
         patch=no_network, seconds=5),
    Case("compress-interrupted", C + ["--method", "rtn"] + OUT, INTERRUPTED, [],
         patch=ctrl_c_in("slmedge.compress.api.compress")),
    # export
    Case("export-unknown-format", E + ["--format", "tflite", "-o", "{w}/m.gguf"], SETTING, ["tflite"]),
    Case("export-unknown-gguf-type", E + ["--type", "q9_9", "-o", "{w}/m.gguf"], SETTING, ["q9_9"]),
    Case("export-unknown-onnx-type", E + ["--format", "onnx", "--type", "int9", "-o", "{w}/o"], SETTING, ["int9"]),
    Case("export-accuracy-level-9", E + ["--format", "onnx", "--type", "int4", "--accuracy-level", "9", "-o", "{w}/o"],
         SETTING, ["--accuracy-level must be an integer from 0 to 4, got 9"]),
    Case("export-accuracy-level-negative", E + ["--format", "onnx", "--accuracy-level", "-1", "-o", "{w}/o"], SETTING,
         ["--accuracy-level", "-1"]),
    Case("export-threads-0", E + ["--threads", "0", "-o", "{w}/m.gguf"], SETTING,
         ["--threads must be an integer of at least 1, got 0"]),
    Case("export-onnx-block-size-0", E + ["--format", "onnx", "--type", "int4", "--block-size", "0", "-o", "{w}/o"],
         SETTING, ["--block-size", "got 0"]),
    Case("export-onnx-embedding-int3", E + ["--format", "onnx", "--type", "int4", "--embedding-type", "int3", "-o",
                                            "{w}/o"], SETTING, ["--embedding-type", "int3", "fp16, int8, int4"]),
    Case("export-onnx-head-int2", E + ["--format", "onnx", "--type", "int4", "--head-type", "int2", "-o", "{w}/o"],
         SETTING, ["--head-type", "int2", "int8, int4"]),
    Case("export-onnx-head-beside-keep-fp32", E + ["--format", "onnx", "--keep-fp32-head", "--head-type", "int4", "-o",
                                                   "{w}/o"], SETTING, ["--keep-fp32-head", "--head-type"]),
    Case("export-gguf-embedding-type", E + ["--embedding-type", "int4", "-o", "{w}/m.gguf"], SETTING,
         ["--embedding-type", "gguf"]),
    Case("export-onnx-embedding-block-48", E + ["--format", "onnx", "--embedding-type", "int4", "--block-size", "48",
                                                "-o", "{w}/o"], SETTING, ["--block-size", "48"]),
    Case("export-gguf-named-onnx", E + ["-o", "{w}/m.onnx"], SETTING, ["{w}/m.onnx", ".gguf"]),
    Case("export-onnx-named-dot-onnx", E + ["--format", "onnx", "-o", "{w}/m.onnx"], SETTING, ["{w}/m.onnx", "folder"]),
    Case("export-gguf-onto-a-folder", E + ["-o", "{f}/emptydir"], INPUT, ["{f}/emptydir", "must be a file path"]),
    Case("export-gguf-onto-a-folder-overwrite", E + ["-o", "{f}/foreign", "--overwrite"], INPUT,
         ["{f}/foreign", "must be a file path"]),
    Case("export-gguf-onto-a-file", E + ["-o", "{f}/existing.html"], INPUT, ["{f}/existing.html", "not a GGUF file"],
         unwords=["pass --overwrite"]),
    Case("export-gguf-overwrite-foreign-file", E + ["-o", "{f}/existing.html", "--overwrite"], INPUT,
         ["{f}/existing.html", "not a GGUF file slmedge wrote"]),
    Case("export-onnx-overwrite-foreign-folder", E + ["--format", "onnx", "-o", "{f}/foreign", "--overwrite"], INPUT,
         ["{f}/foreign", "did not write"]),
    Case("export-onnx-onto-the-input", E + ["--format", "onnx", "-o", "{tiny}", "--overwrite"], INPUT, ["{tiny}", "input"]),
    Case("export-output-unwritable", E + ["-o", "/proc/x.gguf"], INPUT, ["/proc/x.gguf"]),
    Case("export-missing-model-makes-no-folders", ["export", "{w}/nomodel", "-o", "a/b/c.gguf"], INPUT, ["{w}/nomodel"],
         absent=["a"]),
    Case("export-corrupt-gguf", ["export", "{f}/corrupt.gguf", "-o", "{w}/m.gguf"], INPUT, ["{f}/corrupt.gguf"]),
    Case("export-pickled-weights", ["export", "{f}/pickled", "-o", "{w}/m.gguf"], INPUT,
         ["{f}/pickled", "no safetensors weights"]),
    Case("export-edited-artifact-manifest", ["export", "{f}/edited-artifact", "-o", "{w}/m.gguf"], INPUT,
         ["{f}/edited-artifact", "slmedge.json"]),
    Case("export-offline-hub-id", ["export", "nobody/nothing", "-o", "{w}/m.gguf"], INPUT, ["nobody/nothing", "no network"],
         patch=no_network, seconds=5),
    Case("export-imatrix-not-a-matrix", E + ["--type", "q4_k_m", "--imatrix", "{f}/corrupt.gguf", "-o", "{w}/m.gguf"],
         INPUT, ["{f}/corrupt.gguf", "cannot be read as an importance matrix"]),
    Case("export-imatrix-missing", E + ["--type", "q4_k_m", "--imatrix", "{w}/none.gguf", "-o", "{w}/m.gguf"], INPUT,
         ["{w}/none.gguf", "does not exist"]),
    Case("export-imatrix-for-onnx", E + ["--format", "onnx", "--imatrix", "{f}/corrupt.gguf", "-o", "{w}/o"], SETTING,
         ["--imatrix", "gguf"]),
    # imatrix
    Case("imatrix-missing-model", ["imatrix", "{w}/nomodel", "-o", "{w}/m.gguf"], INPUT, ["{w}/nomodel"]),
    Case("imatrix-corrupt-gguf", ["imatrix", "{f}/corrupt.gguf", "-o", "{w}/m.gguf"], INPUT, ["{f}/corrupt.gguf"]),
    Case("imatrix-nsamples-0", ["imatrix", "{tiny}", "--nsamples", "0", "-o", "{w}/m.gguf"], SETTING, ["--nsamples"]),
    Case("imatrix-windows-past-the-text", ["imatrix", "{tiny}", "--calibration", "{f}/calib.jsonl", "--nsamples", "500",
                                           "--seqlen", "16", "-o", "{w}/m.gguf"], SETTING,
         ["--nsamples 500", "calib.jsonl", "has 250", "15 or fewer"]),
    Case("export-imatrix-a-folder", E + ["--type", "q4_k_m", "--imatrix", "{f}/emptydir", "-o", "{w}/m.gguf"], INPUT,
         ["{f}/emptydir", "is a folder"]),
    Case("imatrix-not-a-gguf-name", ["imatrix", "{tiny}", "-o", "{w}/m.dat"], SETTING, ["{w}/m.dat", ".gguf"]),
    Case("imatrix-onto-a-folder", ["imatrix", "{tiny}", "-o", "{f}/emptydir"], INPUT, ["{f}/emptydir", "directory"]),
    Case("imatrix-overwrite-foreign-file", ["imatrix", "{tiny}", "-o", "{f}/existing.html", "--overwrite"], INPUT,
         ["{f}/existing.html", "not an importance matrix slmedge wrote"]),
    # inspect
    Case("inspect-plain-folder", ["inspect", "{f}/plain"], INPUT, ["{f}/plain", "inspect takes"]),
    Case("inspect-empty-folder", ["inspect", "{f}/emptydir"], INPUT, ["{f}/emptydir", "inspect takes"]),
    Case("inspect-model-folder", ["inspect", "{tiny}"], INPUT, ["{tiny}", "inspect takes"]),
    Case("inspect-missing", ["inspect", "{w}/nothing.gguf"], INPUT, ["{w}/nothing.gguf", "does not exist"]),
    Case("inspect-corrupt-gguf", ["inspect", "{f}/corrupt.gguf"], INPUT, ["{f}/corrupt.gguf"]),
    Case("inspect-truncated-gguf", ["inspect", "{f}/truncated.gguf"], INPUT, ["{f}/truncated.gguf"]),
    Case("inspect-text-file", ["inspect", "{f}/existing.html"], INPUT, ["{f}/existing.html"]),
    Case("inspect-edited-artifact-manifest", ["inspect", "{f}/edited-artifact"], INPUT,
         ["{f}/edited-artifact", "slmedge.json"]),
    # evaluate: settings
    Case("evaluate-threads-0", V + ["--threads", "0"], SETTING, ["--threads must be an integer of at least 1, got 0"]),
    Case("evaluate-threads-negative", V + ["--threads", "-1"], SETTING, ["--threads", "at least 1, got -1"]),
    Case("evaluate-context-0", V + ["--context", "0"], SETTING, ["--context", "at least 2, got 0"]),
    Case("evaluate-ppl-windows-negative", V + ["--ppl-windows", "-1"], SETTING, ["--ppl-windows", "got -1"]),
    Case("evaluate-pp-0", V + ["--pp", "0"], SETTING, ["--pp", "at least 1, got 0"]),
    Case("evaluate-tg-0", V + ["--tg", "0"], SETTING, ["--tg", "at least 1, got 0"]),
    Case("evaluate-repeats-0", V + ["--repeats", "0"], SETTING, ["--repeats", "at least 1, got 0"]),
    Case("evaluate-limit-0", V + ["--limit", "0"], SETTING, ["--limit", "at least 1, got 0"]),
    Case("evaluate-seqlen-1", V + ["--seqlen", "1"], SETTING, ["--seqlen", "at least 2, got 1"]),
    Case("evaluate-stride-0", V + ["--stride", "0"], SETTING, ["stride", "0"]),
    Case("evaluate-unknown-metric", V + ["--metrics", "speed"], SETTING, ["unknown metric 'speed'"]),
    Case("evaluate-unknown-runtime", V + ["--runtime", "tflite"], SETTING, ["unknown runtime 'tflite'"]),
    Case("evaluate-unknown-reference-runtime", V + ["--metrics", "fidelity", "--reference-runtime", "tflite"], SETTING,
         ["unknown runtime 'tflite'"]),
    Case("evaluate-unknown-target", V + MEM + ["--target", "mars"], SETTING, ["unknown target 'mars'"]),
    Case("evaluate-unknown-language", V + ["--metrics", "perplexity", "--langs", "xx"], SETTING, ["unknown language 'xx'"]),
    Case("evaluate-unknown-task", V + ["--metrics", "tasks", "--tasks", "arc_hard"], SETTING, ["unknown task 'arc_hard'"]),
    Case("evaluate-ssh-host-starting-with-dash", V + MEM + ["--target", "{f}/targets/dash.toml"], SETTING,
         ["ssh host", "-oProxyCommand"]),
    Case("evaluate-negative-bandwidth-target", V + MEM + ["--target", "{f}/targets/neg.toml"], SETTING,
         ["neg.toml", "memory_bandwidth_gbs must be in (0, 100,000]", "-5"]),
    # evaluate: inputs and outputs
    Case("evaluate-missing-task-file", V + ["--metrics", "tasks", "--tasks", "{w}/mine.jsonl"], INPUT, ["{w}/mine.jsonl"]),
    Case("evaluate-task-gold-string", V + ["--metrics", "tasks", "--tasks", "{f}/gold-string.jsonl"], INPUT,
         ["gold-string.jsonl:1", "'gold' must be an integer index", "'0'"]),
    Case("evaluate-task-gold-bool", V + ["--metrics", "tasks", "--tasks", "{f}/gold-bool.jsonl"], INPUT,
         ["gold-bool.jsonl:1", "'gold' must be an integer index"]),
    Case("evaluate-missing-corpus", V + ["--metrics", "perplexity", "--corpus", "{w}/mine.txt"], INPUT, ["{w}/mine.txt"]),
    Case("evaluate-json-onto-a-folder", V + MEM + ["--json", "{f}/emptydir"], INPUT, ["--json", "{f}/emptydir"]),
    Case("evaluate-json-unwritable", V + MEM + ["--json", "/proc/x.json"], INPUT, ["--json", "/proc/x.json"]),
    Case("evaluate-results-db-foreign", V + MEM + ["--results-db", "{f}/foreign.db"], INPUT,
         ["{f}/foreign.db", "not an slmedge results"]),
    Case("evaluate-results-db-folder", V + MEM + ["--results-db", "{f}/emptydir"], INPUT, ["--results-db", "{f}/emptydir"]),
    Case("evaluate-results-db-unwritable", V + MEM + ["--results-db", "/proc/x/r.db"], INPUT, ["--results-db", "/proc/x/r.db"]),
    Case("evaluate-missing-model", ["evaluate", "{w}/nomodel"] + MEM, INPUT, ["{w}/nomodel"]),
    Case("evaluate-missing-reference", V + ["--metrics", "fidelity", "--reference", "{w}/noref"], INPUT, ["{w}/noref"]),
    Case("evaluate-corrupt-gguf", ["evaluate", "{f}/corrupt.gguf"] + MEM, INPUT, ["{f}/corrupt.gguf"]),
    Case("evaluate-truncated-safetensors", ["evaluate", "{f}/truncated"] + MEM, INPUT, ["{f}/truncated"]),
    Case("evaluate-pickled-weights", ["evaluate", "{f}/pickled"] + MEM, INPUT, ["{f}/pickled", ".bin"]),
    Case("evaluate-missing-data-dir", V + MEM + ["--data-dir", "{w}/data"], INPUT, ["{w}/data"]),
    Case("evaluate-data-dir-of-another-layout", V + MEM + ["--data-dir", "{f}/plain"], INPUT, ["{f}/plain"]),
    Case("evaluate-offline-hub-id", ["evaluate", "nobody/nothing"] + MEM, INPUT, ["nobody/nothing", "no network"],
         patch=no_network, seconds=5),
    Case("evaluate-interrupted", V + MEM, INTERRUPTED, [], patch=ctrl_c_in("slmedge.evaluate.api.Evaluation.check_inputs")),
    # run
    Case("run-limit-0", R + ["--limit", "0"] + OUT, SETTING, ["--limit", "at least 1, got 0"], absent=["out", "out.gguf"]),
    Case("run-ppl-windows-0", R + ["--ppl-windows", "0"] + OUT, SETTING, ["--ppl-windows", "0"]),
    Case("run-bits-9", R + ["--bits", "9"] + OUT, SETTING, ["bits", "9"]),
    Case("run-unknown-method", R + ["--method", "quantum"] + OUT, SETTING, ["unknown method 'quantum'"]),
    Case("run-group-1024-on-64-wide", R + ["--grid", "none", "-g", "1024"] + OUT, SETTING, ["group size 1024"]),
    Case("run-output-unwritable", R + ["-o", "/proc/x"], INPUT, ["/proc/x"]),
    Case("run-output-is-a-file", R + ["-o", "{f}/existing.html"], INPUT, ["{f}/existing.html"]),
    Case("run-missing-model-makes-no-folders", ["run", "{w}/nomodel", "-o", "a/b/c"], INPUT, ["{w}/nomodel"], absent=["a"]),
    Case("run-results-db-foreign", R + OUT + ["--results-db", "{f}/foreign.db"], INPUT, ["{f}/foreign.db"]),
    Case("run-gguf-beside-is-a-folder", R + ["-o", "{f}/sub/x"], INPUT, ["{f}/sub/x.gguf", "must be a file path"]),
    # study
    Case("study-missing-file", ["study", "{w}/nothing.toml", "--dry-run"], INPUT, ["{w}/nothing.toml"]),
    Case("study-unknown-key", ["study", "{f}/studies/badkey.toml", "--dry-run"], SETTING, ["badkey.toml", "'bogus'"]),
    Case("study-unknown-method", ["study", "{f}/studies/badmethod.toml", "--dry-run"], SETTING,
         ["badmethod.toml", "'quantum'"]),
    Case("study-not-toml", ["study", "{f}/studies/syntax.toml", "--dry-run"], SETTING, ["syntax.toml"]),
    Case("study-dry-run-missing-model", ["study", "{f}/studies/nomodel.toml", "--dry-run"], INPUT,
         ["nomodel.toml", "/nonexistent/model"]),
    Case("study-unknown-engine", ["study", "{f}/studies/ok.toml", "--engine", "slurm", "--workdir", "{w}/wd"], SETTING,
         ["slurm"]),
    Case("study-workers-0", ["study", "{f}/studies/ok.toml", "--workers", "0", "--workdir", "{w}/wd"], SETTING,
         ["--workers", "0"]),
    Case("study-results-db-foreign", ["study", "{f}/studies/badkey.toml", "--results-db", "{f}/foreign.db"], SETTING,
         ["badkey.toml"]),
    # report
    Case("report-onto-an-existing-file", ["report", "{f}/store.sqlite", "-o", "{f}/existing.html"], INPUT,
         ["{f}/existing.html", "not a report slmedge wrote"], unwords=["pass --overwrite"]),
    Case("report-unknown-format", ["report", "--format", "pdf", "-o", "{w}/r.pdf"], SETTING, ["--format", "pdf"]),
    Case("report-missing-store", ["report", "{w}/nothing.db", "-o", "{w}/r.html"], INPUT, ["{w}/nothing.db"]),
    Case("report-foreign-store", ["report", "{f}/foreign.db", "-o", "{w}/r.html"], INPUT,
         ["{f}/foreign.db", "not an slmedge results"]),
    Case("report-output-unwritable", ["report", "{f}/store.sqlite", "-o", "/proc/x.html"], INPUT, ["/proc/x.html"]),
    Case("report-study-with-no-results", ["report", "{f}/store.sqlite", "--study", "nope", "-o", "{w}/r.html"], INPUT,
         ["'nope'"]),
    # targets
    Case("targets-show-unknown", ["targets", "show", "mars"], SETTING, ["unknown target 'mars'"]),
    Case("targets-show-negative-bandwidth", ["targets", "show", "neg"], SETTING,
         ["neg.toml", "memory_bandwidth_gbs must be in (0, 100,000]", "-5"], patch=profiles),
    Case("targets-show-unknown-transport", ["targets", "show", "{f}/targets/teleport.toml"], SETTING,
         ["teleport.toml", "'teleport'"]),
    Case("targets-check-ssh-host-starting-with-dash", ["targets", "check", "{f}/targets/dash.toml"], SETTING,
         ["ssh host", "-oProxyCommand"]),
    Case("targets-show-ssh-host-starting-with-dash", ["targets", "show", "{f}/targets/dash.toml"], SETTING,
         ["dash.toml", "-oProxyCommand"]),
    Case("targets-show-model-missing", ["targets", "show", "cpu", "--model", "{w}/m.gguf"], INPUT, ["{w}/m.gguf"]),
    Case("targets-show-model-corrupt", ["targets", "show", "cpu", "--model", "{f}/corrupt.gguf"], INPUT,
         ["{f}/corrupt.gguf"]),
    Case("targets-setup-local", ["targets", "setup", "cpu"], SETTING, ["'cpu'", "needs no setup"]),
    Case("targets-unknown-command", ["targets", "teleport"], SETTING, ["teleport"], usage=True),
    # data
    Case("data-missing-data-dir", ["data", "--data-dir", "{w}/data"], INPUT, ["{w}/data"]),
    Case("data-data-dir-of-another-layout", ["data", "--data-dir", "{f}/plain"], INPUT, ["{f}/plain"]),
    Case("data-unknown-command", ["data", "fetch"], SETTING, ["fetch"], usage=True),
    Case("data-verify-extra-argument", ["data", "verify", "all"], SETTING, ["all"], usage=True),
    # methods
    Case("methods-extra-argument", ["methods", "awq"], SETTING, ["awq"], usage=True),
    Case("methods-unknown-option", ["methods", "--json"], SETTING, ["--json"], usage=True),
    Case("methods-interrupted", ["methods"], INTERRUPTED, [], patch=ctrl_c_on_print("slmedge.cli.methods")),
]

# --- issue 41: bounds from the option, the model and the machine, before any work ----------------------------
G = ["{f}/tiny.gguf"]  # the tiny llama as GGUF: 512 positions in its header (context_length)
ST = ["study", "--dry-run"]
BOUNDS = [
    # compress: every count bounded by what is meaningful, non-finite numbers refused
    Case("compress-nsamples-1e9", C + ["--nsamples", "1000000000"] + OUT, SETTING,
         ["--nsamples must be at most 65,536", "1,000,000,000"]),
    Case("compress-awq-grid-1e9", C + ["--awq-grid", "1000000000"] + OUT, SETTING, ["--awq-grid must be at most 1,000"]),
    Case("compress-batch-size-huge", C + ["--batch-size", "100000"] + OUT, SETTING, ["--batch-size must be at most"]),
    Case("compress-block-size-huge", C + ["--method", "gptq", "--block-size", "100000"] + OUT, SETTING,
         ["--block-size must be at most 65,536"]),
    Case("compress-awq-max-tokens-huge", C + ["--awq-max-tokens", "2000000"] + OUT, SETTING,
         ["--awq-max-tokens must be at most 1,048,576"]),
    Case("compress-seqlen-huge", C + ["--seqlen", "2000000"] + OUT, SETTING, ["--seqlen must be at most 1,048,576"]),
    Case("compress-group-size-huge", C + ["-g", "100000"] + OUT, SETTING, ["--group-size", "65,536", "got 100000"]),
    Case("compress-seed-past-64-bits", C + ["--seed", "18446744073709551616"] + OUT, SETTING,
         ["--seed must be at most"]),
    Case("compress-damp-nan", C + ["--method", "gptq", "--damp", "nan"] + OUT, SETTING,
         ["--damp must be in [0, 1)", "got nan"]),
    Case("compress-damp-inf", C + ["--method", "gptq", "--damp", "inf"] + OUT, SETTING, ["--damp", "got inf"]),
    Case("compress-sparsity-nan", C + ["--method", "wanda", "--sparsity", "nan"] + OUT, SETTING, ["sparsity", "nan"]),
    Case("compress-sparsity-m-huge", C + ["--method", "magnitude", "--sparsity", "2:100000"] + OUT, SETTING,
         ["2:100000", "at most 1,024"]),
    # compress: lengths bounded by the model's positions, read from its header before it loads
    Case("compress-gguf-seqlen-past-context-length", ["compress", *G, "--method", "gptq", "--seqlen", "1024"] + OUT,
         SETTING, ["seqlen 1024", "512 positions", "context_length of tiny.gguf", "--seqlen 512"], patch=never_loads),
    Case("compress-folder-seqlen-past-positions-before-loading", C + ["--method", "awq", "--seqlen", "600"] + OUT,
         SETTING, ["seqlen 600", "512 positions", "max_position_embeddings"], patch=never_loads),
    # compress: the calibration's memory against the memory available
    Case("compress-calibration-needs-more-memory", C + ["--method", "gptq", "--nsamples", "4096", "--seqlen", "512"]
         + OUT, SETTING, ["needs about", "99 MB available", "--nsamples"], patch=memory(99_000_000)),
    # export
    Case("export-threads-1e6", E + ["--threads", "1000000", "-o", "{w}/m.gguf"], SETTING,
         ["--threads must be at most 1,024"]),
    Case("export-threads-past-the-cores", E + ["--threads", "3", "-o", "{w}/m.gguf"], SETTING,
         ["--threads 3", "2 cores", "--threads 2"], patch=cores(2)),
    Case("export-onnx-block-size-huge", E + ["--format", "onnx", "--type", "int4", "--block-size", "131072", "-o",
                                             "{w}/o"], SETTING, ["--block-size must be at most 65,536"]),
    Case("export-onnx-block-size-not-a-power-of-two", E + ["--format", "onnx", "--type", "int4", "--block-size", "48",
                                                           "-o", "{w}/o"], SETTING, ["--block-size", "power of two"]),
    # evaluate: ranges
    Case("evaluate-threads-1e6", V + MEM + ["--threads", "1000000"], SETTING, ["--threads must be at most 1,024"]),
    Case("evaluate-threads-past-the-cores", V + MEM + ["--threads", "3"], SETTING, ["--threads 3", "2 cores"],
         patch=cores(2)),
    Case("evaluate-context-1e9", V + MEM + ["--context", "1000000000"], SETTING, ["--context must be at most 1,048,576"]),
    Case("evaluate-beyond-positions-keeps-the-range", V + MEM + ["--beyond-positions", "--context", "2000000"], SETTING,
         ["--context must be at most 1,048,576"]),
    Case("evaluate-repeats-huge", V + ["--repeats", "100000"], SETTING, ["--repeats must be at most 1,000"]),
    Case("evaluate-limit-huge", V + ["--limit", "2000000"], SETTING, ["--limit must be at most 1,000,000"]),
    Case("evaluate-ppl-windows-huge", V + ["--ppl-windows", "1000000"], SETTING, ["--ppl-windows", "100,000"]),
    Case("evaluate-stride-past-the-window", V + ["--metrics", "perplexity", "--seqlen", "64", "--stride", "65"], SETTING,
         ["stride", "at most the window length (64)", "65"]),
    Case("evaluate-pp-huge", V + ["--pp", "2000000"], SETTING, ["--pp must be at most 1,048,576"]),
    # evaluate: lengths against the model's positions (no run recorded, the model never opened)
    Case("evaluate-seqlen-past-positions", V + ["--metrics", "perplexity", "--seqlen", "1024"], SETTING,
         ["--seqlen 1024", "512 positions", "max_position_embeddings", "--beyond-positions"], patch=never_loads),
    Case("evaluate-pp-past-positions", V + ["--metrics", "latency", "--pp", "1024"], SETTING,
         ["--pp + --tg 1152", "512 positions"], patch=never_loads),
    Case("evaluate-default-pp-tg-past-positions", V + ["--metrics", "latency"], SETTING,
         ["--pp + --tg 640", "512 positions"], patch=never_loads),
    Case("evaluate-context-past-positions", V + MEM + ["--context", "1000000"], SETTING,
         ["--context 1000000", "512 positions"], patch=never_loads),
    Case("evaluate-gguf-seqlen-past-context-length", ["evaluate", *G, "--metrics", "perplexity", "--seqlen", "1024"],
         SETTING, ["--seqlen 1024", "context_length of tiny.gguf"], patch=never_loads),
    Case("evaluate-gguf-context-past-context-length", ["evaluate", *G] + MEM + ["--context", "4096"], SETTING,
         ["--context 4096", "context_length of tiny.gguf"], patch=never_loads),
    Case("evaluate-reference-shorter-than-the-window", ["evaluate", "{f}/long", "--metrics", "fidelity", "--reference",
                                                        "{tiny}", "--seqlen", "1024"], SETTING,
         ["--seqlen 1024", "512 positions", "{tiny}"], patch=never_loads),
    # evaluate: memory (KV cache, logits) against the memory available
    Case("evaluate-llamacpp-context-needs-more-memory", ["evaluate", *G] + MEM + ["--context", "512"], SETTING,
         ["needs about", "0.10 MB available", "llama.cpp", "its context of 648 tokens", "--context"], patch=memory(100_000)),
    Case("evaluate-torch-window-needs-more-memory", V + ["--metrics", "perplexity", "--seqlen", "512"], SETTING,
         ["needs about", "available", "torch", "--seqlen"], patch=memory(1_000_000)),
    Case("evaluate-beyond-positions-meets-the-memory", V + MEM + ["--beyond-positions", "--context", "1000000",
                                                                 "--runtime", "llama.cpp"], SETTING,
         ["needs about 0.5 GB", "100 MB available"], patch=memory(100_000_000)),
    # evaluate: target profiles' fields (finite, positive, below a ceiling)
    Case("evaluate-nan-bandwidth-target", V + MEM + ["--target", "{f}/targets/nanbw.toml"], SETTING,
         ["nanbw.toml", "memory_bandwidth_gbs", "nan"]),
    Case("evaluate-ssh-workdir-root", V + MEM + ["--target", "{f}/targets/wd-root.toml"], SETTING,
         ["wd-root.toml", "workdir '/'"]),
    # run
    Case("run-nsamples-1e9", R + ["--nsamples", "1000000000"] + OUT, SETTING, ["--nsamples must be at most 65,536"],
         absent=["out", "out.gguf"]),
    Case("run-seqlen-past-positions", ["run", "{tiny}", "--nsamples", "2", "--seqlen", "1024"] + OUT, SETTING,
         ["1024", "512 positions"], absent=["out", "out.gguf"], patch=never_loads),
    Case("run-ppl-windows-huge", R + ["--ppl-windows", "1000000"] + OUT, SETTING, ["--ppl-windows", "100,000"]),
    Case("run-needs-more-memory", R + OUT, SETTING, ["needs about", "available"], absent=["out", "out.gguf"],
         patch=memory(1_000_000)),
    # study: names that become paths, seeds, settings against each model, memory
    Case("study-name-climbs-out", ST + ["{f}/studies/dotdot.toml"], SETTING, ["dotdot.toml", "'../../..'", "plain name"]),
    Case("study-name-with-a-slash", ST + ["{f}/studies/slash.toml"], SETTING, ["slash.toml", "'a/b'", "plain name"]),
    Case("study-label-is-a-path", ST + ["{f}/studies/label.toml"], SETTING, ["label.toml", "'../x'", "plain name"]),
    Case("study-export-label-is-a-path", ST + ["{f}/studies/xlabel.toml"], SETTING, ["xlabel.toml", "'/etc'"]),
    Case("study-negative-seed", ST + ["{f}/studies/seed.toml"], SETTING, ["seed.toml", "a seed", "got -1"]),
    Case("study-nsamples-1e9", ST + ["{f}/studies/nsamples.toml"], SETTING, ["nsamples.toml", "nsamples", "65,536"]),
    Case("study-damp-nan", ST + ["{f}/studies/damp.toml"], SETTING, ["damp.toml", "damp", "nan"]),
    Case("study-calibration-past-positions", ST + ["{f}/studies/calseq.toml"], SETTING,
         ["calseq.toml", "seqlen 1024", "512 positions"]),
    Case("study-context-past-positions", ST + ["{f}/studies/context.toml"], SETTING,
         ["context.toml", "[evaluate]", "context 4096", "512 positions", "beyond_positions"]),
    Case("study-threads-1e6", ST + ["{f}/studies/threads.toml"], SETTING, ["threads.toml", "threads", "1,024"]),
    Case("study-calibration-needs-more-memory", ST + ["{f}/studies/bigcal.toml"], SETTING,
         ["bigcal.toml", "needs about", "available"], patch=memory(100_000_000)),
    Case("study-workers-huge", ["study", "{f}/studies/ok.toml", "--workers", "100000", "--workdir", "{w}/wd"], SETTING,
         ["--workers must be at most 1,024"]),
    # report: numbers in lists
    Case("report-under-mb-nan", ["report", "{f}/store.sqlite", "--under-mb", "nan", "-o", "{w}/r.html"], SETTING,
         ["--under-mb", "nan"]),
    Case("report-above-tps-inf", ["report", "{f}/store.sqlite", "--above-tps", "10,inf", "-o", "{w}/r.html"], SETTING,
         ["--above-tps", "inf"]),
    Case("report-under-mb-zero", ["report", "{f}/store.sqlite", "--under-mb", "0", "-o", "{w}/r.html"], SETTING,
         ["--under-mb must be in (0,", "got 0"]),
    # targets: every field of a profile, the ssh workdir, and the projection's context
    Case("targets-show-bandwidth-nan", ["targets", "show", "{f}/targets/nanbw.toml"], SETTING,
         ["nanbw.toml", "memory_bandwidth_gbs", "finite", "nan"]),
    Case("targets-show-bandwidth-inf", ["targets", "show", "{f}/targets/infbw.toml"], SETTING,
         ["infbw.toml", "memory_bandwidth_gbs", "inf"]),
    Case("targets-show-bandwidth-1e308", ["targets", "show", "{f}/targets/hugebw.toml"], SETTING,
         ["hugebw.toml", "memory_bandwidth_gbs", "100,000"]),
    Case("targets-show-compute-zero", ["targets", "show", "{f}/targets/zeroflops.toml"], SETTING,
         ["zeroflops.toml", "peak_fp32_gflops", "got 0"]),
    Case("targets-show-int8-nan", ["targets", "show", "{f}/targets/nanint8.toml"], SETTING,
         ["nanint8.toml", "peak_int8_gops", "nan"]),
    Case("targets-show-ram-negative", ["targets", "show", "{f}/targets/negram.toml"], SETTING,
         ["negram.toml", "ram_gb", "-1"]),
    Case("targets-show-threads-past-cores", ["targets", "show", "{f}/targets/threads.toml"], SETTING,
         ["threads.toml", "threads = 8", "cores = 4"]),
    Case("targets-show-port-70000", ["targets", "show", "{f}/targets/port.toml"], SETTING,
         ["port.toml", "port must be an integer from 1 to 65,535, got 70000"]),
    Case("targets-show-connect-timeout-negative", ["targets", "show", "{f}/targets/ctimeout.toml"], SETTING,
         ["ctimeout.toml", "connect_timeout_s", "-1"]),
    Case("targets-show-command-timeout-nan", ["targets", "show", "{f}/targets/cmdtimeout.toml"], SETTING,
         ["cmdtimeout.toml", "command_timeout_s", "nan"]),
    Case("targets-show-gpu-layers-huge", ["targets", "show", "{f}/targets/gpulayers.toml"], SETTING,
         ["gpulayers.toml", "gpu_layers", "100000"]),
    Case("targets-check-ssh-workdir-root", ["targets", "check", "{f}/targets/wd-root.toml"], SETTING,
         ["wd-root.toml", "workdir '/'"]),
    Case("targets-show-ssh-workdir-another-home", ["targets", "show", "{f}/targets/wd-other.toml"], SETTING,
         ["wd-other.toml", "'~root/.ssh'", "another user's home"]),
    Case("targets-show-ssh-workdir-dot-ssh", ["targets", "show", "{f}/targets/wd-ssh.toml"], SETTING,
         ["wd-ssh.toml", "'.ssh'", "dot-folder"]),
    Case("targets-show-ssh-workdir-outside-home", ["targets", "show", "{f}/targets/wd-etc.toml"], SETTING,
         ["wd-etc.toml", "'/etc/slmedge'", "outside the remote home and /tmp"]),
    Case("targets-show-context-1e9", ["targets", "show", "cpu", "--context", "1000000000"], SETTING,
         ["--context must be at most 1,048,576"]),
    Case("targets-show-context-past-positions", ["targets", "show", "cpu", "--model", *G, "--context", "1024"], SETTING,
         ["--context 1024", "context_length of tiny.gguf"]),
]
CASES += BOUNDS

# --- issue 59: options a grid or a budget makes meaningless; messages that named nothing --------------------
GRID = C + ["--method", "rtn"]
CONTRADICTIONS = [
    # a grid fixes the bits, the group size and the symmetry; a budget picks the grids: given besides, refused
    Case("compress-grid-with-bits", GRID + ["--grid", "q4_k", "--bits", "3"] + OUT, SETTING,
         ["bits 3 contradicts grid q4_k", "4-bit", "--bits"]),
    Case("compress-grid-with-sym", GRID + ["--grid", "q4_k", "--sym"] + OUT, SETTING,
         ["symmetric true contradicts grid q4_k", "--sym/--asym"]),
    Case("compress-grid-with-group-size", GRID + ["--grid", "q4_0", "--group-size", "64"] + OUT, SETTING,
         ["group_size 64 contradicts grid q4_0", "32 weights"]),
    Case("compress-grid-with-the-default-group-size-given", GRID + ["--grid", "q4_0", "-g", "128"] + OUT, SETTING,
         ["group_size 128 contradicts grid q4_0"]),
    Case("compress-grid-with-asym-given", GRID + ["--grid", "q4_0", "--asym"] + OUT, SETTING,
         ["symmetric false contradicts grid q4_0"]),
    Case("compress-k-grid-with-the-default-bits-given", GRID + ["--grid", "q3_k", "--bits", "4"] + OUT, SETTING,
         ["bits 4 contradicts grid q3_k", "3-bit"]),
    Case("compress-bpw-with-bits", GRID + ["--bpw", "4.5", "--bits", "3"] + OUT, SETTING,
         ["bits 3 contradicts bpw 4.5"]),
    Case("compress-bpw-with-group-size", C + ["--method", "gptq", "--bpw", "5", "-g", "32"] + OUT, SETTING,
         ["group_size 32 contradicts bpw 5"]),
    Case("compress-pruner-grid-with-bits", C + ["--method", "magnitude", "--sparsity", "0.5", "--grid", "q8_0",
                                                "--bits", "4"] + OUT, SETTING, ["bits 4 contradicts grid q8_0"]),
    Case("run-default-grid-with-bits", R + ["--bits", "3"] + OUT, SETTING, ["bits 3 contradicts grid iq4_xs"],
         absent=["out", "out.gguf"]),
    Case("run-grid-with-group-size", R + ["--grid", "q6_k", "-g", "64"] + OUT, SETTING,
         ["group_size 64 contradicts grid q6_k"], absent=["out", "out.gguf"]),
    Case("study-grid-with-bits", ST + ["{f}/studies/gridbits.toml"], SETTING,
         ["gridbits.toml", "bits 3 contradicts grid q4_k"]),
    Case("study-bpw-with-symmetric", ST + ["{f}/studies/bpwsym.toml"], SETTING,
         ["bpwsym.toml", "symmetric true contradicts bpw 4.5"]),
    Case("compress-bpw-grids-empty", C + ["--bpw", "4.5", "--bpw-grids", ""] + OUT, SETTING,
         ["--bpw-grids", "names no grid"], unwords=["()", "non-empty list"]),
    Case("compress-bpw-grids-commas", C + ["--bpw", "4.5", "--bpw-grids", ",,"] + OUT, SETTING,
         ["--bpw-grids", "names no grid"], unwords=["()"]),
    Case("study-bpw-grids-empty", ST + ["{f}/studies/nogrids.toml"], SETTING, ["nogrids.toml", "names no grid"],
         unwords=["()"]),
    # unclear messages made clear
    Case("compress-hub-calibration-offline", C + ["--method", "gptq", "--calibration", "hf:nobody/nothing"] + OUT,
         INPUT, ["'hf:nobody/nothing'", "no network", "HF_HUB_OFFLINE"], patch=no_network, seconds=5),
    Case("compress-mixed-hub-calibration-offline", C + ["--method", "gptq", "--calibration",
                                                        "c4+hf:nobody/nothing"] + OUT,
         INPUT, ["'hf:nobody/nothing'", "no network"], patch=no_network, seconds=5),
    Case("imatrix-hub-calibration-offline", ["imatrix", "{tiny}", "--calibration", "hf:nobody/nothing", "-o",
                                             "{w}/m.gguf"], INPUT, ["'hf:nobody/nothing'", "no network"],
         patch=no_network, seconds=5),
    Case("evaluate-corpus-shorter-than-a-window", V + ["--metrics", "perplexity", "--corpus", "{f}/short.txt",
                                                       "--seqlen", "64"], INPUT,
         ["{f}/short.txt", "shorter than one window of 64"]),
    Case("evaluate-corpus-shorter-than-a-window-among-others", V + ["--metrics", "memory,perplexity", "--corpus",
                                                                    "{f}/calib.jsonl", "--corpus", "{f}/short.txt",
                                                                    "--seqlen", "64"], INPUT, ["{f}/short.txt"]),
    Case("evaluate-artifact-manifest-not-json", ["evaluate", "{f}/broken-manifest"] + MEM, INPUT,
         ["{f}/broken-manifest/slmedge.json", "not valid JSON"], unwords=["JSONDecodeError"]),
    Case("evaluate-reference-manifest-not-json", V + ["--metrics", "fidelity", "--reference", "{f}/broken-manifest"],
         INPUT, ["{f}/broken-manifest/slmedge.json", "not valid JSON"], unwords=["JSONDecodeError"]),
    Case("study-workdir-is-a-file", ["study", "{f}/studies/ok.toml", "--workdir", "{f}/existing.html"], INPUT,
         ["--workdir {f}/existing.html", "is a file"]),
    Case("study-dry-run-workdir-is-a-file", ST + ["{f}/studies/ok.toml", "--workdir", "{f}/existing.html"], INPUT,
         ["--workdir {f}/existing.html", "is a file"]),
    Case("study-workdir-under-a-file", ["study", "{f}/studies/ok.toml", "--workdir", "{f}/existing.html/wd"], INPUT,
         ["{f}/existing.html", "is a file"]),
    Case("study-file-workdir-is-a-file", ST + ["{f}/studies/wdfile.toml"], INPUT, ["the study's workdir", "is a file"]),
]
CASES += CONTRADICTIONS


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fixtures(tiny_models, tmp_path_factory, session_cache):
    """The bad inputs every case reads, built once: broken models, foreign files and folders,
    profiles, studies; plus a real results store and a GGUF to cut short."""
    from slmedge.compress.api import compress
    from slmedge.compress.recipe import Recipe
    from slmedge.evaluate.store import ResultsStore
    from slmedge.export.gguf import export_gguf

    tiny = tiny_models("llama")
    f = tmp_path_factory.mktemp("bad-input")

    def copy(name):
        shutil.copytree(tiny, f / name)
        return f / name

    import torch

    d = copy("pickled")
    (d / "model.safetensors").unlink()
    torch.save({}, d / "pytorch_model.bin")
    d = copy("remote")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="my_own_llama", auto_map={"AutoConfig": "modeling.MyConfig",
                                                    "AutoModelForCausalLM": "modeling.MyModel"})
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "modeling.py").write_text("raise SystemExit('this code must never run')\n")
    d = copy("truncated")
    weights = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (f / "corrupt.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    export_gguf(tiny, f / "tiny.gguf", "f32", verify=False)  # 512 positions in its header, as the tiny llama
    whole = (f / "tiny.gguf").read_bytes()
    (f / "truncated.gguf").write_bytes(whole[: len(whole) // 3])
    d = copy("long")  # the tiny llama with 4,096 positions
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 4096}))
    (f / "plain").mkdir()
    (f / "plain" / "x.txt").write_text("x")
    (f / "emptydir").mkdir()
    (f / "foreign").mkdir()
    (f / "foreign" / "mine.txt").write_text("mine")
    (f / "sub" / "x.gguf").mkdir(parents=True)  # what `run -o sub/x` would write its GGUF to
    (f / "existing.html").write_text("<html>mine</html>")
    (f / "foreign.db").write_text("not a database, and not slmedge's")
    (f / "calib.jsonl").write_text(json.dumps({"text": "hello " * 50}) + "\n")
    (f / "gold-string.jsonl").write_text(json.dumps({"query": "Q", "choices": ["a", "b"], "gold": "0"}) + "\n")
    (f / "gold-bool.jsonl").write_text(json.dumps({"query": "Q", "choices": ["a", "b"], "gold": True}) + "\n")
    from slmedge.evaluate.api import EvalSettings, Evaluation

    store = ResultsStore(f / "store.sqlite")  # one finished evaluation, for report to have something to show
    ev = Evaluation(str(tiny), EvalSettings(metrics=("memory",), memory_child=False), store)
    try:
        ev.run()
    finally:
        ev.close()
        store.close()
    # This machine's cpu profile is measured once into the cache (as after any first evaluation here):
    # an evaluation opens its target before its model, so a corrupt model would otherwise show up
    # as that measurement being written.
    from slmedge.targets.profiles import get_profile

    with pytest.MonkeyPatch.context() as mp:  # the session's cache (module fixtures run before user_dirs)
        mp.setenv("SLMEDGE_CACHE_DIR", str(session_cache))
        get_profile("cpu")
    art = f / "edited-artifact"
    compress(str(tiny), Recipe(method="rtn", bits=4, group_size=32), art, device="cpu")
    manifest = json.loads((art / "slmedge.json").read_text())
    manifest["recipe"]["bits"] = 8  # the codes are 4-bit: the manifest now lies
    (art / "slmedge.json").write_text(json.dumps(manifest, indent=2))

    t = f / "targets"
    t.mkdir()
    (t / "neg.toml").write_text('transport = "local"\nmemory_bandwidth_gbs = -5\n')
    (t / "teleport.toml").write_text('transport = "teleport"\n')
    (t / "dash.toml").write_text('name = "dash"\ntransport = "ssh"\narch = "aarch64"\nruntimes = ["llama.cpp"]\n'
                                 '[ssh]\nhost = "-oProxyCommand=touch /tmp/slmedge-pwned"\nuser = "pi"\n')
    for name, text in (("nanbw", "memory_bandwidth_gbs = nan"), ("infbw", "memory_bandwidth_gbs = inf"),
                       ("hugebw", "memory_bandwidth_gbs = 1e308"), ("zeroflops", "peak_fp32_gflops = 0"),
                       ("nanint8", "peak_int8_gops = nan"), ("negram", "ram_gb = -1"),
                       ("threads", "cores = 4\nthreads = 8")):
        (t / f"{name}.toml").write_text(f'transport = "local"\n{text}\n')
    (t / "gpulayers.toml").write_text('transport = "cuda"\ngpu_layers = 100000\n')
    ssh = 'transport = "ssh"\narch = "aarch64"\nruntimes = ["llama.cpp"]\n[ssh]\nhost = "pi.local"\nuser = "pi"\n'
    for name, text in (("port", "port = 70000"), ("ctimeout", "connect_timeout_s = -1"),
                       ("cmdtimeout", "command_timeout_s = nan"), ("wd-root", 'workdir = "/"'),
                       ("wd-other", 'workdir = "~root/.ssh"'), ("wd-ssh", 'workdir = ".ssh"'),
                       ("wd-etc", 'workdir = "/etc/slmedge"')):
        (t / f"{name}.toml").write_text(f"{ssh}{text}\n")
    s = f / "studies"
    s.mkdir()
    head = f'models = ["{tiny}"]\n'
    for name, text in (
            ("dotdot", 'name = "../../.."\n' + head + '[[methods]]\nmethod = "none"\n'),
            ("slash", 'name = "a/b"\n' + head + '[[methods]]\nmethod = "none"\n'),
            ("label", head + '[[methods]]\nmethod = "rtn"\nlabel = "../x"\n'),
            ("xlabel", head + '[[methods]]\nmethod = "none"\n[[exports]]\nformat = "gguf"\nlabel = "/etc"\n'),
            ("seed", head + 'seeds = [-1]\n[[methods]]\nmethod = "rtn"\n'),
            ("nsamples", head + '[calibration]\nnsamples = 1000000000\n[[methods]]\nmethod = "gptq"\n'),
            ("damp", head + '[[methods]]\nmethod = "gptq"\ndamp = nan\n'),
            ("calseq", head + '[calibration]\nseqlen = 1024\n[[methods]]\nmethod = "gptq"\n'),
            ("context", head + '[evaluate]\nmetrics = ["memory"]\ncontext = 4096\n[[methods]]\nmethod = "none"\n'),
            ("threads", head + '[evaluate]\nthreads = 1000000\n[[methods]]\nmethod = "none"\n'),
            ("bigcal", head + '[calibration]\nnsamples = 4096\nseqlen = 512\n[evaluate]\nmetrics = ["memory"]\n'
                              '[[methods]]\nmethod = "gptq"\n')):
        (s / f"{name}.toml").write_text(text)
    (s / "badkey.toml").write_text(f'name = "b"\nmodels = ["{tiny}"]\nbogus = 1\n[[methods]]\nmethod = "none"\n')
    (s / "badmethod.toml").write_text(f'name = "m"\nmodels = ["{tiny}"]\n[[methods]]\nmethod = "quantum"\n')
    (s / "syntax.toml").write_text('name = "s"\nmodels = [\n')
    (s / "ok.toml").write_text(f'name = "ok"\nmodels = ["{tiny}"]\n[evaluate]\nmetrics = ["memory"]\n'
                               '[[methods]]\nmethod = "none"\n')
    (s / "nomodel.toml").write_text('name = "x"\nmodels = ["/nonexistent/model"]\n[[methods]]\nmethod = "none"\n')
    (s / "gridbits.toml").write_text(head + '[[methods]]\nmethod = "rtn"\ngrid = "q4_k"\nbits = 3\n')
    (s / "bpwsym.toml").write_text(head + '[[methods]]\nmethod = "gptq"\nbpw = 4.5\nsymmetric = true\n')
    (s / "nogrids.toml").write_text(head + '[[methods]]\nmethod = "gptq"\nbpw = 4.5\nbpw_grids = []\n')
    (s / "wdfile.toml").write_text('workdir = "../existing.html"\n' + head + '[evaluate]\nmetrics = ["memory"]\n'
                                   '[[methods]]\nmethod = "none"\n')
    (f / "short.txt").write_text("A few words, far fewer than one window.\n")
    broken = f / "broken-manifest"  # an artifact whose slmedge.json was cut short
    shutil.copytree(art, broken)
    text = (broken / "slmedge.json").read_text()
    (broken / "slmedge.json").write_text(text[: len(text) // 2])
    return f


def _tree(root: Path) -> dict:
    """Every path under ``root``: files with size and mtime, folders by name (their mtime moves when
    a check probes them for writing; their entries are what counts)."""
    out = {}
    if not root.exists():
        return out
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = ("dir",) if p.is_dir() else ("file", p.stat().st_size, p.stat().st_mtime_ns)
    return out


def _fill(text: str, tiny: Path, f: Path, w: Path) -> str:
    return text.replace("{tiny}", str(tiny)).replace("{f}", str(f)).replace("{w}", str(w))


def _params():
    for case in CASES:
        marks = [pytest.mark.xfail(reason=case.xfail, strict=True)] if case.xfail else []
        yield pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", list(_params()))
def test_bad_input(case: Case, fixtures, tiny_models, session_cache, tmp_path, monkeypatch):
    tiny = tiny_models("llama")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    db = tmp_path / "results.sqlite"
    monkeypatch.setenv("SLMEDGE_RESULTS_DB", str(db))
    monkeypatch.delenv("SLMEDGE_DATA_DIR", raising=False)
    if case.patch is not None:
        case.patch(monkeypatch, fixtures)
    args = [_fill(a, tiny, fixtures, work) for a in case.args]
    roots = {"work": work, "fixtures": fixtures, "tiny": tiny, "cache": Path(session_cache)}
    before = {name: _tree(root) for name, root in roots.items()}

    started = time.perf_counter()
    res = runner.invoke(app, args)
    seconds = time.perf_counter() - started

    out = res.output
    assert "Traceback" not in out and ".slmedge-tmp-" not in out, out
    assert res.exit_code == case.code, f"exit {res.exit_code}, expected {case.code}: {out}"
    if case.usage:
        line = next((ln for ln in res.stderr.splitlines() if "Error" in ln), "")
    elif case.code == INTERRUPTED:
        assert res.stderr.strip() == "interrupted", res.stderr
        line = ""
    else:
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("error:")]
        assert len(errors) == 1, res.stderr
        line = errors[0]
    for word in case.words:
        assert _fill(word, tiny, fixtures, work) in line, line
    for word in case.unwords:
        assert _fill(word, tiny, fixtures, work) not in line, line
    assert "overwrite=True" not in out  # the CLI's advice is spelled as its options
    if case.seconds is not None:
        assert seconds < case.seconds, f"took {seconds:.1f} s"
    after = {name: _tree(root) for name, root in roots.items()}
    for name in roots:
        assert after[name] == before[name], f"{name} changed: " + _diff(before[name], after[name])
    assert not db.exists(), "the results store was created"
    for rel in case.absent:
        assert not (work / rel).exists(), rel


def _diff(a: dict, b: dict) -> str:
    added = sorted(set(b) - set(a))
    removed = sorted(set(a) - set(b))
    changed = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    return f"added {added[:5]}, removed {removed[:5]}, changed {changed[:5]}"


def test_the_table_covers_every_command():
    counts: dict[str, int] = {}
    for case in CASES:
        counts[case.args[0]] = counts.get(case.args[0], 0) + 1
    assert set(counts) >= {"compress", "export", "inspect", "evaluate", "run", "study", "report", "targets", "data",
                           "methods", "imatrix"}
    assert len(CASES) >= 80, counts


# --- what a table case cannot show -------------------------------------------------------------


def _cli(*args, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "slmedge", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, **kw)


def test_an_unreachable_hub_is_said_at_once(tmp_path):
    """No HF_HUB_OFFLINE, a Hub that does not answer (an endpoint nothing listens on, so no test ever
    reaches the real Hub): one line saying so, at once, instead of ~25 s of retries. The time is
    taken once the command line's modules and those the command loads lazily are loaded (their
    import is slow on a busy machine)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    args = ["compress", "nobody/nothing", "-o", str(tmp_path / "out")]
    code = ("import sys, time; from slmedge.cli import main; "
            "import slmedge.compress.api, slmedge.models.source; "  # what the command loads lazily (torch and friends)
            "started = time.perf_counter(); "
            f"sys.argv = ['slmedge', *{args!r}]\n"
            "try:\n    main()\nfinally:\n    print(f'{time.perf_counter() - started:.2f}', flush=True)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)
    err = proc.stderr
    assert proc.returncode == 1, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "cannot reach the Hugging Face Hub to fetch nobody/nothing (no network)" in lines[0], err
    assert "MaxRetryError" not in err and float(proc.stdout.split()[-1]) < 5, (proc.stdout, err)
    assert not (tmp_path / "out").exists()


def test_a_cached_hub_model_loads_without_the_network(tiny_models, tmp_path, monkeypatch):
    """With the Hub out of reach, a model in the local Hugging Face cache is read from there."""
    from slmedge.models import source

    snapshot = tmp_path / "hf" / "hub" / "models--someone--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_models("llama"), snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    no_network(monkeypatch, None)
    src = source.resolve("someone/tiny")
    assert src.kind == "hub" and src.path == snapshot
    loaded = source.load(src)
    assert loaded.identity["id"] == "someone/tiny" and loaded.hf_dir == snapshot
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # asked to stay offline: the cache too, and nothing else
    assert source.resolve("someone/tiny").path == snapshot
    with pytest.raises(source.ModelNotFoundError, match="HF_HUB_OFFLINE is set"):
        source.resolve("someone/other")


@pytest.mark.parametrize("when", ["while loading", "while working"])
def test_ctrl_c_is_one_line_and_130(when, tiny_models, tmp_path):
    """A real SIGINT while the command line's modules import, or in the middle of a compression (sent
    by the process to itself as the calibrated compression starts): one line, ``interrupted``, exit
    130, and nothing left in the output's place."""
    import signal

    def interruptible():  # a job started in the background by a shell inherits SIGINT ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    out = tmp_path / "out"
    args = ["compress", str(tiny_models("llama")), "--method", "gptq", "--nsamples", "8", "--seqlen", "64",
            "--calibration", "c4", "-o", str(out)]
    if when == "while loading":
        proc = _cli(*args, cwd=tmp_path, preexec_fn=interruptible)
        maps = Path(f"/proc/{proc.pid}/maps")
        deadline = time.monotonic() + (60 if maps.parent.parent.is_dir() else 1)  # without /proc: a second
        # Wait until torch's libraries are being mapped: the command line's modules are importing.
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if "torch" in maps.read_text():
                    break
            except OSError:
                pass
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
    else:
        code = ("import os, signal, sys, time\n"
                "import slmedge.compress.api as api\n"
                "def interrupted(*a, **k):\n"
                "    os.kill(os.getpid(), signal.SIGINT)\n"
                "    time.sleep(30)\n"
                "api.compress_model = interrupted\n"
                "from slmedge.cli import main\n"
                f"sys.argv = ['slmedge', *{args!r}]\n"
                "main()\n")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=tmp_path, preexec_fn=interruptible)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".slmedge-tmp-")]

"""Runtimes, transports and metrics are plug-ins: each registry refuses a duplicate name, and a
plug-in registered here (in the test, touching no other module) is reachable from the CLI."""

import json

import pytest
from typer.testing import CliRunner

from slmedge.cli import app
from slmedge.evaluate.api import METRICS, register_metric, unregister_metric
from slmedge.runtimes import LlamaCppRuntime, Runtime
from slmedge.runtimes.registry import RUNTIMES, get_runtime, register_runtime, runtime_for_path, unregister_runtime
from slmedge.targets.registry import TRANSPORTS, register_transport, unregister_transport
from slmedge.targets.transports import LocalTransport

runner = CliRunner()


def test_each_registry_refuses_a_duplicate_name():
    with pytest.raises(ValueError, match="runtime 'torch' registered twice"):
        register_runtime("torch")(type("Again", (Runtime,), {}))
    with pytest.raises(ValueError, match="runtime 'ort' registered twice"):  # an alias counts too
        register_runtime("other", aliases=("ort",))(type("Again", (Runtime,), {}))
    with pytest.raises(ValueError, match="transport 'ssh' registered twice"):
        register_transport("ssh")(type("Again", (LocalTransport,), {}))
    with pytest.raises(ValueError, match="metric 'perplexity' registered twice"):
        register_metric("perplexity")(lambda ev: None)
    assert list(RUNTIMES) == ["torch", "onnxruntime", "llama.cpp", "onnxruntime-genai", "executorch"]
    assert set(TRANSPORTS) == {"local", "emulated", "ssh", "cuda"}
    assert list(METRICS) == ["perplexity", "fidelity", "tasks", "memory", "latency"]


def test_the_registry_answers_what_name_checks_did():
    assert runtime_for_path("m.gguf") == "llama.cpp" and runtime_for_path("m.onnx") == "onnxruntime"
    assert runtime_for_path("some/folder") == "torch"
    assert get_runtime("LlamaCpp").name == "llama.cpp" and get_runtime("ort").name == "onnxruntime"
    assert get_runtime("llama.cpp").kv_bytes_per_value == 2 and get_runtime("onnxruntime").export_format == "onnx"


@pytest.fixture
def plugins():
    opened = []

    @register_runtime("fake", export_format="gguf", package="llama-cpp-python", install="pip install fake")
    class FakeRuntime(LlamaCppRuntime):
        """llama.cpp under another name, counting what it opens."""

        def __init__(self, path, *a, **k):
            opened.append(("runtime", str(path)))
            super().__init__(path, *a, **k)

    @register_transport("loopback")
    class Loopback(LocalTransport):
        def open_runtime(self, runtime, path, threads, n_ctx):
            opened.append(("transport", runtime))
            return super().open_runtime(runtime, path, threads, n_ctx)

    @register_metric("token_count")
    def token_count(ev):
        n = len(ev.sub.encoder.encode("one two three four"))
        ev.results["metrics"]["token_count"] = {"tokens": n}
        ev._row("token_count", n, "probe", None, "tokens")

    yield opened
    unregister_runtime("fake")
    unregister_transport("loopback")
    unregister_metric("token_count")


def test_a_fake_runtime_transport_and_metric_are_reachable_from_the_cli(plugins, tiny_models, tmp_path, monkeypatch):
    model = str(tiny_models("llama"))
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["evaluate", model, "--runtime", "fake", "--metrics", "perplexity,token_count",
                              "--no-wikitext", "--langs", "en", "--seqlen", "32", "--ppl-windows", "1",
                              "--json", str(out), "--results-db", str(tmp_path / "db.sqlite")])
    assert res.exit_code == 0, res.output
    got = json.loads(out.read_text())
    assert got["runtime"] == "fake" and got["metrics"]["token_count"]["tokens"] > 0
    assert got["metrics"]["perplexity"]["en"]["tokens"] == 31
    assert plugins and plugins[0][0] == "runtime" and plugins[0][1].endswith(".gguf")  # the cached GGUF export

    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "lo.toml").write_text('transport = "loopback"\nruntimes = ["fake", "torch"]\n')
    monkeypatch.setenv("SLMEDGE_TARGETS", str(profiles))
    res = runner.invoke(app, ["evaluate", model, "--target", "lo", "--runtime", "fake", "--metrics", "token_count",
                              "--json", str(out), "--results-db", str(tmp_path / "db.sqlite")])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["target"] == "lo" and ("transport", "fake") in plugins

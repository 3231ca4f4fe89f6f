"""llama.cpp's AMX kernels: a build with them compiled in loads models without its extra buffer types.

On some machines with AMX (this project's VMs among them) llama.cpp's AMX matmul crashes the whole
process with SIGSEGV at the first batch of a few tokens (ggml-org/llama.cpp#20824);
``backends.llamacpp.load_llama`` keeps such builds on the generic kernels.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import require_import


@pytest.fixture
def binding(monkeypatch):
    llama_cpp = require_import("llama_cpp", "llama-cpp-python is not installed (scripts/setup.sh installs it)")
    from slmedge.backends import llamacpp

    real = llamacpp.amx_compiled  # (tests replace it; the cached answer is the real one's)
    real.cache_clear()
    yield llama_cpp, llamacpp
    real.cache_clear()


class _Recorder:
    """Stands in for ``llama_cpp.Llama``: records the model parameters the binding would load with."""

    seen: list = []

    def __init__(self, model_path, **kwargs):
        import llama_cpp

        _Recorder.seen.append((model_path, kwargs, llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts))


def test_system_info_decides_whether_amx_is_compiled(binding, monkeypatch):
    llama_cpp, llamacpp = binding
    line = b"CPU : SSE3 = 1 | AVX512 = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | REPACK = 1 | "
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: line)
    assert llamacpp.amx_compiled()
    llamacpp.amx_compiled.cache_clear()
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: line.replace(b"AMX_INT8 = 1 | ", b""))
    assert not llamacpp.amx_compiled()


@pytest.mark.parametrize("amx, env, expected", [(True, None, False), (True, "1", True), (False, None, True)])
def test_extra_buffers_off_only_for_amx_builds(binding, monkeypatch, amx, env, expected):
    llama_cpp, llamacpp = binding
    monkeypatch.setattr(llamacpp, "amx_compiled", lambda: amx)
    if env is None:
        monkeypatch.delenv(llamacpp.AMX_ENV, raising=False)
    else:
        monkeypatch.setenv(llamacpp.AMX_ENV, env)
    monkeypatch.setattr(llama_cpp, "Llama", _Recorder)
    _Recorder.seen = []
    defaults = llama_cpp.llama_cpp.llama_model_default_params
    llamacpp.load_llama("m.gguf", n_ctx=64, verbose=False)
    assert _Recorder.seen == [("m.gguf", {"n_ctx": 64, "verbose": False}, expected)]
    assert llamacpp.extra_buffers() is expected
    # The binding's own defaults are untouched afterwards.
    assert llama_cpp.llama_cpp.llama_model_default_params is defaults
    assert defaults().use_extra_bufts is True


def test_defaults_restored_when_the_load_fails(binding, monkeypatch):
    llama_cpp, llamacpp = binding
    monkeypatch.setattr(llamacpp, "amx_compiled", lambda: True)
    monkeypatch.delenv(llamacpp.AMX_ENV, raising=False)
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def broken(model_path, **kwargs):
        raise ValueError("Failed to load model from file")

    monkeypatch.setattr(llama_cpp, "Llama", broken)
    with pytest.raises(ValueError):
        llamacpp.load_llama("bad.gguf")
    assert llama_cpp.llama_cpp.llama_model_default_params is defaults


def test_quantized_gguf_evaluates_a_batch_in_a_fresh_process(binding, tiny_models, tmp_path):
    """A Q8_0 and a Q4_0 file (the types llama.cpp's AMX kernels take) scored through slmedge's
    runtime in a child process: on an AMX machine whose AMX kernels crash, an unguarded load dies
    with SIGSEGV here (seen: both files, 32 tokens)."""
    from slmedge.export.gguf import export_gguf

    for qtype in ("q8_0", "q4_0"):
        path = tmp_path / f"m-{qtype}.gguf"
        export_gguf(tiny_models("llama"), path, qtype)
        code = ("import sys\n"
                "from slmedge.runtimes.llamacpp_runtime import LlamaCppRuntime\n"
                f"rt = LlamaCppRuntime({str(path)!r}, threads=2, n_ctx=64)\n"
                "logits = rt.logits(list(range(3, 35)))\n"
                "assert logits.shape[0] == 32 and (logits == logits).all()\n"
                "print('ok', rt.info()['extra_buffers'])\n")
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"{qtype}: exit {run.returncode} (negative: killed by that signal)\n{run.stderr[-2000:]}"
        assert run.stdout.split()[:1] == ["ok"]

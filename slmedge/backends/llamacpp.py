"""llama.cpp's Python binding, loaded without torch (this module also runs on targets)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import threading

from ..errors import CorruptModelError, RuntimeNotInstalledError
from ..procs import native

# llama.cpp's AMX kernels crash some machines that have AMX. A build made where the CPU has AMX-INT8
# (Sapphire Rapids and later Xeons, common in clouds) puts the quantized weights in the "AMX" extra
# buffer type, and on some such machines ggml_backend_amx_mul_mat then dies with SIGSEGV at the first
# batch of more than a few tokens (ggml-org/llama.cpp#20824, open; ollama and dspy saw it on cloud
# VMs). Here, on a 2-core VM on 2026-12-04, SmolLM2's Q4_1 file evaluated 1 token and crashed on 5.
# A segfault ends the whole process without a word, so such a build loads its models without the
# extra buffer types (llama_model_params.use_extra_bufts), the generic CPU kernels instead; set this
# variable to 1 to keep them where AMX is known to work. scripts/setup.sh builds llama-cpp-python
# without AMX, so this rarely applies there, and llama.cpp's other repacked kernels stay on.
AMX_ENV = "SLMEDGE_LLAMACPP_AMX"
_PARAMS_LOCK = threading.Lock()


def require_llama_cpp():
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise RuntimeNotInstalledError(
            "llama.cpp's Python binding is not installed: pip install llama-cpp-python"
        ) from exc
    _close_bindings_null_files_at_exit()
    return llama_cpp


@functools.cache
def amx_compiled() -> bool:
    """Whether the loaded llama.cpp library has its AMX kernels compiled in (its system info says so)."""
    info = require_llama_cpp().llama_print_system_info()
    text = info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info)
    return "AMX_INT8 = 1" in text


def extra_buffers() -> bool:
    """Whether models load with llama.cpp's extra buffer types (AMX, repacked weights): not where
    AMX is compiled in, unless ``SLMEDGE_LLAMACPP_AMX=1`` (see AMX_ENV)."""
    return not amx_compiled() or os.environ.get(AMX_ENV) == "1"


def load_llama(path, **kwargs):
    """``llama_cpp.Llama(model_path=path, **kwargs)``, without the extra buffer types where
    ``extra_buffers()`` says so. Every load of a model's weights goes through here.

    ``Llama`` takes no such argument: it fills its model parameters from the binding's
    ``llama_model_default_params()``, so that function answers with ``use_extra_bufts`` off for
    the duration of this one call (under a lock; restored however the load ends)."""
    llama_cpp = require_llama_cpp()
    with native("llama.cpp", path):
        return _load(llama_cpp, path, kwargs)


def _load(llama_cpp, path, kwargs: dict):
    if extra_buffers():
        return llama_cpp.Llama(model_path=str(path), **kwargs)
    low = llama_cpp.llama_cpp
    defaults = low.llama_model_default_params

    def without_extra_buffers():
        params = defaults()
        if any(field[0] == "use_extra_bufts" for field in type(params)._fields_):  # older bindings lack the field
            params.use_extra_bufts = False
        return params

    with _PARAMS_LOCK:
        low.llama_model_default_params = without_extra_buffers
        try:
            return llama_cpp.Llama(model_path=str(path), **kwargs)
        finally:
            low.llama_model_default_params = defaults


@functools.cache
def _close_bindings_null_files_at_exit() -> None:
    """llama-cpp-python opens two os.devnull files at import and never closes them, so every
    command that used it ended with two "ResourceWarning: unclosed file" lines; close them at exit."""
    utils = sys.modules.get("llama_cpp._utils")
    files = [getattr(utils, name, None) for name in ("outnull_file", "errnull_file")]
    atexit.register(lambda: [f.close() for f in files if f is not None and not f.closed])


@contextlib.contextmanager
def quiet_native_stderr():
    """Silence what llama.cpp's C code prints on fd 2 even with verbose=False."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (e.g. captured by a test runner)
        yield
        return
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


@contextlib.contextmanager
def vocab_only(gguf_path):
    """llama.cpp's vocabulary and metadata of a GGUF file, without its weights; closed afterwards.
    A file llama.cpp cannot read raises ValueError on entry."""
    llama_cpp = require_llama_cpp()
    with quiet_native_stderr(), native("llama.cpp", gguf_path):
        llm = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    try:
        yield llm
    finally:
        llm.close()


def gguf_metadata(path) -> dict:
    """A GGUF file's key/values through llama.cpp's reader (vocabulary only: fast, unlike a full
    Python parse of the tokenizer arrays)."""
    try:
        with vocab_only(path) as llm:
            return dict(llm.metadata)
    except ValueError as exc:
        raise CorruptModelError(f"llama.cpp cannot read {path}: not a valid GGUF model") from exc

"""llama.cpp's Python binding, loaded without torch (this module also runs on targets)."""

from __future__ import annotations

import contextlib
import os
import sys

from ..errors import RuntimeNotInstalledError


def require_llama_cpp():
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise RuntimeNotInstalledError(
            "llama.cpp's Python binding is not installed: pip install llama-cpp-python"
        ) from exc
    return llama_cpp


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
    with quiet_native_stderr():
        llm = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    try:
        yield llm
    finally:
        llm.close()

"""The runtimes a model is scored and timed in, behind one interface (``base.Runtime``), each in
its own module and registered by name (``registry``): torch, onnxruntime, llama.cpp, and a
runner on a target (``remote``). Importing this package registers the built-in ones; their
engines (torch, onnxruntime, llama.cpp) are imported only when a model is opened."""

from __future__ import annotations

from ..backends.llamacpp import gguf_metadata  # noqa: F401
from ..errors import CorruptModelError  # noqa: F401
from .base import GenerationTiming, Runtime, RuntimeInfo, _token_scores  # noqa: F401
from .registry import (RUNTIMES, RuntimeSpec, check_runtime_name, file_runtime, get_runtime,  # noqa: F401
                       register_runtime, runtime_for_path, runtime_names, source_runtime)

# Registered in this order, the order every list of runtimes shows: torch, onnxruntime, llama.cpp.
from .torch_runtime import TorchRuntime, torch_tanh_cap  # noqa: F401,E402  isort:skip
from .onnx_runtime import OnnxRuntime  # noqa: F401,E402  isort:skip
from .llamacpp_runtime import LlamaCppRuntime  # noqa: F401,E402  isort:skip
from .genai_runtime import GenaiRuntime  # noqa: F401,E402  isort:skip
from .executorch_runtime import ExecuTorchRuntime  # noqa: F401,E402  isort:skip

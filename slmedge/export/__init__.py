"""Exporters: the artifact directory (or a plain HF folder) to the files edge runtimes load.

Each format registers itself where its writer is defined (``formats.register_format``);
importing this package registers the built-in ones: GGUF (llama.cpp) and ONNX (onnxruntime).
"""

from . import ort_genai  # noqa: F401,I001  (registration; first: its folders hold a .onnx model too)
from . import gguf, onnx  # noqa: F401  (registration)
from . import compressed_tensors  # noqa: F401  (registration)
from . import executorch  # noqa: F401  (registration; executorch itself is imported when used)
from .errors import (ExportError, ExportVerificationError, GGUFExportError, GGUFVerificationError, ONNXExportError,
                     ONNXVerificationError)
from .formats import FORMATS, ExportFormat, get_format, register_format, unregister_format
from .gguf import export_gguf
from .onnx import export_onnx

__all__ = ["FORMATS", "ExportError", "ExportFormat", "ExportVerificationError", "GGUFExportError",
           "GGUFVerificationError", "ONNXExportError", "ONNXVerificationError", "export_gguf", "export_onnx",
           "get_format", "register_format", "unregister_format"]

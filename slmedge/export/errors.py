"""The errors exporters raise (re-exported by ``slmedge.export``).

They live in their own module, below every exporter, so the exporters import them without
importing the package that registers the exporters."""

from ..errors import SlmedgeError


class ExportError(SlmedgeError):
    """An export cannot be written as asked (unsupported type, architecture or tokenizer)."""


class ExportVerificationError(ExportError):
    """The written export disagrees with the model it was written from (its runtime's logits vs
    torch's on the probe); nothing is left at the output path."""


class GGUFExportError(ExportError):
    """A GGUF export cannot be written as asked (or the codes cannot be kept with exact=True)."""


class GGUFVerificationError(GGUFExportError, ExportVerificationError):
    """The written GGUF disagrees with the model it was written from (llama.cpp vs torch logits,
    or llama.cpp tokenizes differently); nothing is left at the output path."""


class ONNXExportError(ExportError):
    """An ONNX export cannot be written as asked."""


class ONNXVerificationError(ONNXExportError, ExportVerificationError):
    """onnxruntime's logits of the written file disagree with torch's of its source."""

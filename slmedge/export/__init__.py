"""Exporters: the artifact directory (or a plain HF folder) to the files edge runtimes load."""

from ..errors import SlmedgeError


class ExportError(SlmedgeError):
    """An export cannot be written as asked (unsupported type, architecture or tokenizer)."""


class GGUFExportError(ExportError):
    """A GGUF export cannot be written as asked (or the codes cannot be kept with exact=True)."""


class GGUFVerificationError(GGUFExportError):
    """The written GGUF disagrees with the model it was written from (llama.cpp vs torch logits,
    or llama.cpp tokenizes differently); nothing is left at the output path."""


def export_gguf(*args, **kwargs):
    from .gguf import export_gguf as _export

    return _export(*args, **kwargs)


__all__ = ["ExportError", "GGUFExportError", "GGUFVerificationError", "export_gguf"]

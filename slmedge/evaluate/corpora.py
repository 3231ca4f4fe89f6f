"""Evaluation corpora: WikiText-2 and NTREX-128 (shipped, or from a ``--data-dir`` laid over them), or a
user's text file."""

from __future__ import annotations

from pathlib import Path

from ..errors import DataError
from ..data.files import data_files


def ntrex_languages(data=None) -> list[str]:
    return data_files(data).names("perplexity/ntrex128", ".txt")


def load_corpus(name: str, data=None) -> str:
    """``wikitext2``, ``ntrex128:<lang>`` (or a bare language code), or a path to a text file."""
    path = Path(name).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{path} is not UTF-8 text") from exc
    files = data_files(data)
    if name == "wikitext2":
        # The HF split's rows joined by a blank line, as GPTQ and llm-compressor evaluate it.
        lines = files.path("perplexity/wikitext2/test.txt").read_text(encoding="utf-8").splitlines()
        return "\n\n".join(lines)
    lang = name.split(":", 1)[1] if name.startswith("ntrex128:") else name
    file = files.find(f"perplexity/ntrex128/{lang}.txt") if lang and "/" not in lang else None
    if file is not None:
        return file.read_text(encoding="utf-8")
    raise DataError(
        f"unknown corpus '{name}': give wikitext2, a language of NTREX-128 ({', '.join(ntrex_languages(data))}) "
        "or a text file"
    )

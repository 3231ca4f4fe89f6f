"""Evaluation corpora: WikiText-2 and NTREX-128 from the data folder, or a user's text file."""

from __future__ import annotations

from pathlib import Path

from ..errors import DataError
from ..paths import data_dir


def ntrex_languages(data=None) -> list[str]:
    folder = data_dir(data) / "perplexity" / "ntrex128"
    return sorted(p.stem for p in folder.glob("*.txt"))


def load_corpus(name: str, data=None) -> str:
    """``wikitext2``, ``ntrex128:<lang>`` (or a bare language code), or a path to a text file."""
    path = Path(name).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{path} is not UTF-8 text") from exc
    root = data_dir(data)
    if name == "wikitext2":
        # The HF split's rows joined by a blank line, as GPTQ and llm-compressor evaluate it.
        lines = (root / "perplexity" / "wikitext2" / "test.txt").read_text(encoding="utf-8").splitlines()
        return "\n\n".join(lines)
    lang = name.split(":", 1)[1] if name.startswith("ntrex128:") else name
    file = root / "perplexity" / "ntrex128" / f"{lang}.txt"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    raise DataError(
        f"unknown corpus '{name}': give wikitext2, a language of NTREX-128 ({', '.join(ntrex_languages(data))}) "
        "or a text file"
    )

"""Calibration data: named sets from the data folder, local files, Hub datasets.

A spec is one of:
- ``c4``: the C4 (en) sample ``calibration/c4_en.jsonl`` (shipped; a ``--data-dir`` may replace it);
- ``multilingual`` or ``multilingual:de,fr``: the sentences in ``calibration/multilingual``;
- a ``.jsonl`` file (a ``text`` field per line) or any other text file;
- ``hf:DATASET[:CONFIG][:SPLIT]``: a Hugging Face dataset with a ``text`` column (needs
  ``pip install datasets`` and a network);
- several of these joined by ``+`` (``c4+multilingual``): a mix, each part an equal share of the windows.

Sampling: each source's documents are tokenized in file order and joined by a blank line, and
``nsamples`` windows of ``seqlen`` tokens start at positions drawn by ``random.Random(seed)``. The
parts of a mix take turns window by window, and within ``multilingual`` the languages take turns:
every part and language gets an equal share of the windows (±1), whatever its token count (a
language its tokenizer splits finely would otherwise fill most windows). ``c4``, a file or a Hub
dataset is one stream, sampled uniformly. The same spec, seed and tokenizer give the same token ids,
byte for byte.

A tokenizer that puts BOS before a text (Gemma's, Llama 3's) gets BOS as each window's first token
and ``seqlen - 1`` tokens of text after it: the model is calibrated on what it sees in use, and on
what ``llama-imatrix`` feeds it (it puts BOS first in each chunk). Without it, a BOS model's first
position becomes the attention sink, with activations unlike any in use, and every calibrated
method fits them.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DataError, RuntimeNotInstalledError, UnknownDataError, brief
from ..fsutil import iter_jsonl, sha256_file
from ..paths import given_path
from .files import data_files, file_sha256


@dataclass
class CalibrationSet:
    tokens: torch.Tensor  # (nsamples, seqlen) int64
    identity: dict


SPEC_CHOICES = "give c4, multilingual[:LANGS], a .txt/.jsonl file, hf:DATASET, or several joined by +"


def spec_parts(spec: str) -> list[str]:
    """The parts of a mix (``c4+multilingual``); one part for any other spec (a file whose name has
    a ``+`` in it included)."""
    if "+" not in spec or Path(spec).expanduser().is_file():
        return [spec]
    pieces, parts, i = spec.split("+"), [], 0
    while i < len(pieces):  # the longest run of pieces that names an existing file is one part
        j = next((j for j in range(len(pieces), i + 1, -1) if Path("+".join(pieces[i:j])).expanduser().is_file()), i + 1)
        parts.append("+".join(pieces[i:j]).strip())
        i = j
    if any(not part for part in parts):
        raise UnknownDataError(f"calibration data '{spec}' has an empty part: {SPEC_CHOICES}")
    return parts


def shared_spec(spec: str) -> str:
    """A calibration spec as files meant for others record it (an artifact's recipe and calibration, an
    importance matrix): each part naming a user's file as typed when that path is relative, else by its
    name (``paths.given_path``); names (``c4``, ``multilingual:...``) and ``hf:`` datasets as they are.
    The file's sha256 is recorded beside it (``read_sources``)."""
    def shared(part: str) -> str:
        name = part.partition(":")[0]
        return part if part.startswith("hf:") or name in ("c4", "multilingual") else given_path(part)

    return "+".join(shared(p) for p in spec_parts(spec))


def calibration_sources(spec: str, data: str | Path | None = None) -> tuple[str, object]:
    """Where a calibration spec's text comes from, without reading it: ``("hub", dataset)``,
    ``("file", path)`` for a user file, ``("data", [relative paths])`` in the data (shipped, or
    the ``--data-dir`` overlay), or ``("mix", [each part's sources])``. An unknown name is a bad
    setting; a missing file a missing input."""
    parts = spec_parts(spec)
    if len(parts) > 1:
        return "mix", [calibration_sources(part, data) for part in parts]
    if spec.startswith("hf:"):
        return "hub", spec[3:]
    path = Path(spec).expanduser()
    if path.is_file():
        return "file", path
    name, _, arg = spec.partition(":")
    if not (name == "c4" and not arg) and name != "multilingual":
        choices = SPEC_CHOICES
        if path.exists() or "/" in spec or path.suffix.lower() in (".txt", ".jsonl", ".json"):  # a file: missing input
            what = "is not a file" if path.exists() else "does not exist"
            raise DataError(f"calibration file {spec} {what}; {choices}")
        raise UnknownDataError(f"calibration data '{spec}' not found: {choices}")  # a name: a bad setting
    if name == "c4":
        return "data", ["calibration/c4_en.jsonl"]
    available = data_files(data).names("calibration/multilingual", ".txt")
    langs = [lang.strip() for lang in arg.split(",") if lang.strip()] if arg else available
    unknown = [lang for lang in langs if lang not in available]
    if unknown:
        raise UnknownDataError(f"no multilingual calibration text for {', '.join(unknown)}; available: {', '.join(available)}")
    return "data", [f"calibration/multilingual/{lang}.txt" for lang in langs]


def read_sources(spec: str, data: str | Path | None = None, text_field: str = "text") -> tuple[list[list[list[str]]], dict]:
    """The documents a spec names, grouped as sampling takes turns over them: one group per part of
    a mix, and in a group one list of documents per source (a language of ``multilingual``; the
    whole file otherwise). With where they came from (file hashes; a Hub dataset's identity)."""
    groups, origin = [], {}
    for part in spec_parts(spec):
        kind, where = calibration_sources(part, data)
        if kind == "hub":
            texts, hub = _hub_texts(where, text_field)
            groups.append([texts])
            origin.setdefault("datasets", []).append(hub)
        elif kind == "file":
            groups.append([_file_texts(where, text_field)])
            files = origin.setdefault("files", {})
            key = given_path(part)  # as typed when relative, else the name: no absolute path for others
            files[key if key not in files else f"{key} ({len(files) + 1})"] = sha256_file(where)
        else:
            files = data_files(data)
            group = []
            for rel in where:
                f = files.path(rel)
                group.append(_file_texts(f, text_field))
                origin.setdefault("files", {})[rel] = file_sha256(f)
            groups.append(group if part.partition(":")[0] == "multilingual" else [sum(group, [])])
    if len(origin.get("datasets", [])) == 1 and len(groups) == 1:
        origin = origin["datasets"][0]  # one Hub dataset: its identity (name, config, split, fingerprint)
    return groups, origin


def read_texts(spec: str, data: str | Path | None = None, text_field: str = "text") -> tuple[list[str], dict]:
    """The documents a spec names (every source's, in order), and where they came from."""
    groups, origin = read_sources(spec, data, text_field)
    return [doc for group in groups for source in group for doc in source], origin


def _file_texts(path: Path, text_field: str) -> list[str]:
    if path.suffix.lower() == ".jsonl":
        texts = []
        for lineno, record in iter_jsonl(path):
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise DataError(f"{path}:{lineno} has no string field '{text_field}'")
            texts.append(record[text_field])
        return texts
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text") from exc
    return [line for line in raw.splitlines() if line.strip()]


def check_hub(spec: str) -> None:
    """Refuse at once (DataError) a spec with a Hub dataset when the Hub cannot be reached and
    HF_HUB_OFFLINE is not set: one line, instead of the datasets library's retries (tens of seconds)."""
    from ..hub import hub_offline_setting, hub_reachable

    for part in spec_parts(spec):
        if part.startswith("hf:") and not hub_offline_setting() and not hub_reachable():
            raise DataError(f"cannot reach the Hugging Face Hub to fetch calibration data '{part}' (no network); "
                            "give a .txt/.jsonl file, or set HF_HUB_OFFLINE=1 to use a cached copy")


def _hub_texts(spec: str, text_field: str) -> tuple[list[str], dict]:
    check_hub(f"hf:{spec}")
    try:
        import datasets
    except ImportError as exc:
        raise RuntimeNotInstalledError("Hub calibration datasets need the datasets package: pip install datasets") from exc
    parts = spec.split(":")
    name = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 else "train"
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:
        raise DataError(f"cannot load dataset '{name}' from the Hugging Face Hub: {brief(exc)}") from exc
    if text_field not in ds.column_names:
        raise DataError(f"dataset '{name}' has no '{text_field}' column (columns: {', '.join(ds.column_names)})")
    return [t for t in ds[text_field] if t and t.strip()], {"dataset": name, "config": config, "split": split,
                                                             "fingerprint": getattr(ds, "_fingerprint", None)}


def adds_bos(tokenizer) -> bool:
    """Whether ``tokenizer`` puts BOS before a text when asked for its special tokens, by what it does,
    not by its ``add_bos_token`` attribute (transformers 5's Gemma tokenizer adds BOS through its
    post-processor while that attribute reads False)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    full = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return full[:1] == [bos] and full[1:] == plain


def token_stream(tokenizer, texts: list[str], max_tokens: int | None = None) -> list[int]:
    """Token ids of the documents joined by a blank line (no special tokens)."""
    sep = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    chunk = 256
    for start in range(0, len(texts), chunk):
        for doc in tokenizer(texts[start : start + chunk], add_special_tokens=False, verbose=False)["input_ids"]:
            if ids:
                ids.extend(sep)
            ids.extend(doc)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    return ids


def load_calibration(
    spec: str, tokenizer, nsamples: int, seqlen: int, seed: int = 0, data: str | Path | None = None, text_field: str = "text"
) -> CalibrationSet:
    groups, origin = read_sources(spec, data, text_field)
    streams = [[token_stream(tokenizer, texts) for texts in group] for group in groups]
    lead = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
    text_len = seqlen - len(lead)  # the text tokens of a window
    parts = spec_parts(spec)
    for part, group in zip(parts, streams):
        for k, ids in enumerate(group):
            if len(ids) < text_len + 1:
                what = f"calibration data '{spec}'" if len(streams) == 1 and len(group) == 1 else (
                    f"calibration data '{part}'" if len(group) == 1 else  # a language of multilingual: named
                    f"the {Path(calibration_sources(part, data)[1][k]).stem} text of calibration data '{part}'")
                raise DataError(f"{what} has {len(ids)} tokens; one sample needs {text_len}")
    rng = random.Random(seed)
    taken = [0] * len(streams)  # windows each part has had: the parts, and a part's sources, take turns
    rows = []
    for i in range(nsamples):
        g = i % len(streams)
        ids = streams[g][taken[g] % len(streams[g])]
        taken[g] += 1
        start = rng.randrange(0, len(ids) - text_len + 1)
        rows.append(lead + ids[start : start + text_len])
    tokens = torch.tensor(rows, dtype=torch.long)
    identity = {
        "spec": shared_spec(spec),
        **origin,
        "nsamples": nsamples,
        "seqlen": seqlen,
        "seed": seed,
        "bos": bool(lead),
        "stream_tokens": sum(len(ids) for group in streams for ids in group),
        "tokens_sha256": hashlib.sha256(tokens.numpy().tobytes()).hexdigest(),
    }
    return CalibrationSet(tokens, identity)

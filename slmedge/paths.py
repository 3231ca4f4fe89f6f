"""User directories, resolved in one place (the data folder: ``slmedge.data.files``).

Every location can be moved by an environment variable so that tests (and users with odd
machines) never write into the real home directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from platformdirs import user_cache_dir

CACHE_ENV = "SLMEDGE_CACHE_DIR"


def cache_dir() -> Path:
    """Where converted models and other reusable work live (``$SLMEDGE_CACHE_DIR``)."""
    path = Path(os.environ.get(CACHE_ENV) or user_cache_dir("slmedge"))
    path.mkdir(parents=True, exist_ok=True)
    return path


# --- local paths in files meant for others ------------------------------------------------------
# What slmedge writes for others (an artifact's manifest, an export's, an importance matrix, a report)
# names a local file by a path relative to the folder of the file naming it, or by its name, with a
# content hash beside it where it must be found or checked again: never by an absolute path, which
# would carry the user's home, user name and folder layout to whoever gets the file.


def relative_path(target, anchor) -> str | None:
    """``target`` (a local file or folder) as a path relative to the folder ``anchor`` (where the file
    naming it is written), ``..`` included, in ``/`` form; None where such a path would spell out the
    absolute one: the two share no folder below the filesystem root, or the path would descend into
    the user's home folder from above it (``../../home/NAME/...``)."""
    t = Path(os.path.abspath(Path(target).expanduser()))
    a = Path(os.path.abspath(Path(anchor).expanduser()))
    try:
        common = Path(os.path.commonpath([t, a]))
    except ValueError:  # different drives
        return None
    home = Path(os.path.abspath(Path.home()))
    if common == Path(common.anchor) or (common in home.parents and (t == home or home in t.parents)):
        return None
    return Path(os.path.relpath(t, a)).as_posix()


def resolve_recorded(recorded: str | None, anchor) -> Path | None:
    """The local path a file's record names (``relative_path``'s form, relative to the folder ``anchor``
    holding that file; an absolute one as earlier versions wrote it), if it is there; else None."""
    if not recorded:
        return None
    path = Path(recorded).expanduser()
    path = path if path.is_absolute() else Path(anchor) / path
    return path if path.exists() else None


def given_path(path) -> str:
    """How a file the user named is recorded for others: the path as given when it is relative and stays
    below the working folder (``data/corpus.txt``), else its name."""
    p = Path(str(path))
    if not p.is_absolute() and not str(path).startswith("~") and ".." not in p.parts:
        return p.as_posix()
    return p.name


def shareable_source(identity: dict | None, anchor) -> dict | None:
    """A model source's identity (``models.source.load``'s: kind, path, weights sha256...) as a file meant
    for others records it, written in the folder ``anchor``: a local ``path`` becomes relative to
    ``anchor`` (left out where that would spell the absolute path), and the folder's or file's ``name``
    is kept beside the content hashes, so a reader finds it again (``resolve_recorded``) or the user
    names it."""
    if not isinstance(identity, dict) or not identity.get("path"):
        return identity
    where = os.path.normpath(os.path.abspath(Path(identity["path"]).expanduser()))
    out = {k: v for k, v in identity.items() if k != "path"}
    out.setdefault("name", Path(where).name)
    rel = relative_path(where, anchor)
    if rel is not None:
        out["path"] = rel
    nested = out.get("base_model")
    if isinstance(nested, dict) and nested.get("path"):  # an artifact compressed again: its own base, re-anchored
        out["base_model"] = shareable_source({**nested, "path": str(Path(where) / nested["path"])}, anchor)
    return out


def recorded_path(target, anchor) -> str:
    """How a file meant for others, in the folder ``anchor``, records the local file or folder it was made
    from (an export's ``source``): ``relative_path``, else its name (found again by ``resolve_recorded``
    only where it is, and checked against the hash recorded beside it)."""
    rel = relative_path(target, anchor)
    return rel if rel is not None else Path(os.path.normpath(os.path.abspath(target))).name


# An absolute path inside a text (a note, a model spec): "/" after a start, a space or an opening mark,
# up to a space, a quote or a closing mark; trailing sentence punctuation is not part of it.
_ABSOLUTE_IN_TEXT = re.compile(r"(?:^|(?<=[\s'\"`(\[{=]))(/[^\s'\"`()\[\]{}<>,;]+)")


def shareable_record(data, anchor, known=()):
    """A results record (``evaluate --json``'s dict) as a file in the folder ``anchor`` records it for
    others: every absolute local path in it, a value of its own or inside a note, named as
    ``recorded_path`` names it (relative to ``anchor``, else by its name). A path is one of ``known``
    (the model's, the reference's) or one that exists on this machine; other text stays as it is."""
    known = sorted({os.path.normpath(str(p)) for p in known if p and os.path.isabs(str(p))}, key=len, reverse=True)

    def local(path: str) -> bool:
        return any(path == k or path.startswith(k.rstrip("/") + "/") for k in known) or os.path.lexists(path)

    def text(s: str) -> str:
        def one(m: re.Match) -> str:
            path = m.group(1)
            tail = ""
            while path and path[-1] in ".:!?":  # the end of a sentence, not of the path
                path, tail = path[:-1], path[-1] + tail
            if len(path) < 2 or not local(path):
                return m.group(0)
            return recorded_path(path, anchor) + tail

        return _ABSOLUTE_IN_TEXT.sub(one, s)

    def walk(v):
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        return text(v) if isinstance(v, str) else v

    return walk(data)

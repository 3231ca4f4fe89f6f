"""Every number slmedge takes has a range declared in slmedge/limits.py (issue 41, part 1).

The command line is walked as typer builds it: every parameter of every command and sub-command
whose annotation is a number (or a list of numbers, spelled as text) must be declared with ``cli.common.bounded``
and map to an entry of ``LIMITS``; a new numeric option without one fails here."""

from __future__ import annotations

import inspect
import math
import typing

import pytest
import typer.main

from slmedge import limits
from slmedge.cli import app
from slmedge.errors import ConfigError

# Text options that hold numbers (comma-separated lists): held to a range like the numeric ones.
NUMBER_TEXT_OPTIONS = {("report", "under_mb"), ("report", "above_tps")}


def _commands(group, prefix=()):
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from _commands(cmd, prefix + (name,))
        else:
            yield prefix + (name,), cmd


def _is_number(annotation) -> bool:
    if annotation in (int, float):
        return True
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return typing.get_origin(annotation) is typing.Union and len(args) == 1 and args[0] in (int, float)


def _numeric_params():
    root = typer.main.get_command(app)
    for path, cmd in _commands(root):
        fn = inspect.unwrap(cmd.callback)
        hints = typing.get_type_hints(fn)
        for name in inspect.signature(fn).parameters:
            if _is_number(hints.get(name)) or (path[-1], name) in NUMBER_TEXT_OPTIONS:
                yield path, cmd, name


def test_the_walk_finds_the_numeric_options():
    found = {(" ".join(path), name) for path, _, name in _numeric_params()}
    # A sample of what must be there: the walk itself is tested, so an empty walk cannot pass.
    for expected in [("compress", "nsamples"), ("compress", "awq_grid"), ("evaluate", "context"),
                     ("evaluate", "threads"), ("export", "block_size"), ("study", "workers"),
                     ("report", "under_mb"), ("run", "seqlen")]:
        assert expected in found, expected
    assert len(found) >= 30


@pytest.mark.parametrize("path,param", sorted({(" ".join(path), name) for path, _, name in _numeric_params()}))
def test_every_numeric_option_has_a_declared_range(path, param):
    cmd = dict((" ".join(pth), c) for pth, c in _commands(typer.main.get_command(app)))[path]
    declared = getattr(cmd.callback, "limits", {})
    assert param in declared, f"slmedge {path} --{param.replace('_', '-')} has no range: add it to @bounded(...)"
    assert declared[param] in limits.LIMITS


@pytest.mark.parametrize("key", sorted(limits.LIMITS))
def test_every_range_refuses_non_finite_and_past_its_ends(key):
    limit = limits.LIMITS[key]
    assert limit.why, key
    assert math.isfinite(limit.lo) and math.isfinite(limit.hi) and limit.lo < limit.hi
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ConfigError):
            limits.check(key, bad)
    above = int(limit.hi) + 1 if limit.integer else limit.hi * 2 + 1
    with pytest.raises(ConfigError, match=key):
        limits.check(key, above)
    inside = int(limit.lo) + (1 if limit.lo_open else 0) if limit.integer else (limit.lo + limit.hi) / 2
    assert limits.check(key, inside) == inside


def test_a_length_is_bounded_by_the_models_positions_unless_allowed():
    with pytest.raises(ConfigError, match="longer than the model's 512 positions"):
        limits.check_length("seqlen", 1024, 512, "max_position_embeddings in config.json", option="--seqlen")
    limits.check_length("seqlen", 512, 512, "x")
    limits.check_length("seqlen", 1024, 512, "x", beyond=True)
    limits.check_length("seqlen", 1024, None, "x")  # positions not known: nothing to check


def test_memory_refusal_gives_both_numbers():
    with pytest.raises(limits.MemoryLimitError, match=r"needs about 2\.0 GB .*1\.0 GB available"):
        limits.check_memory(2_000_000_000, 1_000_000_000, "x", "the KV cache", "lower --context")
    limits.check_memory(10, 20, "x", "y", "z")


@pytest.mark.parametrize("name", ["../../..", "..", "a/b", "/abs", ".hidden", "", "a" * 101, "x\ny"])
def test_names_that_become_paths_must_be_plain(name):
    with pytest.raises(ConfigError, match="not a plain name"):
        limits.check_plain_name(name, "study name")


def test_plain_names_pass():
    for name in ["smoke", "q4-study_1", "gptq+awq", "run.2"]:
        assert limits.check_plain_name(name, "label") == name

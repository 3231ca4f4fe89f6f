"""Hooks with an owner: every hook registered here is removed when its ``with`` block ends."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch


class StopForward(Exception):
    """Raised by a capture hook to end a forward pass early (never escapes this module's users)."""


def get_module(root: torch.nn.Module, path: str) -> torch.nn.Module:
    return root.get_submodule(path)


@contextlib.contextmanager
def linear_inputs(modules: dict[str, torch.nn.Module], callback: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Call ``callback(name, input)`` with the input of each module on every forward."""
    handles = []
    try:
        for name, module in modules.items():
            handles.append(module.register_forward_pre_hook(lambda _m, args, _n=name: callback(_n, args[0].detach())))
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def module_calls(modules: dict[str, torch.nn.Module], callback: Callable[[str, tuple, dict], None]) -> Iterator[None]:
    """Call ``callback(name, args, kwargs)`` before each module's forward (kwargs included)."""
    handles = []
    try:
        for name, module in modules.items():
            handles.append(
                module.register_forward_pre_hook(lambda _m, args, kwargs, _n=name: callback(_n, args, kwargs), with_kwargs=True)
            )
        yield
    finally:
        for h in handles:
            h.remove()

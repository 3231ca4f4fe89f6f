"""True-sequential calibration without recomputing what has not changed (issue 17: compression speed).

GPTQ and SparseGPT compress a block group by group (q/k/v, then o, then gate/up, then down), each
group's statistics taken on the block with the earlier groups already compressed. Run plainly, every
group's pass starts at the block's input: the o pass recomputes q/k/v and attention, the gate/up pass
all that plus o, the down pass all that plus gate/up, and the pass that propagates the compressed
block to the next recomputes everything once more, about 2.6 block forwards per block in all. Two
facts make most of that unnecessary, and this module uses them, with the same bits as the plain
passes:

- **Entering at a module** (``_Entry``): once every linear that runs before a module (the MLP) is
  compressed, the module's inputs no longer change in this block. They are recorded in the first
  pass that reaches the module, and the later groups inside it (down) run the module alone on them.
- **A finished module's output** (``_Finished``): a module whose linears are all compressed and whose
  output is its last linear's output (attention ends in o_proj, the MLP in down_proj) returns that
  linear applied to the input it was recorded with in its own group's pass, which nothing changes
  afterwards. The output is kept per batch, so the propagation pass reuses attention's from the
  gate/up pass (unless something modified it in place since, which its version counter shows). The
  gate/up pass then costs o_proj instead of the whole attention (and after its first batch nothing of
  the MLP: ``engine.collect_stats`` stops at gate_proj's input, which up_proj shares), and the
  propagation pass down_proj instead of the whole block.

Whether a module's output really is its last linear's (no norm, gate or residual after it inside the
module) is not assumed from its name: the first time a module of a given path is short-cut, its real
forward runs on the first batch and the short-cut output must equal it bit for bit (tensor, tuple
structure); otherwise that path is never short-cut again in this compression. A record is only taken
when it is valid: no linear of the current or a later group ran before the module was entered.

The recorded tensors cost memory (per calibration token: the widths of the recorded inputs, fp32),
so the engine uses this only where they fit comfortably (``engine._shortcuts_fit``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .blocks import run_block


def common_parent(names) -> str:
    """The deepest module path (relative to the block) containing every one of ``names``; "" for the
    block itself."""
    parts = [n.split(".")[:-1] for n in names]
    out = []
    for level in zip(*parts):
        if any(p != level[0] for p in level):
            break
        out.append(level[0])
    return ".".join(out)


def _inside(name: str, path: str) -> bool:
    return bool(path) and name.startswith(path + ".")


@dataclass
class _Entry:
    """A module entered directly by the later groups inside it: its call's args and kwargs per batch."""
    path: str
    first_group: int  # the pass that records it
    last_group: int  # the last pass that uses it (then it is dropped)
    calls: dict[int, tuple] = field(default_factory=dict)


@dataclass
class _Finished:
    """A module whose output is its last linear's: that linear's inputs per batch, recorded in its pass."""
    path: str
    linear: str  # relative name of the module's last linear
    group: int  # the pass that records the linear's input; the module is finished after it
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    # per batch: the short-cut's output and its version counter when made, reused by the later
    # passes (the gate/up pass and the propagation both ask attention for it) unless modified since
    outputs: dict[int, tuple] = field(default_factory=dict)


def plan_bytes(layer: torch.nn.Module, groups: list[list[str]], tokens: int) -> int:
    """The recorded tensors' fp32 bytes for ``tokens`` calibration tokens (an upper bound)."""
    width = 0
    for entry in _entries(groups):
        width += layer.get_submodule(groups[entry.first_group][0]).in_features
    for fin in _finished(groups):
        linear = layer.get_submodule(fin.linear)
        width += linear.in_features + linear.out_features
    return 4 * tokens * width


def _entries(groups: list[list[str]]) -> list[_Entry]:
    out: dict[str, _Entry] = {}
    for gi, group in enumerate(groups):
        path = common_parent(group)
        if not path:
            continue
        inside = [gj for gj, g in enumerate(groups) if all(_inside(n, path) for n in g)]
        # Only groups lying wholly inside the module; a group straddling it gains nothing.
        if len(inside) > 1 and gi == inside[0]:
            out[path] = _Entry(path, inside[0], inside[-1])
    return list(out.values())


def _finished(groups: list[list[str]]) -> list[_Finished]:
    out = []
    seen = set()
    for gi, group in enumerate(groups):
        path = common_parent(group)
        if not path or path in seen:
            continue
        seen.add(path)
        members = [(gj, n) for gj, g in enumerate(groups) for n in g if _inside(n, path)]
        last = max(gj for gj, _ in members)
        last_names = [n for gj, n in members if gj == last]
        # The module ends in one linear, compressed after every other linear inside it.
        if len(last_names) == 1 and all(gj < last for gj, n in members if n != last_names[0]):
            out.append(_Finished(path, last_names[0], last))
    return out


@dataclass
class Checks:
    """What the first short-cut of each module path showed, shared by every block of one compression:
    whether its output equalled the real one (``ok``) and the real output's form (``form``: 0 for a
    tensor, else the length of the tuple whose first element it is)."""
    ok: dict[str, bool] = field(default_factory=dict)
    form: dict[str, int] = field(default_factory=dict)


class BlockShortcuts:
    """The short-cuts for one block's true-sequential passes (``groups``: relative linear names per
    group, in forward order, only those compressed here); ``checks`` is shared by the blocks."""

    def __init__(self, layer: torch.nn.Module, groups: list[list[str]], checks: Checks):
        self.layer = layer
        self.groups = groups
        self.group_of = {n: gi for gi, g in enumerate(groups) for n in g}
        self.entries = {e.path: e for e in _entries(groups)}
        self.finished = {f.path: f for f in _finished(groups)}
        self.checks = checks
        self._finishing: dict[str, _Finished] = {}

    # -- one pass -------------------------------------------------------------------------------------

    def forward(self, group: int | None, batch: int, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
        """One batch of pass ``group`` (None: the propagation pass, every group compressed): the
        block's output, or None where the pass was stopped (the statistics hooks raise StopForward,
        which passes through). Records what later passes of this block need."""
        done = len(self.groups) if group is None else group
        entry = self._entry_for(group, batch)
        with self._finished_modules(done, batch), self._recording(group, batch):
            if entry is not None:
                args, kw = entry.calls[batch]
                self.layer.get_submodule(entry.path)(*args, **kw)
                return None
            return run_block(self.layer, hidden, kwargs)

    def after_group(self, group: int) -> None:
        """Drop what no later pass needs."""
        for path, entry in list(self.entries.items()):
            if entry.last_group <= group:
                del self.entries[path]

    def _entry_for(self, group: int | None, batch: int):
        """The module this batch of pass ``group`` enters directly, if its call was recorded."""
        if group is None:
            return None
        for entry in self.entries.values():
            if entry.first_group < group <= entry.last_group and batch in entry.calls:
                return entry
        return None

    # -- recording ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _recording(self, group: int | None, batch: int) -> Iterator[None]:
        """Pre-hooks recording, in pass ``group``: the inputs of each module entered by later groups
        (when no linear of this or a later group has run yet) and of each finished module's last linear.
        Registered before the statistics hooks, so they run before those stop the pass."""
        if group is None:
            yield
            return
        handles = []
        state = {"pending": False, "linears": 0}

        def on_linear(name):
            def hook(_m, args):
                state["linears"] += 1
                if self.group_of[name] >= group:
                    state["pending"] = True
                fin = self._finishing.get(name)
                if fin is not None:
                    fin.inputs[batch] = args[0].detach()
            return hook

        def on_entry(entry):
            def hook(_m, args, kwargs):
                # Valid only while every linear run so far is final; worth it only if some ran.
                if not state["pending"] and state["linears"]:
                    entry.calls[batch] = (tuple(args), dict(kwargs))
            return hook

        self._finishing = {f.linear: f for f in self.finished.values() if f.group == group}
        try:
            for name in self.group_of:
                # prepend: before the statistics hooks, which stop the pass at the group's last input
                handles.append(self.layer.get_submodule(name).register_forward_pre_hook(on_linear(name), prepend=True))
            for entry in self.entries.values():
                if entry.first_group == group:
                    handles.append(self.layer.get_submodule(entry.path).register_forward_pre_hook(
                        on_entry(entry), with_kwargs=True, prepend=True))
            yield
        finally:
            for h in handles:
                h.remove()

    # -- finished modules -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _finished_modules(self, done: int, batch: int) -> Iterator[None]:
        """While the pass runs, each module finished before it (its last linear's group < ``done``,
        the linear's input recorded for this batch) returns that linear's output on the recorded
        input; the first time for a path, its real forward runs and is compared instead."""
        patched, handles = [], []
        keep = done < len(self.groups)  # the propagation pass is the block's last: nothing to keep
        try:
            for fin in self.finished.values():
                if fin.group >= done or batch not in fin.inputs or self.checks.ok.get(fin.path) is False:
                    continue
                module = self.layer.get_submodule(fin.path)
                linear = self.layer.get_submodule(fin.linear)
                x = fin.inputs[batch]
                if fin.path not in self.checks.ok:
                    handles.append(module.register_forward_hook(self._verifier(fin.path, linear, x)))
                    continue

                def short_cut(*_args, _linear=linear, _x=x, _n=self.checks.form[fin.path], _fin=fin, **_kwargs):
                    kept = _fin.outputs.pop(batch, None)
                    if kept is not None and kept[0]._version == kept[1]:
                        out = kept[0]  # the same call's result, untouched since (in-place ops count)
                    else:
                        out = _linear(_x)
                    if keep:
                        _fin.outputs[batch] = (out, out._version)
                    return out if _n == 0 else (out,) + (None,) * (_n - 1)

                module.forward = short_cut  # an instance attribute: nn.Module.__call__ finds it first
                patched.append(module)
            yield
        finally:
            for module in patched:
                del module.forward
            for h in handles:
                h.remove()

    def _verifier(self, path: str, linear: torch.nn.Module, x: torch.Tensor):
        def hook(_m, _args, out):
            n = 0
            if isinstance(out, tuple):
                n = len(out)
                first, rest = (out[0] if out else None), out[1:]
            else:
                first, rest = out, ()
            ok = (isinstance(first, torch.Tensor) and all(r is None for r in rest)
                  and (mine := linear(x)).shape == first.shape and mine.dtype == first.dtype
                  and torch.equal(mine, first))
            self.checks.ok[path] = bool(ok)
            self.checks.form[path] = n
        return hook

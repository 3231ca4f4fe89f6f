"""A model's torch forward pass with one decoder block in memory at a time.

``streamed_logits(path, ids)`` gives the fp32 logits that ``from_pretrained(path)`` (a plain
Hugging Face folder with safetensors, or a version-1 artifact) or ``Artifact.open(path).load_model()``
(a compact, version-2 artifact) would give, without the model ever being whole in fp32: the model
is built on the meta device (its parameters take no memory; its buffers, such as the rotary
frequencies and Gemma's embedding scale, are computed for real by the model's own constructor,
as ``from_pretrained`` builds them); the tensors outside the decoder blocks (embeddings, final norm,
lm_head; a tied head is the embedding itself) are read from the memory-mapped files, and the
model's own forward runs with a pre-hook on each decoder block that reads that block's tensors
just before it runs and a hook that puts them back on the meta device when it is done. Masks
(Gemma 3's per-layer sliding windows included), rotary embeddings and every other argument a block
gets are the model's own: nothing of the forward pass is re-implemented, so the logits are those
of the whole model, bit for bit (the same kernels on the same values).

Peak memory: the tensors outside the blocks, one block in fp32, the activations (and the logits).
A version-2 artifact's block tensors are rebuilt from its codes (``artifact_weights.iter_tensors``);
other folders' are read with safetensors' ``safe_open`` (sharded folders through their index).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from ..errors import SlmedgeError
from .artifact_format import QUANT_FILE, WEIGHTS_FILE, is_artifact, is_compact, safetensors_header
from .architectures import exact_attention


class StreamedModel:
    """The model at ``path`` on the meta device, its non-block tensors loaded, its blocks read in
    turn by its own forward pass. Call it with (batch, seq) token ids for (batch, seq, vocab) fp32 logits;
    it may be called again (each call reads the blocks again). ``on_block(index, model)`` is called
    after a block is loaded and before it runs (tests watch memory with it)."""

    def __init__(self, path, on_block: Callable[[int, object], None] | None = None):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from .architectures import ARCHITECTURES

        self.path = Path(path)
        self.on_block = on_block
        config = AutoConfig.from_pretrained(str(self.path))
        cls = AutoModelForCausalLM._model_mapping[type(config)]
        arch = ARCHITECTURES.get(getattr(config, "model_type", None))
        self.layers_path = arch.layers if arch is not None else "model.layers"
        self._reader = _reader_for(self.path)
        with _default_dtype(torch.float32), _empty_init():
            model = cls(config)
        model.config._name_or_path = str(self.path)
        self.model = exact_attention(model).eval()
        self.blocks = model.get_submodule(self.layers_path)
        self._prefixes = [f"{self.layers_path}.{i}." for i in range(len(self.blocks))]
        # The empty (meta) tensors of every block, put back after the block has run.
        self._empty = {i: dict(_tensors(block)) for i, block in enumerate(self.blocks)}

        names = self._reader.names()
        outside = [n for n in names if not n.startswith(f"{self.layers_path}.")]
        self._load(model, "", outside, skip_unknown=True)
        model.tie_weights()  # a tied head is the embedding tensor itself, as from_pretrained makes it
        left = [n for n, t in _tensors(model) if t.is_meta and not n.startswith(f"{self.layers_path}.")]
        if left:
            raise SlmedgeError(f"{self.path} has no tensor {left[0]} (the model needs it): cannot run it")
        self._block_names = {i: [n for n in names if n.startswith(p)] for i, p in enumerate(self._prefixes)}
        self._hooks = []
        for i, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(self._make_loader(i)))
            self._hooks.append(block.register_forward_hook(self._make_freer(i)))

    def close(self) -> None:
        """Drop the model and its tensors now (the hooks refer back to this object: without this, the
        memory waits for Python's cycle collector)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.model = self.blocks = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- blocks ---------------------------------------------------------------------------------

    def _make_loader(self, i: int):
        def load(module, args):
            self._load(module, self._prefixes[i], self._block_names[i])
            missing = [n for n, t in _tensors(module) if t.is_meta]
            if missing:
                raise SlmedgeError(f"{self.path} has no tensor {self._prefixes[i]}{missing[0]} (the model needs it): "
                                   "cannot run it")
            if self.on_block is not None:
                self.on_block(i, self.model)
        return load

    def _make_freer(self, i: int):
        def free(module, args, output):
            self.free(i)
        return free

    def free(self, i: int) -> None:
        """Put block ``i``'s tensors back on the meta device."""
        block = self.blocks[i]
        for name, empty in self._empty[i].items():
            _set(block, name, empty)

    def free_all(self) -> None:
        """Put every block that still holds real tensors back on the meta device (a forward pass that
        stopped inside a block leaves that one loaded; one that finished has freed them all)."""
        for i in self.materialized_blocks():
            self.free(i)

    def materialized_blocks(self) -> list[int]:
        """The blocks that hold real (not meta) tensors now."""
        return [i for i, block in enumerate(self.blocks) if any(not t.is_meta for _, t in _tensors(block))]

    def _load(self, module, prefix: str, names: list[str], skip_unknown: bool = False) -> None:
        import torch

        own = dict(_tensors(module))
        for name, t in self._reader.read(names):
            rel = name[len(prefix):]
            if rel not in own:
                if skip_unknown or name.endswith("rotary_emb.inv_freq"):
                    continue  # a checkpoint's extra tensor: from_pretrained ignores it too
                continue
            want = own[rel]
            if tuple(t.shape) != tuple(want.shape):
                raise SlmedgeError(f"{self.path}: tensor {name} has shape {tuple(t.shape)}, the model's config "
                                   f"says {tuple(want.shape)}")
            if t.is_floating_point() and want.is_floating_point():
                t = t.to(torch.float32)
            _set(module, rel, t)

    # --- the forward pass -----------------------------------------------------------------------

    def __call__(self, input_ids, **kwargs):
        """fp32 logits (batch, seq, vocab) of ``input_ids`` (batch, seq)."""
        import torch

        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.ndim == 1:
            ids = ids[None]
        try:
            with torch.no_grad():
                out = self.model(input_ids=ids, use_cache=False, **kwargs)
        finally:
            self.free_all()
        return out.logits.float()


def streamed_logits(path, input_ids, on_block: Callable[[int, object], None] | None = None):
    """fp32 logits (batch, seq, vocab) of ``input_ids`` (batch, seq) under the model at ``path`` (an
    slmedge artifact of either version, or a Hugging Face folder with safetensors), computed with one
    decoder block in memory at a time: equal to those of the whole fp32 model."""
    with StreamedModel(path, on_block=on_block) as model:
        return model(input_ids)


# --- reading tensors ----------------------------------------------------------------------------


class _CompactReader:
    """A version-2 artifact's tensors, rebuilt from its codes."""

    def __init__(self, path: Path):
        self.path = path

    def names(self) -> list[str]:
        from .artifact_weights import weight_names

        return weight_names(self.path)

    def read(self, names) -> Iterator[tuple[str, object]]:
        from .artifact_weights import iter_tensors

        if names:
            yield from iter_tensors(self.path, names=set(names))


class _SafetensorsReader:
    """A Hugging Face folder's (or a version-1 artifact's) safetensors, one tensor at a time."""

    def __init__(self, path: Path):
        self.path = path
        self.files = _weight_files(path)
        self.where: dict[str, Path] = {}
        for f in self.files:
            header = safetensors_header(f)
            if header is None:
                raise SlmedgeError(f"{f} is not a readable safetensors file")
            for k in header:
                if k != "__metadata__":
                    self.where.setdefault(k, f)

    def names(self) -> list[str]:
        return list(self.where)

    def read(self, names) -> Iterator[tuple[str, object]]:
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self.where[n], []).append(n)
        for f, keys in by_file.items():
            with safe_open(str(f), framework="pt") as handle:
                for k in keys:
                    yield k, handle.get_tensor(k)


def _reader_for(path: Path):
    if is_artifact(path) and is_compact(path):
        return _CompactReader(path)
    return _SafetensorsReader(path)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(p for p in path.glob("*.safetensors") if p.name not in (QUANT_FILE, WEIGHTS_FILE))
    if not files:
        raise SlmedgeError(f"{path} has no safetensors weights")
    return files


# --- module tensors -----------------------------------------------------------------------------


def _tensors(module):
    """(name, tensor) of a module's parameters and persistent buffers."""
    yield from module.named_parameters(remove_duplicate=False)
    for name, buf in module.named_buffers(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        if leaf not in sub._non_persistent_buffers_set:
            yield name, buf


def _set(module, name: str, tensor) -> None:
    import torch

    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner) if owner else module
    if leaf in sub._parameters:
        sub._parameters[leaf] = tensor if isinstance(tensor, torch.nn.Parameter) else \
            torch.nn.Parameter(tensor, requires_grad=False)
    else:
        sub._buffers[leaf] = tensor


@contextmanager
def _default_dtype(dtype):
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextmanager
def _empty_init():
    """How from_pretrained builds a model before loading it: parameters on the meta device (their
    initialisation then costs nothing), buffers computed for real (rotary frequencies). accelerate's
    public context, not transformers' ``get_init_context``, whose signature changes between releases."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


# --- whether to stream --------------------------------------------------------------------------


def streamable(path) -> bool:
    """Whether ``StreamedModel`` can read the folder at ``path``: a compact artifact, or a folder with
    safetensors weights (a version-1 artifact, a Hugging Face folder, sharded or not)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return False
    if is_artifact(path) and is_compact(path):
        return True
    try:  # weights stored quantized (compressed-tensors, GPTQ checkpoints...): transformers decodes them
        if "quantization_config" in json.loads((path / "config.json").read_text(encoding="utf-8")):
            return False
    except (OSError, ValueError):
        return False
    try:
        return bool(_weight_files(path))
    except SlmedgeError:
        return False


def fp32_bytes(path) -> int:
    """The bytes of the model at ``path`` whole in fp32 (its parameters and persistent buffers, counted
    on the meta device from its config: nothing is read but the config)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    with torch.device("meta"):
        model = cls(config)
    seen, total = set(), 0
    for _, t in _tensors(model):
        if id(t) not in seen:  # a tied head is the embedding itself
            seen.add(id(t))
            total += t.numel() * 4
    return total

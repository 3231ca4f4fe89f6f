"""compress(): model source + recipe -> artifact directory. The library entry point."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.calibration import load_calibration, shared_spec
from ..errors import ConfigError
from ..fsutil import check_output_dir, output_lock
from ..models.source import SOURCE_DTYPE, LoadedModel, load, resolve
from ..paths import shareable_source
from ..progress import stage as progress_stage
from .artifact import MANIFEST, Artifact, CompactWeights, source_dtypes, write_artifact
from .engine import CompressionResult, compress_model, is_skipped, resolve_device
from .layouts import layout_of
from .methods import get_method
from .recipe import Recipe


@dataclass
class CompressOutcome:
    artifact: Path | None
    # The source as loaded: with ``write=False`` its model is the compressed model, whole, in fp32;
    # when the artifact was written the model was consumed block by block (``loaded.model`` is None).
    loaded: LoadedModel
    result: CompressionResult
    summary: dict
    manifest: dict

    def model(self):
        """The compressed model in fp32: in memory (``write=False``) or loaded from the artifact."""
        if self.loaded.model is not None:
            return self.loaded.model
        return Artifact.open(self.artifact).load_model()


def default_output(source_name: str, recipe: Recipe) -> Path:
    base = Path(source_name.rstrip("/")).name.removesuffix(".gguf").lower() or "model"
    parts = [base, recipe.method]
    if recipe.grid is not None:
        parts.append(recipe.grid + ("-imp" if recipe.importance else ""))
    elif recipe.bpw is not None:
        parts.append(f"bpw{recipe.bpw:g}".replace(".", "p") + "".join(f"-{g}" for g in recipe.bpw_grids or ()))
    elif recipe.bits is not None:
        g = "ch" if recipe.group_size == -1 else recipe.group_size
        parts.append(f"w{recipe.bits}g{g}{'s' if recipe.symmetric else ''}")
    if recipe.sparsity is not None:
        parts.append("s" + recipe.sparsity.describe().replace(":", "of").replace(".", "p"))
    return Path("slmedge-out") / "-".join(parts)


def check_compatible(loaded: LoadedModel, recipe: Recipe) -> None:
    """Refuse, before any calibration work, settings this model's layers cannot take (naming the layer).

    - N:M sparsity needs every compressed linear's input width to be a multiple of M.
    - A group size larger than every compressed linear's input width would make every layer one
      group per row while the recipe says ``g<N>``: refused, naming the widest layer and the
      largest group size that is still a group there. A group wider than only some layers is
      kept: on those layers the one group is cut at the layer's edge, as a ragged last group is
      (``QuantSpec.group_width``), and their scales show it (one column per row).
    - The calibration windows must fit the model's positions (``max_position_embeddings``).
    - At least one linear must be left to compress.
    - On a llama.cpp grid, every compressed linear's rows must fit the grid or llama.cpp's fallback for
      their width (32-wide blocks at least); a bits-per-weight budget must be reachable with its grids
      (``budget.check_budget``).
    """
    arch = loaded.arch
    spars = recipe.sparsity
    model = loaded.model
    method = get_method(recipe.method).cls(recipe)
    names = [f"{arch.layers}.{i}.{rel}" for i in range(len(model.get_submodule(arch.layers))) for rel in arch.linear_names]
    if not is_skipped(arch.lm_head, recipe.skip):
        names.append(arch.lm_head)
        if method.block_level:
            raise ConfigError(f"{recipe.method} cannot compress {arch.lm_head} (no preceding op to fold scales into); "
                              "keep it skipped")
    names = [n for n in names if not is_skipped(n, recipe.skip)]
    if not names:
        raise ConfigError(f"skip patterns {', '.join(recipe.skip)} leave no linear layer to compress")
    widths = {name: model.get_submodule(name).in_features for name in names}
    for name, cols in widths.items():
        if spars is not None and spars.is_nm and cols % spars.m:
            divisors = [m for m in (4, 8, 16) if cols % m == 0]
            raise ConfigError(
                f"{spars.n}:{spars.m} sparsity needs input widths divisible by {spars.m}; {name} has {cols} "
                f"(try M in {divisors})"
            )
    if recipe.on_grid:
        from ..models.grids import GRIDS, grid_for_width

        for name, cols in widths.items():
            if recipe.on_layouts:  # a layout fits where its block divides the rows: check_budget
                break
            for grid in ([recipe.grid] if recipe.grid is not None else list(recipe.bpw_grids or GRIDS)):
                try:
                    grid_for_width(grid, cols)
                except ConfigError as exc:
                    raise ConfigError(f"{name}: {exc}") from None
        if recipe.bpw is not None:
            from .budget import check_budget

            shapes = {name: (model.get_submodule(name).out_features, cols) for name, cols in widths.items()}
            check_budget(shapes, recipe.bpw, recipe.bpw_grids)
    g = recipe.group_size
    if recipe.bits is not None and g != -1 and not recipe.on_grid:
        widest = max(widths, key=widths.get)
        if g > widths[widest]:
            raise ConfigError(
                f"group size {g} is larger than every layer's input width (the widest, {widest}, has "
                f"{widths[widest]} columns): use --group-size {widths[widest]} or less, or -1 for one group per row")
    if method.needs_calibration:
        positions = getattr(model.config, "max_position_embeddings", None)
        if isinstance(positions, int) and recipe.seqlen > positions:
            raise ConfigError(f"seqlen {recipe.seqlen} is longer than the model's {positions} positions "
                              f"(max_position_embeddings): use --seqlen {positions} or less")


def calibration_memory(shape, recipe: Recipe) -> int | None:
    """Bytes a calibrated compression allocates for its settings (None: a data-free method, or a
    shape without the widths). Counted: every sample's block input and output in fp32 (the engine
    holds both for a whole block), one batch's forward through a block (its MLP's activations and
    the attention scores), the method's statistics for one block's inputs (GPTQ/SparseGPT: a
    Hessian and its factor per input width; Wanda: norms) and AWQ's search activations. Not the
    weights (the source in its own dtype, one block in fp32: about the model's size)."""
    method = get_method(recipe.method).cls(recipe)
    if not method.needs_calibration or not (shape and shape.hidden and shape.intermediate and shape.heads):
        return None
    hidden, inter, heads = shape.hidden, shape.intermediate, shape.heads
    tokens = recipe.nsamples * recipe.seqlen
    batch = min(recipe.batch_size, recipe.nsamples)
    acts = 2 * tokens * hidden * 4 + tokens * 8  # inputs and outputs of a block, and the token ids
    forward = batch * recipe.seqlen * (4 * hidden + 3 * inter) * 4 + batch * heads * recipe.seqlen ** 2 * 4
    attn_width = heads * (shape.head_dim or hidden // heads)
    stats = 0
    if method.stats_class is not None:  # q/k/v share one input, gate/up another; o_proj's and down_proj's
        stats = sum(method.stats_class.bytes_for(c) for c in (hidden, hidden, attn_width, inter))
    if method.block_level:  # the search's kept tokens: each mapping's input and its linears' outputs
        stats += min(recipe.awq_max_tokens, tokens) * (2 * hidden + 2 * inter) * 4
    return acts + forward + stats


def check_compress_bounds(model, recipe: Recipe, revision=None, device=None, option: str = "--seqlen") -> None:
    """What the model and the machine bound a compression by, before the model loads: the
    calibration windows against its positions (its config, its GGUF header), the memory the
    calibration allocates against what is available (``slmedge.limits``). ``option``: how a
    message spells the window length."""
    from ..fsutil import memory_available
    from ..limits import check_length, check_memory
    from ..models.shape import model_shape

    recipe = recipe.validate()
    if not get_method(recipe.method).cls(recipe).needs_calibration:
        return
    shape = model_shape(model, revision)
    if shape is None:  # a Hub id not in the local cache: ``check_compatible`` checks it once loaded
        return
    check_length("seqlen", recipe.seqlen, shape.positions, shape.positions_from, option=option)
    dev = resolve_device(device) if device is not None else torch.device("cpu")
    available = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else memory_available()
    check_memory(calibration_memory(shape, recipe), available,
                 f"calibrating {shape.where} on {recipe.nsamples} x {recipe.seqlen} tokens",
                 "every sample's activations at a block's input and output, one batch's forward and the "
                 "method's statistics; not the weights",
                 "lower --nsamples, --seqlen or --batch-size")


def grid_use(result: CompressionResult, recipe: Recipe) -> tuple[dict, dict | None]:
    """On llama.cpp's grids: the grids the linears went on (name -> linears, bits per weight as GGUF
    stores it; for an ONNX budget its MatMulNBits layouts, bits as the ONNX file stores them), and,
    with one ``--grid``, llama.cpp's fallback where the grid's super-blocks did not
    divide a linear's rows (the grid it fell back to, the linears by name with their block's number
    as ``*``, how many of how many, why); ({}, None) on the uniform grid."""
    from ..models.grids import GRIDS, Grid

    if not recipe.on_grid:
        return {}, None
    used: dict[str, dict] = {}
    for name, res in result.layers.items():
        if isinstance(res.spec, Grid):
            entry = used.setdefault(res.spec.name, {"linears": 0, "bits_per_weight": round(res.spec.bits_per_weight, 4)})
            entry["linears"] += 1
        elif recipe.on_layouts and layout_of(res.spec) is not None:  # an ONNX budget's MatMulNBits layouts
            c = result.counts.get(name)
            entry = used.setdefault(layout_of(res.spec).name, {"linears": 0, "bits": 0, "weights": 0})
            entry["linears"] += 1
            entry["bits"] += c["onnx_bits"] if c else 0
            entry["weights"] += c["quantized"] if c else 0
    for entry in used.values():  # a layout's bits per weight depend on the widths: those of its linears
        if "weights" in entry:
            weights, bits = entry.pop("weights"), entry.pop("bits")
            entry["bits_per_weight"] = round(bits / weights, 4) if weights else None
    fell = sorted(n for n, r in result.layers.items() if isinstance(r.spec, Grid) and recipe.grid is not None
                  and r.spec.name != recipe.grid)
    if not fell:
        return used, None
    import re

    patterns: dict[str, int] = {}
    for n in fell:
        key = re.sub(r"\.\d+\.", ".*.", n, count=1)
        patterns[key] = patterns.get(key, 0) + 1
    to = sorted({result.layers[n].spec.name for n in fell})
    grid = GRIDS[recipe.grid]
    return used, {"grid": recipe.grid, "to": to, "linears": patterns, "count": len(fell),
                  "of": sum(1 for r in result.layers.values() if isinstance(r.spec, Grid)),
                  "why": f"rows not divisible by {grid.block} ({grid.name}'s super-block)"}


def summarize(model, result: CompressionResult, recipe: Recipe) -> dict:
    total = sum(p.numel() for p in model.parameters())
    counts = result.counts.values()
    kept = sum(c["kept"] for c in counts)
    masked = sum(c["masked"] for c in counts)
    quantized = sum(c["quantized"] for c in counts)
    # an ONNX budget counts bits as MatMulNBits stores them (fp32 scales); otherwise codes + fp16 scales
    bits = sum(c.get("onnx_bits", c["code_bits"]) if recipe.on_layouts else c["code_bits"] for c in counts)
    grids, fallback = grid_use(result, recipe)
    headline = recipe.describe()
    if fallback is not None:  # the headline says what the codes are on
        to = "/".join(fallback["to"])
        headline += (f" -> {to} on every linear (llama.cpp's fallback)" if fallback["count"] == fallback["of"] else
                     f" ({to} on {fallback['count']} of {fallback['of']} linears: llama.cpp's fallback)")
    extra = {}
    if grids:
        extra["grids"] = grids
    if fallback is not None:
        extra["fallback"] = fallback
    return {
        "recipe": headline,
        **extra,
        "parameters": total,
        "compressed_parameters": sum(c["parameters"] for c in counts),
        "compressed_linears": len(result.layers),
        "sparsity": round(1 - kept / masked, 6) if masked else 0.0,
        "bits_per_weight": round(bits / quantized, 4) if quantized else None,
        "timings": {k: round(v, 3) for k, v in result.timings.items()},
    }


def compress(
    model: str | None = None,
    recipe: Recipe | None = None,
    output: str | Path | None = None,
    *,
    data_dir: str | Path | None = None,
    device: str | None = "auto",
    overwrite: bool = False,
    trust_remote_code: bool = False,
    revision: str | None = None,
    text_field: str = "text",
    progress=None,
    write: bool = True,
) -> CompressOutcome:
    """Compress a model source with ``recipe`` and (unless ``write=False``) write the artifact.

    Writing, the model is loaded in its own dtype (bf16 stays bf16), each block is computed in fp32
    in its turn, and its compact tensors (codes, kept values, untouched tensors) replace it
    (``compress.engine``'s sink, ``CompactWeights``): the peak is about the source's size, one block
    in fp32, the tensors outside the blocks in fp32 and the calibration activations; the model is
    never whole in fp32. With ``write=False`` the model is loaded in fp32 and stays whole in memory,
    compressed (``CompressOutcome.model``).
    """
    recipe = (recipe or Recipe()).validate()
    dev = resolve_device(device)
    if not write:
        check_compress_bounds(model, recipe, revision, dev)  # the positions and the memory, before the model loads
        return _compress(model, recipe, None, data_dir, dev, overwrite, trust_remote_code, revision, text_field,
                         progress, write)
    output = Path(output) if output is not None else default_output(model or "smollm2-135m", recipe)
    resolve(model, revision, trust_remote_code)  # a missing model is said first, and creates nothing
    check_output_dir(output, overwrite, MANIFEST, inputs=[model])
    check_compress_bounds(model, recipe, revision, dev)  # the positions and the memory, before the model loads
    # One writer per output, from before the model loads until the artifact is in place: a second
    # compression into the same folder is refused now, naming this one (fsutil.output_lock).
    with output_lock(output):
        check_output_dir(output, overwrite, MANIFEST, inputs=[model])  # again: another writer may have finished
        return _compress(model, recipe, output, data_dir, dev, overwrite, trust_remote_code, revision, text_field,
                         progress, write)


def _compress(model, recipe: Recipe, output, data_dir, dev, overwrite: bool, trust_remote_code: bool, revision,
              text_field: str, progress, write: bool) -> CompressOutcome:
    started = time.perf_counter()
    with progress_stage("load the model"):
        loaded = load(model, revision=revision, trust_remote_code=trust_remote_code,
                      dtype=SOURCE_DTYPE if write else torch.float32)
    load_s = time.perf_counter() - started
    check_compatible(loaded, recipe)
    method = get_method(recipe.method).cls(recipe)
    calib = None
    calib_identity = None
    if method.needs_calibration:
        with progress_stage("calibration text"):
            calib_set = load_calibration(recipe.calibration, loaded.tokenizer, recipe.nsamples, recipe.seqlen,
                                         recipe.seed, data=data_dir, text_field=text_field)
        calib, calib_identity = calib_set.tokens, calib_set.identity
    torch.manual_seed(recipe.seed)
    # The dtypes untouched tensors are written in: the source files', else the model's as loaded.
    dtypes = source_dtypes(loaded.hf_dir) or {k: v.dtype for k, v in loaded.model.state_dict().items()}
    compact = CompactWeights(dtypes) if write else None
    result = compress_model(loaded.model, loaded.arch, recipe, calib, dev, progress,
                            sink=compact.add if compact is not None else None)
    result.timings["load_s"] = load_s
    summary = summarize(loaded.model, result, recipe)
    manifest = {
        "recipe": {**recipe.to_dict(), "calibration": shared_spec(recipe.calibration)},  # no local path for others
        # named for others: relative to the artifact (or by name), with its weights' sha256 (paths.shareable_source)
        "base_model": shareable_source(loaded.identity, output) if output is not None else loaded.identity,
        "architecture": loaded.arch.model_type,
        "calibration": calib_identity,
        "device": str(dev),
        "resolved": result.resolved,
        "timings": {k: round(v, 3) for k, v in result.timings.items()},
        "summary": summary,
    }
    artifact = None
    if write:
        # The artifact's weights, rebuilt, are fp32 whatever the source's dtype (as version 1's were).
        loaded.model.config.dtype = torch.float32
        with progress_stage("write the artifact"):
            artifact = write_artifact(output, loaded.model, loaded.tokenizer, result.layers, result.extras, manifest,
                                      overwrite, source_dir=loaded.hf_dir, compact=compact)
        loaded.model = None  # its blocks were freed as they were written
    return CompressOutcome(artifact, loaded, result, summary, manifest)

"""GGUF export on the ``gguf`` package's writer: the artifact's integer codes become GGUF blocks.

Where the artifact's grid fits a GGUF block type the codes are placed as they are (``gguf_quant``:
Q4_0, Q4_1, Q8_0), so the GPTQ/AWQ calibration reaches llama.cpp unchanged (DESIGN.md "numeric
contracts"); any other combination is re-quantized by llama.cpp's own quantizer from the
artifact's dequantized weights, with a warning that the calibrated grid is not kept. Pruned
models are written dense. The metadata is the architecture's hyperparameters (``gguf_hparams``,
from ``models.architectures``' GGUF layout) and the vocabulary (``gguf_vocab``); the file is
checked in llama.cpp against torch (``verify``) before it appears at the output path.

Llama-family models need the q/k rows permuted for llama.cpp's rotary layout; Qwen2/Qwen3 use
NEOX rotary in llama.cpp and need none. Codes, scales and zero points are permuted together:
rows are output features.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..compress.artifact import MANIFEST
from ..compress.quant import QuantSpec, entry_spec
from ..compress.recipe import Recipe
from ..models.grids import Grid
from ..errors import OutputExistsError, UnsupportedArchitectureError
from ..fsutil import disk_full, no_space, temp_name
from ..paths import recorded_path
from ..models.architectures import ARCHITECTURES, Architecture, GGUFLayout
from ..progress import stage as progress_stage
from ..models.gguf_seal import check_gguf, input_gguf_manifest, manifest_text, placeholder_manifest, seal_gguf
from .errors import ExportError, GGUFExportError, GGUFVerificationError
from .formats import get_format, register_format
from .gguf_hparams import add_hparams, hparam
from .gguf_blocks import pack_blocks
from .gguf_quant import (QTYPES, QType, cannot_place, check_requantized, codes_to_blocks,  # noqa: F401 - re-exported
                         grids_qtype, llamacpp_quantize, permute_rows, unpermute_rows)
from .gguf_vocab import add_tokenizer, model_name, pre_tokenizer_name  # noqa: F401 - re-exported
from .inspect import (MANIFEST_KEY, REQUANTIZED, gguf_model_facts, gguf_rows, inspect_gguf, manifest_entry,
                      pack_tensors, read_gguf_manifest)
from .source import ExportSource, iter_weights, open_export_source, weight_shapes
from .verify import check_logits, probe_text, source_tokenizer, torch_logits

# The architectures written as GGUF (model_type -> layout), as the architecture table says.
GGUF_ARCHITECTURES: dict[str, GGUFLayout] = {k: a.gguf for k, a in ARCHITECTURES.items() if a.gguf is not None}

# Verification tolerances against torch logits of the same weights. llama.cpp multiplies
# quantized weights with 8-bit-quantized activations (and f16 weights in f16), so only f32 is
# near exact. "kept": the codes were placed as they are; "requantized": llama.cpp's quantizer
# chose new values, so the file differs from the artifact by a re-quantization error.
TOLERANCES: dict[str, dict[str, float]] = {
    "f32": {"mean_kl": 1e-4, "top1": 0.97},
    "f16": {"mean_kl": 2e-3, "top1": 0.9},
    "kept": {"mean_kl": 0.05, "top1": 0.8},
    # Loose on purpose: they catch a broken file (wrong layout: KL of several nats, top-1 near
    # 0), not a lossy one; llama.cpp's own q4_0 of SmolLM2-135M measures KL 0.53 on the probe.
    "requantized": {"mean_kl": 1.0, "top1": 0.4},
    "requantized_low_bit": {"mean_kl": 2.0, "top1": 0.25},  # q2_k, q3_k_*
}


# --- source -----------------------------------------------------------------------------------


@dataclass
class _Source(ExportSource):
    arch: Architecture | None = None

    @property
    def layout(self) -> GGUFLayout:
        return self.arch.gguf


def _open_source(source) -> _Source:
    try:
        base = open_export_source(source, lazy_layers=True)  # one linear's codes at a time
    except ExportError as exc:
        raise GGUFExportError(str(exc)) from exc
    if base.model_type not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF export does not support architecture '{base.model_type}' yet; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)}")
    return _Source(base.path, base.artifact, base.config, base.layers, ARCHITECTURES[base.model_type])


# --- verification -----------------------------------------------------------------------------


def verify_against_torch(gguf_path: Path, src: ExportSource, tolerance: dict, probe: str | None = None,
                         n_threads: int | None = None, tokenizer_copied: bool = False) -> dict:
    """llama.cpp's logits of the file against torch's of the source weights on a short probe; llama.cpp
    must also tokenize the probe as transformers does (unless the tokenizer was copied from a GGUF)."""
    from ..models.gguf_check import llamacpp_logits, vocab_only

    probe = probe_text(probe)
    ids = source_tokenizer(src.path)(probe, add_special_tokens=False)["input_ids"]
    try:
        with vocab_only(gguf_path) as llm:
            cpp_ids = list(llm.tokenize(probe.encode("utf-8"), add_bos=False, special=False))
            add_bos = bool(llm._model.add_bos_token()) if hasattr(llm, "_model") else False
            bos = llm.token_bos()
    except ValueError as exc:
        raise GGUFVerificationError(f"llama.cpp cannot load the written GGUF ({exc}); nothing was written") from exc
    same_tokens = cpp_ids == list(ids)
    if not same_tokens and not tokenizer_copied:
        first = next((i for i, (a, b) in enumerate(zip(ids, cpp_ids)) if a != b), min(len(ids), len(cpp_ids)))
        raise GGUFVerificationError(
            f"llama.cpp tokenizes the probe differently from transformers (first difference at token {first}); "
            "the GGUF's tokenizer metadata is wrong for this model")
    if add_bos and bos is not None and bos >= 0:
        ids = [bos, *ids]
    ref = torch_logits(src.path, ids)
    cpp = llamacpp_logits(gguf_path, ids, n_threads=n_threads)
    return check_logits(ref, cpp, tolerance, f"llama.cpp's logits of the GGUF disagree with torch's of {src.path.name}",
                        GGUFVerificationError, tokenizer_agrees=same_tokens)


# --- the tensors, planned then streamed ---------------------------------------------------------


@dataclass
class _Planned:
    """One GGUF tensor: what the header says of it, and how its data is built from the source's weight."""

    name: str  # the GGUF name
    hf_name: str  # the source weight it is built from
    from_copy: str | None  # a tied head written as its own tensor: the weight read again (the embedding)
    shape: tuple  # the source weight's shape
    dtype: np.dtype  # float32, float16, or uint8 (blocks of type ``raw``)
    raw: object  # the ggml type of placed code blocks, else None
    heads: int | None  # q/k rows permuted for llama.cpp's rotary over this many heads
    norm_offset: float  # added to a (Gemma) norm weight
    layer: str | None = None  # the compressed linear whose codes are placed
    spec: object = None
    qtype: QType | None = None  # the block type they are placed in

    @property
    def shape_written(self) -> tuple:
        """The data's numpy shape: blocks are (rows, bytes per row)."""
        if self.raw is None:
            return self.shape
        import gguf

        block, type_size = gguf.GGML_QUANT_SIZES[self.raw]
        return (self.shape[0], self.shape[1] // block * type_size)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape_written, dtype=np.int64)) * self.dtype.itemsize


def _stream(plan: list[_Planned], src: _Source, extras: dict, skipped: set):
    """(planned tensor, its source weight as fp32 numpy) in the plan's order, one at a time: the source's
    weights in their files' order (but those in ``skipped``: a tied lm_head, written as token_embd), then
    a tied head's copy (the embedding read again), then the extras."""
    items = iter(plan)
    pending = next(items, None)
    weights = iter_weights(src.path)
    for hf_name, w in weights:
        if hf_name in skipped:
            continue
        if pending is None or pending.from_copy or pending.hf_name in extras or hf_name != pending.hf_name:
            raise GGUFExportError(f"{src.path}: tensor {hf_name} came where "
                                  f"{pending.hf_name if pending else 'no tensor'} was planned; cannot export it")
        yield pending, w
        del w
        pending = next(items, None)
        if pending is None or pending.from_copy or pending.hf_name in extras:
            break
    weights.close()
    while pending is not None:
        if pending.from_copy:
            [(_, w)] = list(iter_weights(src.path, {pending.from_copy}))
        elif pending.hf_name in extras:
            w = extras[pending.hf_name]
        else:
            raise GGUFExportError(f"{src.path}: tensor {pending.hf_name} was listed but could not be read")
        yield pending, w
        pending = next(items, None)


def _build(item: _Planned, w: np.ndarray, src: _Source, report_tensors: dict) -> np.ndarray:
    """The GGUF data of one planned tensor from its source weight (codes placed as blocks, or a float cast)."""
    import gguf

    if item.norm_offset:
        w = w + np.float32(item.norm_offset)
    if item.heads is not None:
        w = permute_rows(w, item.heads)
    if tuple(w.shape) != item.shape:
        raise GGUFExportError(f"tensor {item.hf_name} has shape {tuple(w.shape)}, its header said {item.shape}")
    if item.raw is None:
        return w.astype(item.dtype, copy=False)
    res = src.layers[item.layer]
    if isinstance(item.spec, Grid):  # a llama.cpp grid: its codes and fields in its own block layout
        codes, fields = res.codes.numpy(), {k: v.numpy() for k, v in res.fields.items()}
        if item.heads is not None:
            codes = permute_rows(codes, item.heads)
            fields = {k: permute_rows(v, item.heads) for k, v in fields.items()}
        blocks = pack_blocks(item.spec, codes, fields)
        decoded = gguf.quants.dequantize(blocks, item.raw)
        if not np.array_equal(decoded.view(np.uint32), np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)):
            bad = float(np.abs(decoded - w).max())
            raise GGUFExportError(f"{item.name}'s {item.spec.ggml} blocks do not decode to the artifact's weights bit for "
                                  f"bit (max difference {bad:.3g}); nothing was written")
        report_tensors[item.name]["max_abs_diff"] = 0.0
        return blocks
    codes, scales, zeros = res.codes.numpy(), res.scales.numpy(), res.zeros.numpy()
    if item.heads is not None:
        codes, scales, zeros = (permute_rows(a, item.heads) for a in (codes, scales, zeros))
    blocks = codes_to_blocks(codes, scales, zeros, item.spec, item.qtype)
    decoded = gguf.quants.dequantize(blocks, item.raw)
    report_tensors[item.name]["max_abs_diff"] = float(np.abs(decoded - w).max())
    return blocks


# --- the export -------------------------------------------------------------------------------


def _grids(layers) -> dict[str, tuple[QuantSpec | Grid, tuple[int, int]]]:
    """name -> (grid, (rows, input columns)) of every linear that holds codes; from the manifest's entries
    alone (no codes read) where the layers are read lazily (``LazyLayers``)."""
    entries = getattr(layers, "entries", None)
    if entries is not None:
        return {n: (entry_spec(e), (int(e["shape"][0]), int(e["shape"][1]))) for n, e in entries.items() if "bits" in e}
    return {n: (r.spec, tuple(r.codes.shape)) for n, r in layers.items() if r.codes is not None}


def _auto_qtype(layers, preferred: str | None = None) -> str | QType:
    """The smallest type that holds every layer's codes as they are; else the commonest natural one. On
    llama.cpp's grids: every tensor in its own grid's type (``grids_qtype``; the recipe's grid, when it
    names one, says which file type llama.cpp gives the tensors left uncoded)."""
    found = list(_grids(layers).values())
    if any(isinstance(spec, Grid) for spec, _ in found):
        coded = [(spec, rows * cols) for spec, (rows, cols) in found if isinstance(spec, Grid)]
        if preferred is not None:
            from ..models.grids import GRIDS

            main = GRIDS.get(preferred)
            if main is not None:
                return QType(main.name, main.ggml, main.ftype, grid="*")
        return grids_qtype(coded)
    coded = [(spec, cols) for spec, (_, cols) in found]
    if not coded:
        return "f16"
    for name in ("q4_0", "q4_1", "q8_0"):
        if all(cannot_place(spec, cols, QTYPES[name]) is None for spec, cols in coded):
            return name
    counts: dict[str, int] = {}
    for s, _ in coded:
        name = ("q4_0" if s.symmetric else "q4_1") if s.bits <= 4 else "q8_0"
        counts[name] = counts.get(name, 0) + 1
    return max(counts, key=counts.get)


def _tmp_name(out: Path, kind: str = "file") -> Path:
    """Where the file is written before it becomes ``out`` (``stage``: llama.cpp's quantizer's input);
    what a killed export leaves there, the next writer in the folder removes (``fsutil.remove_stale``)."""
    return temp_name(out, kind)


def _report_rows(report: dict) -> list[tuple[str, str]]:
    """`slmedge export`'s rows for a GGUF report."""
    types: dict[str, int] = {}
    for t in report["tensors"].values():
        types[t["type"]] = types.get(t["type"], 0) + 1
    return [("tensors by type", ", ".join(f"{k} x{v}" for k, v in sorted(types.items()))),
            ("codes kept exactly", f"{report['codes_kept']} tensors; {report['requantized_by_llamacpp']} "
             "written by llama.cpp's quantizer"),
            ("tokenizer", f"{report['tokenizer']['model']} / pre {report['tokenizer'].get('pre')}")]


def _importance_for(values: dict, meta: dict, path, requant: list[str], report_tensors: dict, qtype: str):
    """The importance-matrix entries of the tensors llama.cpp quantizes in this export, checked against
    their widths; refused (ConfigError / ImatrixError) where the matrix has nothing to weight here or
    was made for another model. Returns (entries, what the manifest records of it)."""
    from ..errors import ConfigError
    from ..fsutil import sha256_file
    from .imatrix import ImatrixError

    if not requant:
        raise ConfigError(f"--imatrix: nothing in this {qtype} export goes through llama.cpp's quantizer (every tensor "
                          "keeps its codes or its float type), so an importance matrix has nothing to weight")
    used, lacking = {}, []
    for name in requant:
        if name in values:
            columns = int(report_tensors[name]["shape"][-1])
            if values[name].size != columns:
                raise ImatrixError(f"the importance matrix {path} has {values[name].size} values for {name}, whose "
                                   f"rows have {columns}: it was made for another model")
            used[name] = values[name]
        elif name.startswith("blk.") and len(report_tensors[name]["shape"]) == 2:
            lacking.append(name)  # llama-imatrix records every block's weight matrices
    if lacking:
        shown = ", ".join(sorted(lacking)[:2])
        raise ImatrixError(f"the importance matrix {path} has no entry for {shown}"
                           f"{' and others' if len(lacking) > 2 else ''}, which llama.cpp quantizes here: "
                           "it was made for another model")
    if not used:  # only tensors outside the blocks go through the quantizer (an artifact's embedding, head)
        raise ConfigError(f"--imatrix: llama.cpp's quantizer only gets {', '.join(sorted(requant))} in this {qtype} "
                          "export (the blocks keep their codes), and the importance matrix has no entry for them "
                          "(llama-imatrix records the output only with --process-output): nothing to weight")
    from ..paths import given_path

    info = {"file": Path(path).name, "sha256": sha256_file(path), "entries_used": len(used),
            "chunk_count": meta["chunk_count"], "chunk_size": meta["chunk_size"],
            "datasets": [given_path(d) for d in meta["datasets"]]}  # llama-imatrix records them as typed
    return used, info


def _ours(path: Path) -> bool:
    """A GGUF file slmedge wrote: it carries slmedge's manifest."""
    try:
        return read_gguf_manifest(path) is not None
    except Exception:  # noqa: BLE001 - not a GGUF file at all, or a damaged one: not ours
        return False


@register_format("gguf", label="GGUF", single_file=True, suffix=".gguf", complete=lambda out: Path(out).is_file(),
                 read_manifest=read_gguf_manifest, verified_manifest=check_gguf, input_manifest=input_gguf_manifest,
                 types=tuple(QTYPES), tolerances=TOLERANCES,
                 options=("keep_f16_uncoded", "imatrix"), error=GGUFExportError, report_rows=_report_rows,
                 inspect=inspect_gguf, inspect_rows=gguf_rows, magic=b"GGUF", model_facts=gguf_model_facts,
                 tokenizer="inside", type_key="qtype", torch_source=True, packages=("gguf",))
def export_gguf(source, out_path, qtype: str = "auto", exact: bool = False, verify: bool = True, *,
                overwrite: bool = False, probe: str | None = None, n_threads: int | None = None,
                keep_f16_uncoded: bool = False, imatrix=None) -> dict:
    """Write ``source`` (an slmedge artifact or a plain HF folder) as one GGUF file at ``out_path``.

    ``qtype``: ``auto`` (the type matching the artifact's codes, else f16), ``f32``, ``f16``,
    ``q8_0``, ``q4_0``, ``q4_1``. Codes that fit the type are placed as they are; the rest go
    through llama.cpp's quantizer with a warning (``exact=True`` refuses instead), weighted by the
    importance matrix ``imatrix`` (a llama.cpp imatrix GGUF file) where one is given. With
    ``verify``, llama.cpp's logits of the file are compared with torch's of the source and a
    disagreement raises :class:`GGUFVerificationError`. The file appears only when complete and
    verified. Returns a report (types per tensor, which kept their codes, verification stats).
    """
    import gguf

    started = time.perf_counter()
    key = get_format("gguf").check_type(qtype)
    out = Path(out_path)
    if out.exists() and not out.is_file():
        raise OutputExistsError(f"{out} is a directory: a GGUF export is one file; give a path ending in .gguf")
    # What slmedge did not write is never replaced: --overwrite is advised only where it would work.
    if out.exists() and not _ours(out):
        raise OutputExistsError(f"{out} is not a GGUF file slmedge wrote (no slmedge.manifest in it); --overwrite only "
                                "replaces slmedge's own outputs: choose another output")
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} exists; pass --overwrite to replace it")
    if Path(source).exists() and Path(source).resolve() == out.resolve():
        raise OutputExistsError(f"output {out} is the input; choose another output")
    importance, importance_meta = (None, None)
    if imatrix is not None:
        from .imatrix import read_imatrix

        importance, importance_meta = read_imatrix(imatrix)
    out.parent.mkdir(parents=True, exist_ok=True)
    src = _open_source(source)
    if importance is not None:  # made for this model: the weights sha256 slmedge's file records
        from .imatrix import check_model

        check_model(imatrix, importance_meta, src.path)
    recipe = src.artifact.manifest.get("recipe") if src.artifact is not None else None
    key = _auto_qtype(src.layers, (recipe or {}).get("grid")) if key == "auto" else key
    target = key if isinstance(key, QType) else QTYPES[key]
    arch_enum = gguf.MODEL_ARCH[src.layout.arch]
    c = src.config
    tied = bool(getattr(c, "tie_word_embeddings", False))
    tmap = gguf.get_tensor_name_map(arch_enum, int(c.num_hidden_layers))
    permute = {rel: int(hparam(c, attr, c.num_attention_heads)) for rel, attr in src.layout.permute}

    # Plan every tensor from the files' headers (names, shapes) and the codes' grids: the GGUF's
    # tensor table and manifest are written before any tensor data, and the data is then built and
    # written one tensor at a time (never the whole model in memory).
    plan: list[_Planned] = []
    report_tensors: dict[str, dict] = {}
    requant, notes = [], []
    seen_layers = set()
    grids = _grids(src.layers)
    has_codes = bool(grids)
    embed_name = "model.embed_tokens.weight"
    copies: list[tuple[str, tuple]] = []  # a tied head llama.cpp needs as its own tensor
    skipped: set[str] = set()  # a tied lm_head: the embedding is the head
    pruned = False  # whether a linear has a mask (read with its codes, one linear at a time)

    def shapes():
        yield from weight_shapes(src.path)
        yield from copies

    for hf_name, shape in shapes():
        from_copy = hf_name.endswith("#tied")
        hf_name = hf_name.removesuffix("#tied")
        if tied and hf_name == "lm_head.weight" and not from_copy:
            skipped.add(hf_name)
            continue
        if tied and src.layout.output_required and hf_name == embed_name and not from_copy:
            copies.append(("lm_head.weight#tied", shape))
        name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise GGUFExportError(f"tensor {hf_name} has no GGUF name for {src.layout.arch.lower()}; cannot export it")
        layer, _, suffix = hf_name.rpartition(".")
        heads = next((n for rel, n in permute.items() if layer.endswith("." + rel)), None)
        # the linear's grid and mask (its codes are read when its tensor is written)
        spec, mask = src.layers.outline(layer) if suffix == "weight" and layer in src.layers else (None, None)
        if suffix == "weight" and layer in src.layers:
            seen_layers.add(layer)
        item = _Planned(name, hf_name, embed_name if from_copy else None, tuple(shape), np.dtype(np.float32), None, heads,
                        src.arch.norm_offset if src.arch.norm_offset and hf_name.endswith("norm.weight") else 0.0)
        info = {"hf_name": hf_name, "shape": list(shape), "codes_kept": False}
        if mask is not None:
            pruned = True
            info["sparsity"] = round(1 - float(mask.float().mean()), 4)
        del mask
        if len(shape) == 1 or target.name == "f32":
            info["type"] = "F32"
        elif target.name == "f16":
            item.dtype = np.dtype(np.float16)
            info["type"] = "F16"
        elif spec is not None:
            why = cannot_place(spec, shape[1], target)
            if why is None:
                ggml = spec.ggml if isinstance(spec, Grid) else target.ggml  # a grid's tensor keeps its own type
                item.raw = gguf.GGMLQuantizationType[ggml]
                item.layer, item.spec, item.qtype = layer, spec, target
                item.dtype = np.dtype(np.uint8)
                info.update(type=ggml, codes_kept=True, grid=spec.describe())
            else:
                if exact:
                    raise GGUFExportError(f"{layer}'s codes ({spec.describe()}) cannot be kept as {target.name}: "
                                          f"{why}; rerun without --exact to let llama.cpp re-quantize it")
                info.update(type="F32", grid=spec.describe(), requantized_because=why)
                requant.append(name)
        elif has_codes and (keep_f16_uncoded or not (target.max_bits or target.grid)):
            # Left unquantized by the recipe (embeddings, lm_head, skipped layers): kept at f16.
            item.dtype = np.dtype(np.float16)
            info["type"] = "F16"
        elif has_codes:
            # Left unquantized by the recipe: llama.cpp's quantizer gives them the type it would give
            # them in its own file of this type (token_embd/output often Q6_K), so sizes compare.
            info.update(type="F32", uncoded=True)
            requant.append(name)
        else:
            info["type"] = "F32"
            requant.append(name)
        plan.append(item)
        report_tensors[name] = info
    # A tied lm_head is the embedding tensor itself: written (dequantized) as token_embd.
    missing = set(grids) - seen_layers - ({"lm_head"} if tied else set())
    if missing:
        raise GGUFExportError(f"the artifact has codes for {sorted(missing)[0]} but no such weight")
    if requant and src.artifact is not None and any(report_tensors[n].get("grid") for n in requant):
        msg = (f"{sum(1 for n in requant if report_tensors[n].get('grid'))} linear(s) cannot keep their codes as "
               f"{target.name} and are re-quantized by llama.cpp: their calibration (GPTQ/AWQ grid) is not kept")
        warnings.warn(msg, stacklevel=2)
        notes.append(msg)

    if pruned:
        notes.append("pruned weights are written dense with their zeros: llama.cpp gains no speed (and no size) "
                     "from unstructured sparsity")
    coded_requant = [n for n in requant if report_tensors[n].get("grid")]
    for name in requant:
        report_tensors[name]["type"] = f"{REQUANTIZED} ({target.name})"
    imatrix_info = None
    if importance is not None:
        importance, imatrix_info = _importance_for(importance, importance_meta, imatrix, requant, report_tensors,
                                                   target.name)
        notes.append(f"llama.cpp's quantizer weighted by the importance matrix {Path(imatrix).name} "
                     f"({imatrix_info['entries_used']} of the {len(requant)} tensors it quantizes)")
    manifest = {
        "format": "slmedge-gguf-export",
        "source": recorded_path(src.path, out.parent),  # relative to the file (paths.recorded_path): no local path
        "source_kind": "artifact" if src.artifact is not None else "hf_dir",
        "source_manifest_sha256": src.artifact.manifest_sha256 if src.artifact is not None else None,
        "recipe": Recipe.from_dict(recipe).applied() if recipe else None,  # the artifact keeps the whole recipe
        "qtype": target.name,
        "imatrix": imatrix_info,
        "tensors": pack_tensors({n: manifest_entry(t) for n, t in report_tensors.items()}),
    }
    ftype = gguf.LlamaFileType[target.ftype]
    tmp = _tmp_name(out)
    stage = _tmp_name(out, "stage") if requant else None
    try:
        writer = gguf.GGUFWriter(str(stage or tmp), gguf.MODEL_ARCH_NAMES[arch_enum])
        writer.add_name(model_name(src))
        extra = add_hparams(writer, src.config, src.arch, ftype if not requant else gguf.LlamaFileType.ALL_F32)
        tok_info = add_tokenizer(writer, src)
        writer.add_string(MANIFEST_KEY, manifest_text(placeholder_manifest(manifest)))
        extras = dict(extra)
        for name, data in extra:
            plan.append(_Planned(name, name, None, tuple(data.shape), np.dtype(np.float32), None, None, 0.0))
            report_tensors[name] = {"type": "F32", "shape": list(data.shape), "codes_kept": False}
        for item in plan:  # the tensor table first (as GGUFWriter.add_tensor would record it) ...
            writer.add_tensor_info(item.name, item.shape_written, item.dtype, item.nbytes, raw_dtype=item.raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        # ... then each tensor's data as it is read and built, and freed before the next.
        placed = {}  # name -> (offset, bytes) of the code blocks written, for check_requantized
        with progress_stage("export tensors", total=len(plan)) as shown:
            for item, w in _stream(plan, src, extras, skipped):
                data = _build(item, w, src, report_tensors)
                if item.raw is not None:
                    placed[item.name] = (gguf.GGUFWriter.ggml_pad(writer.fout[0].tell(), writer.data_alignment),
                                         data.nbytes)
                writer.write_tensor_data(data)
                del data, w
                shown.advance()
        writer.close()
        if stage is not None:
            with progress_stage("llama.cpp quantize"):
                llamacpp_quantize(stage, tmp, target, n_threads,
                                  keep={name: report_tensors[name]["type"] for name in placed}, imatrix=importance)
            check_requantized(tmp, stage, placed, report_tensors)
        seal_gguf(tmp)  # the file's digest and the manifest's, written into the manifest in place
        verification = None
        if verify:
            kind = target.name if target.name in ("f32", "f16") else ("kept" if has_codes and not coded_requant else
                                                                       "requantized_low_bit" if target.name[:2] in ("q2", "q3")
                                                                       else "requantized")
            with progress_stage("verify in llama.cpp"):
                verification = verify_against_torch(tmp, src, TOLERANCES[kind], probe, n_threads,
                                                    tokenizer_copied=tok_info["source"].startswith("gguf:"))
        os.replace(tmp, out)
    except Exception as exc:
        if disk_full(exc):  # the tensors' bytes (the f32 stage file too when llama.cpp re-quantizes)
            planned = sum(item.nbytes for item in plan)
            raise no_space(out, planned * (2 if stage is not None else 1)) from exc
        raise
    finally:
        for p in (tmp, stage):
            if p is not None:
                Path(p).unlink(missing_ok=True)
    kept = [n for n, t in report_tensors.items() if t["codes_kept"]]
    return {
        "path": str(out),
        "source": str(src.path),
        "source_kind": "artifact" if src.artifact is not None else "hf_dir",
        "architecture": src.layout.arch.lower(),
        "model_type": src.arch.model_type,
        "qtype": target.name,
        "exact": not coded_requant and src.artifact is not None and bool(kept),
        "codes_kept": len(kept),
        "requantized_by_llamacpp": len(requant),
        "imatrix": imatrix_info,
        "tied_embeddings": tied,
        "qk_permuted": bool(src.layout.permute),
        "tokenizer": tok_info,
        "tensors": report_tensors,
        "bytes": out.stat().st_size,
        "verification": verification,
        "notes": notes,
        "seconds": round(time.perf_counter() - started, 2),
    }

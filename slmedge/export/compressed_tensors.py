"""compressed-tensors export: an artifact's codes as the checkpoint transformers and vLLM load.

compressed-tensors (llm-compressor's format) is a Hugging Face folder whose ``config.json``
carries a ``quantization_config`` (``quant_method: compressed-tensors``) and whose safetensors
hold, per quantized linear, ``weight_packed`` (int32 words of 32/bits codes, element i in bits
i*bits.. of its word), ``weight_scale``, ``weight_zero_point`` (asymmetric only, packed the same
way down the rows) and ``weight_shape``. The library writes them: its pack-quantized compressor
packs each linear from the artifact's own weights, scales and zero points, and the packed codes
are then compared with the artifact's (they must be equal: ``w / scale = q - zero`` is exact in
fp32 for the artifact's weights). The config is the library's ``QuantizationConfig``, one config
group per grid with its format named (``pack-quantized``), written by its ``ModelCompressor``.

Sparsity. The releases the tools around slmedge pin (compressed-tensors 0.17 in vLLM 0.33, 0.19 in
llm-compressor 0.14, 0.20 the newest) no longer write a sparsity config (``ModelCompressor`` has none
and writes ``sparsity_config: {}``), and llm-compressor 0.14 writes sparse models the same way.
slmedge follows them: pruned linears are written dense, their pruned weights exactly 0, and the
sparsity (structure, share, linears) is recorded in the export's manifest, not in ``config.json``
(a ``sparsity_config`` there would be read by vLLM to pick 2:4 sparse kernels). Pruned and quantized
linears are pack-quantized with the pruned weights at their zero point (decoding to exactly 0). A
pruned-only artifact is a plain dense checkpoint with no ``quantization_config``: what
llm-compressor writes for sparse-only models, and the only form the readers load (transformers 5
refuses a ``quantization_config`` without config groups: ``'NoneType' object has no attribute
'config_groups'``). compressed-tensors' sparse-bitmask compressors are gone from these releases.

What the format cannot hold is refused before anything is written, with the nearest grid that
works: a group size that does not divide a linear's input width (the artifact's ragged last
group): every reader splits each row into equal groups and stops with ``ValueError: tensor column
shape must be divisble by the given group_size`` (compressed-tensors 0.17, 0.19 and 0.20 alike);
and codes of 3, 5, 6 or 7 bits (0.17 packs 32 // bits of them per word, 0.19 and 0.20 pack them
across words: the same file would decode to different weights). 2, 4 and 8 bits pack alike in all.
slmedge's act-order keeps groups static in the original column order: compressed-tensors'
``actorder: weight``, which has no ``g_idx`` (a ``g_idx`` would be the identity grouping, and sends
vLLM to its slower act-order kernels; 0.19 removed ``actorder: group``'s ``g_idx``).

Before the folder appears, transformers loads it (``from_pretrained``, decompressed on the
CPU in fp32): every compressed linear must decode to the artifact's very weights, and the
logits must equal torch's of the artifact within fp32 rounding. The readers of vLLM 0.33
(compressed-tensors 0.17.0, transformers 5.20) and llm-compressor 0.14 (0.19.0, transformers 5.17)
are checked the same way in their own virtual environments (benchmarks/ct_readers.sh,
tests/test_ct_readers.py).

compressed-tensors is an optional extra (``pip install 'slmedge[compressed-tensors]'``), >=0.17,<0.21:
0.17.0 is vLLM 0.33's pin and 0.19.0 llm-compressor 0.14's, so slmedge installs beside either, and
the releases in the range write the same files for the grids above (the packing of 2, 4 and 8 bits,
the config). 0.17 is the oldest release checked; 0.20.1 the newest.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
import time
import warnings
from pathlib import Path

from ..errors import RuntimeNotInstalledError
from ..fsutil import atomic_directory, check_output_dir, sha256_file
from ..paths import recorded_path
from ..models.artifact_format import QUANT_FILE, WEIGHTS_FILE, is_compact, safetensors_header
from .errors import ExportError, ExportVerificationError
from .formats import get_format, register_format
from .inspect import EXPORT_MANIFEST, _by_type, read_export_manifest, verified_export_manifest, write_export_manifest
from .source import ExportSource, iter_weights, open_export_source
from .verify import check_logits, compare_logits, probe_text, source_tokenizer, torch_logits

FORMAT = "compressed-tensors"
FORMAT_PACKED = "pack-quantized"  # compressed-tensors' format of int codes packed in int32 words
WEIGHTS = "model.safetensors"
PACKAGE = "compressed-tensors"
SUPPORTED = ((0, 17), (0, 21))  # [low, high) of compressed-tensors' (major, minor): 0.17 vLLM 0.33's, 0.20 the newest
INSTALL = "pip install 'slmedge[compressed-tensors]'"
PACKABLE_BITS = (2, 4, 8)  # packed alike by 0.17 (32 // bits per word) and 0.19+ (across words): no spill

# The decoded weights are the artifact's exactly, so only fp32 rounding separates the logits
# (transformers' whole-model forward vs slmedge's block-streamed one).
TOLERANCES: dict[str, dict[str, float]] = {"kept": {"mean_kl": 1e-6, "top1": 0.99}}
MAX_ABS_LOGIT_DIFF = 1e-3


class CompressedTensorsExportError(ExportError):
    """A compressed-tensors export cannot be written as asked (a grid the format cannot hold)."""


class CompressedTensorsVerificationError(CompressedTensorsExportError, ExportVerificationError):
    """transformers' load of the written checkpoint disagrees with the artifact (weights or logits)."""


# --- the library ------------------------------------------------------------------------------


def require_compressed_tensors():
    """The ``compressed_tensors`` module, of a release this exporter writes and reads with; else
    RuntimeNotInstalledError with the install command."""
    import importlib.metadata as md

    try:
        import compressed_tensors
    except ImportError:
        raise RuntimeNotInstalledError(f"compressed-tensors is not installed; install it with: {INSTALL}") from None
    version = md.version(PACKAGE)
    major_minor = tuple(int(p) for p in version.split(".")[:2])
    if not SUPPORTED[0] <= major_minor < SUPPORTED[1]:
        raise RuntimeNotInstalledError(
            f"compressed-tensors {version} is installed; the compressed-tensors export needs "
            f">={'.'.join(map(str, SUPPORTED[0]))},<{'.'.join(map(str, SUPPORTED[1]))} (the releases vLLM 0.33 and "
            f"llm-compressor 0.14 read with, checked here); install it with: {INSTALL}")
    return compressed_tensors


@contextlib.contextmanager
def _quiet():
    """compressed-tensors and transformers report every module they touch (tqdm bars on stderr,
    warnings); an export prints its own report."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


# --- the plan: what each linear becomes, decided before any work ------------------------------


def nearest_group_size(group_size: int, widths) -> int:
    """The largest power of two <= ``group_size`` that divides every width (1 at worst)."""
    g = 1 << (max(1, group_size).bit_length() - 1)
    while g > 1 and any(w % g for w in widths):
        g //= 2
    return g


def cannot_hold(spec, columns: int) -> str | None:
    """Why compressed-tensors cannot hold a ``spec`` grid over ``columns`` inputs (None: it can)."""
    if spec.bits not in PACKABLE_BITS:
        return (f"{spec.bits}-bit codes: compressed-tensors 0.17 packs {32 // spec.bits} per int32 word and 0.19+ "
                "packs them across words, so readers would decode different weights (and vLLM runs 4 and 8 bits)")
    g = spec.group_width(columns)
    if g != columns and columns % g:
        return (f"group size {spec.group_size} does not divide the {columns} input columns (a ragged last group of "
                f"{columns % g}); compressed-tensors splits every row into equal groups (its readers stop with "
                "'tensor column shape must be divisble by the given group_size')")
    return None


def _refusal(name: str, spec, why: str, widths) -> str:
    nearest = "4" if spec.bits < 4 else "8"
    if "bit codes" in why:
        hint = f"compress with --bits {nearest} (codes of 2, 4 or 8 bits are exported as they are)"
    else:
        g = nearest_group_size(spec.group_size, widths)
        hint = (f"compress with --group-size {g} (the largest power of two <= {spec.group_size} dividing every "
                "quantized linear's input width) or --group-size -1 (per channel)")
    return f"{name} ({spec.describe()}) cannot be written as compressed-tensors: {why}; {hint}. Nothing was written"


def _scheme_key(spec, columns: int, act_order: bool) -> tuple:
    """(bits, symmetric, group size or -1 for per channel, act-order): one config group each. A grouped
    grid stays a group strategy where its group spans a whole row (64-column linears in group 64): the
    decoded weights are the same as a per-channel group's, and an artifact with one group size is then one
    config group (transformers 5.21+ decodes every dense layer with a single group's scheme). Per channel,
    the column order cannot show in the format (compressed-tensors allows ``actorder`` on groups only)."""
    if spec.group_size == -1:
        return (spec.bits, spec.symmetric, -1, False)
    return (spec.bits, spec.symmetric, spec.group_width(columns), act_order)


def plan_layers(src: ExportSource) -> dict:
    """name -> {"kind": quantized | pruned | pruned+quantized, "scheme": key, ...} for every compressed
    linear of the artifact; a grid the format cannot hold is refused here (CompressedTensorsExportError)."""
    entries = src.artifact.manifest["layers"]
    coded = {n: e for n, e in entries.items() if "bits" in e}
    widths = sorted({e["shape"][1] for e in coded.values()})
    from ..compress.quant import Grid, entry_spec

    plan = {}
    for name, e in entries.items():
        pruned = "sparsity" in e
        if "bits" not in e:
            plan[name] = {"kind": "pruned", "sparsity": e.get("sparsity")}
            continue
        spec = entry_spec(e)
        if isinstance(spec, Grid):
            raise CompressedTensorsExportError(
                f"{name} is on llama.cpp's {spec.name} grid (GGUF block codes and scales), which compressed-tensors "
                "cannot hold: export it with --format gguf, or compress on the uniform grid (--bits/--group-size, "
                "no --grid) for compressed-tensors. Nothing was written")
        why = cannot_hold(spec, e["shape"][1])
        if why is not None:
            raise CompressedTensorsExportError(_refusal(name, spec, why, widths))
        plan[name] = {"kind": "pruned+quantized" if pruned else "quantized", "spec": spec,
                      "scheme": _scheme_key(spec, e["shape"][1], bool(e.get("act_order"))),
                      "sparsity": e.get("sparsity")}
    return plan


def model_linears(config) -> list[str]:
    """The names of every ``nn.Linear`` of the model ``config`` describes (built on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), _quiet():
        model = AutoModelForCausalLM.from_config(config)
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def weight_args(key: tuple):
    """compressed-tensors' QuantizationArgs of one grid (``_scheme_key``)."""
    from compressed_tensors.quantization import QuantizationArgs

    bits, symmetric, g, act_order = key
    return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="channel" if g == -1 else "group",
                            group_size=None if g == -1 else g, actorder="weight" if act_order else None)


def weight_scheme(key: tuple, targets: list[str]):
    """compressed-tensors' QuantizationScheme of one grid, its format named: a reader then never infers
    one (0.19 and 0.20 try ``int-quantized`` before ``pack-quantized``)."""
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme(targets=targets, weights=weight_args(key), format=FORMAT_PACKED)


def quantization_config(plan: dict, linears: list[str]):
    """compressed-tensors' QuantizationConfig of the plan (None: nothing quantized): one config group per
    grid, targeting ``Linear`` when there is one grid (its names otherwise), every other linear ignored."""
    from compressed_tensors.quantization import QuantizationConfig

    schemes: dict[tuple, list[str]] = {}
    for name, p in plan.items():
        if "scheme" in p:
            schemes.setdefault(p["scheme"], []).append(name)
    if not schemes:
        return None
    groups = {}
    for i, (key, names) in enumerate(sorted(schemes.items(), key=lambda kv: str(kv[0]))):
        groups[f"group_{i}"] = weight_scheme(key, ["Linear"] if len(schemes) == 1 else sorted(names))
    quantized = {n for names in schemes.values() for n in names}
    return QuantizationConfig(config_groups=groups, format=FORMAT_PACKED, quantization_status="compressed",
                              ignore=[n for n in linears if n not in quantized])


def sparsity_record(plan: dict, recipe: dict | None) -> dict | None:
    """The pruned linears' sparsity, for the export's manifest (None when nothing is pruned): format
    ``dense`` (stored with their zeros), the structure (``2:4`` or ``unstructured``), the mean share of
    zeros and the linears. Not written to config.json (see the module's docstring)."""
    pruned = {n: p for n, p in plan.items() if p["kind"] in ("pruned", "pruned+quantized")}
    if not pruned:
        return None
    text = str((recipe or {}).get("sparsity") or "")
    structure = text if ":" in text else "unstructured"
    mean = round(sum(float(p.get("sparsity") or 0) for p in pruned.values()) / len(pruned), 6)
    return {"format": "dense", "sparsity_structure": structure, "global_sparsity": mean, "targets": sorted(pruned)}


# --- the tensors ------------------------------------------------------------------------------


_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}


def _stored_tensors(path: Path, rebuilt: set):
    """(name, tensor) of every weight the artifact stores as it is (in its stored dtype): not rebuilt from
    codes or kept values. A version-1 artifact's dense fp32 weights are all stored."""
    from safetensors import safe_open

    from ..models.artifact_weights import KEPT_SUFFIX, weight_names

    if not is_compact(path):
        yield from ((name, t) for name, t in _iter_torch(path, None) if name not in rebuilt)
        return
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        for name in weight_names(path):
            if name not in rebuilt and not name.endswith(KEPT_SUFFIX):
                yield name, f.get_tensor(name)


def _kept_dtype(path: Path, tensor_name: str):
    """The dtype a pruned-only linear's kept values are stored in (exact for them); fp32 in version 1."""
    import torch

    from ..models.artifact_weights import KEPT_SUFFIX

    header = (safetensors_header(path / WEIGHTS_FILE) or {}) if is_compact(path) else {}
    info = header.get(tensor_name + KEPT_SUFFIX)
    return getattr(torch, _DTYPES.get((info or {}).get("dtype"), "float32"))


def _dense(path: Path, layer: str, entry: dict):
    """The fp32 weight of one compressed linear, as the artifact's loader rebuilds it."""
    from safetensors import safe_open

    from ..models.artifact_weights import rebuild_linear

    if not is_compact(path):
        return next(t for _, t in _iter_torch(path, {f"{layer}.weight"}))
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as wf, \
            safe_open(str(path / QUANT_FILE), framework="pt") as qf:
        return rebuild_linear(layer, entry, qf, wf, f"{layer}.weight")


def _iter_torch(path: Path, names):
    import torch

    for name, w in iter_weights(path, names):
        yield name, torch.from_numpy(w)


def pack_linear(layer: str, res, weight, scheme_key) -> dict:
    """The pack-quantized tensors of one linear (names relative to it), by compressed-tensors' own
    compressor from the artifact's weight, scales and zero points; its codes checked against the
    artifact's (CompressedTensorsExportError when the library chose others)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    scheme = weight_scheme(scheme_key, ["Linear"])
    bits = scheme.weights.num_bits
    offset = 1 << (res.spec.bits - 1)  # compressed-tensors stores codes signed: q - 2**(bits-1)
    zero = (res.zeros.to(torch.int16) - offset).to(torch.int8)
    if res.spec.symmetric and bool((zero != 0).any()):
        raise CompressedTensorsExportError(f"{layer}: symmetric codes whose zero point is not {offset}; "
                                           "compressed-tensors' symmetric grid has none")
    state = {"weight": weight.float(), "weight_scale": res.scales.float()}
    if not res.spec.symmetric:
        state["weight_zero_point"] = zero
    with _quiet():
        out = BaseCompressor.get_value_from_registry(FORMAT_PACKED).compress(state, scheme)
    codes = unpack_from_int32(out["weight_packed"], bits, weight.shape).to(torch.int16) + offset
    if not torch.equal(codes, res.codes.to(torch.int16)):
        bad = int((codes != res.codes.to(torch.int16)).sum())
        raise CompressedTensorsExportError(f"compressed-tensors' packer chose other codes than the artifact's for "
                                           f"{layer} ({bad} of {codes.numel()}); refusing to write them")
    tensors = {"weight_packed": out["weight_packed"].contiguous(), "weight_shape": out["weight_shape"],
               "weight_scale": res.scales.to(torch.float16).contiguous()}
    if not res.spec.symmetric:
        tensors["weight_zero_point"] = out["weight_zero_point"].contiguous()
    return tensors


def _write_tensors(src: ExportSource, plan: dict, dest: Path) -> dict:
    """Write ``model.safetensors``: every stored tensor as it is, each quantized linear pack-quantized,
    each pruned-only linear dense with its zeros. Returns the per-linear report."""
    from safetensors.torch import save_file

    layers = src.layers
    entries = src.artifact.manifest["layers"]
    rebuilt = {f"{n}.weight" for n in plan}
    tensors: dict = {}
    report: dict = {}
    for name in plan:
        p, entry = plan[name], entries[name]
        weight = _dense(src.path, name, entry)
        if p["kind"] == "pruned":
            dtype = _kept_dtype(src.path, f"{name}.weight")  # holds every kept value exactly
            tensors[f"{name}.weight"] = weight.to(dtype).contiguous()
            report[name] = {"type": "dense", "sparsity": p.get("sparsity"), "dtype": str(dtype)[6:],
                            "mask_kept": True}
            continue
        res = layers[name]  # its codes, scales and zeros (read now, dropped after)
        for k, t in pack_linear(name, res, weight, p["scheme"]).items():
            tensors[f"{name}.{k}"] = t
        bits, symmetric, g, act_order = p["scheme"]
        report[name] = {"type": "pack-quantized", "grid": p["spec"].describe(),
                        "strategy": "channel" if g == -1 else f"group {g}", "actorder": "weight" if act_order else None,
                        "codes_kept": True}
        if p["kind"] == "pruned+quantized":
            report[name]["sparsity"] = p.get("sparsity")
        del res, weight
    for name, t in _stored_tensors(src.path, rebuilt):
        tensors[name] = t.contiguous()
    save_file(tensors, str(dest / WEIGHTS), metadata={"format": "pt"})
    return report


def _copy_beside(src: Path, dest: Path) -> None:
    """The config, generation config and tokenizer files (everything but weights and slmedge's own)."""
    from ..models.artifact_format import MANIFEST

    skip = {MANIFEST, QUANT_FILE, WEIGHTS_FILE, "model.safetensors.index.json", EXPORT_MANIFEST}
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in skip and not f.name.endswith((".safetensors", ".bin")):
            shutil.copyfile(f, dest / f.name)


# --- verification -----------------------------------------------------------------------------


def load_checkpoint(path: Path, dtype=None):
    """transformers' model of a compressed-tensors folder, decompressed on the CPU (fp32 by default)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..models.source import decompress_at_load, single_scheme_reader

    with _quiet():  # a pruned-only export is a plain checkpoint: nothing to decompress
        config = AutoConfig.from_pretrained(str(path))
        decompress = decompress_at_load(config)
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32, device_map="cpu",
                                                         **decompress)
        except RuntimeError as exc:
            why = single_scheme_reader(config, exc)
            if why:
                raise CompressedTensorsVerificationError(f"transformers cannot read the export back: {why} "
                                                         "(or --no-verify writes it unverified); nothing was written"
                                                         ) from exc
            raise
    from ..models.architectures import exact_attention

    return exact_attention(model.eval())  # Gemma 2's soft-capping, as the artifact's logits were computed


def verify_against_artifact(out: Path, src: ExportSource, plan: dict, probe: str | None = None) -> dict:
    """transformers' load of ``out`` against the artifact: every compressed linear's decoded weight equal
    to the artifact's bit for bit (or, where this transformers multiplies codes by scales in the stored
    scales' dtype, equal to the artifact's weight rounded to that dtype, bit for bit); then the logits
    on the probe, with the artifact's fp32 weights in those linears, within fp32 rounding of torch's.
    The logits as the reader decodes them are reported beside (``as_decoded``)."""
    import numpy as np
    import torch

    model = load_checkpoint(out)
    state = model.state_dict()
    entries = src.artifact.manifest["layers"]
    scale_dtypes = _scale_dtypes(out / WEIGHTS)
    decoded_in: dict[str, list[str]] = {}
    for name in plan:
        got = state.get(f"{name}.weight")
        want = _dense(src.path, name, entries[name])
        arithmetic = _decoded_as(got, want, scale_dtypes.get(name))
        if arithmetic is None:
            diff = "missing" if got is None or got.shape != want.shape else \
                f"max |Δ| {float((got.float() - want).abs().max()):.3g}"
            raise CompressedTensorsVerificationError(
                f"transformers decodes {name} of the compressed-tensors export to other weights than the artifact's "
                f"({diff}); nothing was written")
        decoded_in.setdefault(arithmetic, []).append(name)
        del got, want
    del state
    ids = source_tokenizer(src.path)(probe_text(probe), add_special_tokens=True)["input_ids"]
    ref = torch_logits(src.path, ids)
    rounded = [n for a, names in decoded_in.items() if a != "float32" for n in names]
    as_decoded = None
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits[0].float().numpy()
        if rounded:  # the reader's arithmetic, measured; then the checkpoint's other parts, exactly
            as_decoded = compare_logits(ref, got)
            for name in rounded:
                model.get_submodule(name).weight.data = _dense(src.path, name, entries[name]).to(
                    model.get_submodule(name).weight.dtype)
            got = model(torch.tensor([ids])).logits[0].float().numpy()
    del model
    stats = check_logits(ref, got, TOLERANCES["kept"], "transformers' logits of the compressed-tensors export "
                         f"disagree with torch's of {src.path.name}", CompressedTensorsVerificationError,
                         weights_equal=len(plan))
    if stats["max_abs_logit_diff"] > MAX_ABS_LOGIT_DIFF:
        raise CompressedTensorsVerificationError(
            f"transformers' logits of the compressed-tensors export differ from torch's of {src.path.name} by "
            f"{stats['max_abs_logit_diff']:.3g} (> {MAX_ABS_LOGIT_DIFF:g}, fp32 rounding); nothing was written")
    stats["max_abs_logit_diff"] = float(np.float32(stats["max_abs_logit_diff"]))
    stats["decoded_in"] = {a: len(names) for a, names in sorted(decoded_in.items())}
    if as_decoded is not None:
        stats["as_decoded"] = {"mean_kl": float(as_decoded["mean_kl"]),
                               "top1_agreement": float(as_decoded["top1_agreement"]),
                               "max_abs_logit_diff": float(np.float32(as_decoded["max_abs_logit_diff"]))}
    return stats


def _scale_dtypes(weights: Path) -> dict:
    """linear name -> the dtype its ``weight_scale`` is stored in (quantized linears only)."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        return {k[:-len(".weight_scale")]: f.get_slice(k).get_dtype() for k in f.keys() if k.endswith(".weight_scale")}


def _decoded_as(got, want, scale_dtype: str | None) -> str | None:
    """How a reader's decoded weight ``got`` relates to the artifact's ``want`` (fp32), bit for bit:
    ``"float32"`` when equal; ``"F16"``/``"BF16"`` when it is the artifact's weight rounded to the stored
    scales' dtype, which is what a reader that multiplies codes by scales in that dtype produces
    (compressed-tensors' decompressor, and transformers from 5.2x on, which calls it); None otherwise."""
    import torch

    if got is None or got.shape != want.shape:
        return None
    got = got.float()
    if torch.equal(got, want):
        return "float32"
    dtype = {"F16": torch.float16, "BF16": torch.bfloat16}.get(scale_dtype or "")
    if dtype is not None and torch.equal(got, want.to(dtype).float()):
        return scale_dtype
    return None


# --- reading an export back -------------------------------------------------------------------


MANIFEST_FORMAT = "slmedge-compressed-tensors-export"


def is_compressed_tensors_folder(path: Path) -> bool:
    """A folder whose config.json says ``quant_method: compressed-tensors``, or one slmedge exported
    in this format (a pruned-only model's has no quantization config)."""
    cfg = Path(path) / "config.json"
    if not Path(path).is_dir() or not cfg.is_file():
        return False
    try:
        qc = json.loads(cfg.read_text(encoding="utf-8")).get("quantization_config") or {}
        ours = (read_export_manifest(path) or {}).get("format") == MANIFEST_FORMAT
    except (OSError, ValueError, AttributeError):
        return False
    return ours or (isinstance(qc, dict) and qc.get("quant_method") == FORMAT)


def _folder(path) -> Path:
    p = Path(path)
    return p if p.is_dir() else p.parent


def ct_model_files(path) -> list[Path]:
    """The safetensors files of a compressed-tensors folder (or the one file given)."""
    p = Path(path)
    return sorted(_folder(p).glob("*.safetensors")) if p.is_dir() or p.suffix == ".safetensors" else [p]


def _linear_rows(folder: Path, qc: dict) -> list:
    """rows of (type, params, bytes) per weight, from the safetensors headers alone."""
    groups = qc.get("config_groups") or {}
    bits = {g.get("weights", {}).get("num_bits") for g in groups.values() if isinstance(g, dict)}
    bits.discard(None)
    label = "pack-quantized int" + "/".join(str(b) for b in sorted(bits)) if bits else "pack-quantized"
    modules: dict[str, dict] = {}
    for f in ct_model_files(folder):
        for key, info in (safetensors_header(f) or {}).items():
            if key == "__metadata__" or not isinstance(info, dict):
                continue
            module, _, leaf = key.rpartition(".")
            start, end = info.get("data_offsets", (0, 0))
            m = modules.setdefault(module, {})
            m[leaf] = (info.get("dtype"), info.get("shape"), end - start)
    rows = []
    for module, parts in sorted(modules.items()):
        if "weight_packed" in parts:
            rows_, cols_ = parts["weight_packed"][1]
            n = rows_ * cols_ * 32 // max(bits or {32})
            rows.append((label, n, sum(p[2] for p in parts.values())))
        elif "bitmask" in parts:  # (rows, ceil(cols / 8)) bits: one per weight
            n = math.prod(parts["bitmask"][1]) * 8
            rows.append((f"sparse-bitmask {str(parts['compressed'][0]).lower()}", n, sum(p[2] for p in parts.values())))
        else:
            for leaf, (dtype, shape, nbytes) in parts.items():
                n = math.prod(shape or [1])
                if n >= 1024:
                    rows.append((str(dtype).lower(), n, nbytes))
    return rows


def inspect_compressed_tensors(path: Path) -> dict:
    """What a compressed-tensors folder holds: its quantization and sparsity configs, bytes per kind."""
    folder = _folder(path)
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    qc = cfg.get("quantization_config") or {}
    rows = _linear_rows(folder, qc)
    groups = {}
    for name, g in (qc.get("config_groups") or {}).items():
        w = (g or {}).get("weights") or {}
        groups[name] = {"targets": g.get("targets"), "bits": w.get("num_bits"), "symmetric": w.get("symmetric"),
                        "strategy": w.get("strategy"), "group_size": w.get("group_size"), "actorder": w.get("actorder")}
    manifest = read_export_manifest(folder)
    if manifest is not None:
        manifest.pop("files", None)
    # a checkpoint written by compressed-tensors <0.15 says it in config.json; slmedge's in its manifest
    sparsity = qc.get("sparsity_config") or (manifest or {}).get("sparsity") or None
    files = ct_model_files(folder)
    params = sum(r[1] for r in rows)
    nbytes = sum(r[2] for r in rows)
    return {
        "path": str(folder), "format": FORMAT, "architecture": cfg.get("model_type"),
        "file_bytes": sum(f.stat().st_size for f in files), "params": params or None,
        "bits_per_weight": round(8 * nbytes / params, 3) if params else None,
        "compression": {"format": qc.get("format"), "version": qc.get("version"),
                        "status": qc.get("quantization_status"), "config_groups": groups,
                        "ignore": qc.get("ignore") or [], "sparsity": sparsity},
        "by_type": _by_type(rows), "manifest": manifest,
    }


def ct_rows(info: dict) -> list[tuple[str, str]]:
    """`slmedge inspect`'s rows for a compressed-tensors folder."""
    c = info["compression"]

    def grid(g: dict) -> str:
        size = f" {g['group_size']}" if g.get("group_size") else ""
        order = f", actorder {g['actorder']}" if g["actorder"] else ""
        return f"W{g['bits']} {g['strategy']}{size} {'sym' if g['symmetric'] else 'asym'}{order}"

    grids = "; ".join(f"{n}: {grid(g)}" for n, g in c["config_groups"].items())
    if c["format"] is None:
        rows = [("compression", "none: a dense checkpoint, every weight as it is (pruned weights are exact zeros)")]
    else:
        rows = [("compression", f"{c['format']} (compressed-tensors {c['version']}, {c['status']})"),
                ("config groups", grids or "none"), ("ignored", ", ".join(c["ignore"])[:300] or "none")]
    s = c.get("sparsity")
    if s:
        rows.append(("sparsity", f"{s.get('format')} {s.get('sparsity_structure')}, {s.get('global_sparsity')} over "
                                 f"{len(s.get('targets') or [])} linears"))
    return rows


def ct_model_facts(path) -> dict:
    """A compressed-tensors folder's config, parameters (from the headers) and that it is quantized."""
    folder = _folder(path)
    info = inspect_compressed_tensors(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return {"config": config, "params": info.get("params"), "quantized": bool(info["compression"]["config_groups"])}


def verified_ct_manifest(path) -> dict | None:
    return verified_export_manifest(path, "compressed-tensors")


def _report_rows(report: dict) -> list[tuple[str, str]]:
    layers = report["layers"].values()
    packed = sum(1 for r in layers if r["type"] == "pack-quantized")
    pruned = sum(1 for r in layers if "sparsity" in r)
    rows = [("compression", f"{report['type']} (compressed-tensors {report['compressed_tensors']})"),
            ("codes kept exactly", f"{packed} linears (pack-quantized)")]
    if pruned:
        rows.append(("pruned", f"{pruned} linears, pruned weights stored as exact zeros"))
    rows.append(("left dense", ", ".join(report["ignore"])[:200] or "none"))
    return rows


# --- the export -------------------------------------------------------------------------------


@register_format(FORMAT, label="compressed-tensors", noun="a compressed-tensors export", single_file=False, suffix="",
                 folder_holds="safetensors, config, tokenizer", default_stem="{model}-compressed-tensors",
                 complete=lambda out: (Path(out) / EXPORT_MANIFEST).is_file(), read_manifest=read_export_manifest,
                 verified_manifest=verified_ct_manifest, model_file=lambda p: _folder(p) / WEIGHTS,
                 model_files=ct_model_files, model_facts=ct_model_facts, tokenizer="beside", packages=(PACKAGE,),
                 types=(), tolerances=TOLERANCES, error=CompressedTensorsExportError, report_rows=_report_rows,
                 inspect=inspect_compressed_tensors, inspect_rows=ct_rows, recognizes=is_compressed_tensors_folder,
                 torch_source=True)
def export_compressed_tensors(source, out_dir, ctype: str = "auto", exact: bool = False, verify: bool = True, *,
                              overwrite: bool = False, probe: str | None = None, n_threads: int | None = None) -> dict:
    """Write the slmedge artifact ``source`` as a compressed-tensors checkpoint folder ``out_dir``
    (``model.safetensors``, config with ``quantization_config``, tokenizer, ``slmedge-export.json``).

    Every quantized linear keeps its codes (pack-quantized), every pruned-only linear its kept values
    and zeros (dense, the sparsity in the config); a grid the format cannot hold is refused before any
    work. ``exact`` changes nothing: codes are always kept or refused. The folder appears only when complete and verified.
    """
    started = time.perf_counter()
    get_format(FORMAT).check_type(ctype)
    check_output_dir(out_dir, overwrite, EXPORT_MANIFEST, inputs=[source])  # before any work
    ct = require_compressed_tensors()
    try:
        src = open_export_source(source, lazy_layers=True)  # one linear's codes at a time
    except ExportError as exc:
        raise CompressedTensorsExportError(str(exc)) from exc
    if src.artifact is None or not src.layers:
        raise CompressedTensorsExportError(
            f"{src.path} has no codes or pruning masks to keep: a compressed-tensors export writes an slmedge "
            "artifact's compressed linears; compress it first (slmedge compress ... -o DIR)")
    plan = plan_layers(src)  # refuses what the format cannot hold, before anything is written
    linears = model_linears(src.config)
    missing = sorted(set(plan) - set(linears))
    if missing:
        raise CompressedTensorsExportError(f"the artifact compressed {missing[0]}, which is not a linear layer of "
                                           f"{src.model_type}; compressed-tensors compresses linears only")
    if src.artifact is not None and getattr(src.config, "tie_word_embeddings", False):
        head = [n for n in plan if n.endswith("lm_head")]
        if head:
            raise CompressedTensorsExportError(
                f"{head[0]} is compressed but tied to the token embedding; compressed-tensors cannot store one "
                "tensor both packed and dense: compress with lm_head skipped (the default)")
    from compressed_tensors.compressors import ModelCompressor

    qconfig = quantization_config(plan, linears)
    sparsity = sparsity_record(plan, src.artifact.manifest.get("recipe"))
    notes = []
    if any(p["kind"] == "pruned+quantized" for p in plan.values()):
        notes.append("pruned and quantized linears are pack-quantized with pruned weights at their zero point "
                     "(decoding to exactly 0); compressed-tensors keeps no separate mask for them")
    if any(p["kind"] in ("pruned", "pruned+quantized") for p in plan.values()):
        notes.append("pruned weights are stored as exact zeros (the sparsity is in the config); transformers and "
                     "vLLM gain no speed from unstructured sparsity")
    with atomic_directory(out_dir, overwrite=overwrite, manifest=EXPORT_MANIFEST) as tmp:
        _copy_beside(src.path, tmp)
        report_layers = _write_tensors(src, plan, tmp)
        if qconfig is not None:  # a pruned-only model: a plain checkpoint (see the module's docstring)
            ModelCompressor(quantization_config=qconfig).update_config(str(tmp))
        verification = verify_against_artifact(tmp, src, plan, probe) if verify else None
        kinds = [k for k, present in (("pack-quantized", qconfig is not None), ("dense", qconfig is None),
                                      ("sparse", sparsity is not None)) if present]
        manifest = write_export_manifest(tmp, {
            "format": MANIFEST_FORMAT,
            "source": recorded_path(src.path, out_dir),  # relative to the folder: no absolute local path
            "source_kind": "artifact",
            "source_manifest_sha256": src.artifact.manifest_sha256,
            "model_type": src.model_type,
            "type": "+".join(kinds),
            "compressed_tensors": ct.__version__,
            "codes_kept": sum(1 for r in report_layers.values() if r.get("codes_kept")),
            # every coded linear placed as it is (a grid the format cannot hold is refused, never requantized)
            "exact": qconfig is not None and any(r.get("codes_kept") for r in report_layers.values()),
            "layers": report_layers,
            "ignore": list(qconfig.ignore) if qconfig is not None else linears,
            "sparsity": sparsity,
            "verification": verification,
            "notes": notes,
        }, started)
    manifest = dict(manifest)
    manifest["path"] = str(out_dir)
    manifest["source"] = str(src.path)  # the report: where this run read it
    manifest["bytes"] = sum(f["bytes"] for n, f in manifest["files"].items() if n.endswith(".safetensors"))
    return manifest

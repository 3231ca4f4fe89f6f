"""ExecuTorch export: a ``.pte`` program with its KV cache, lowered to the XNNPACK delegate.

The decoder is wrapped by transformers' ``TorchExportableModuleForDecoderOnlyLM`` (a static KV cache of
the export's context length inside the program; ``forward(input_ids, cache_position) -> logits``, the
layout ExecuTorch's LLM runner reads), exported with ``torch.export`` (dynamic sequence length: one
method does prefill and decode), lowered with ``to_edge_transform_and_lower(...,
partitioner=[XnnpackPartitioner()])`` and written by ``.to_executorch()``. The folder holds
``model.pte``, the source's ``tokenizer.json`` (what ExecuTorch's LLM runner reads) and configs, and
``slmedge-export.json`` (sealed, with every file's sha256).

Weights:

- ``codes`` (an artifact's default): every coded linear becomes torchao's ``IntxUnpackedToInt8Tensor``
  built from the artifact's own codes and fp16 scales (codes - 2^(bits-1) as int8) on XNNPACK's
  symmetric qd8 kernels (int8 dynamic activations), plus, for asymmetric groups, an fp32 term for what
  their zero points take away (``kept_linear``): the artifact's weights exactly. 4-bit group-wise, 8-bit per channel, group-wise, symmetric or asymmetric;
  groups XNNPACK has no kernel for (not a multiple of 32, or not dividing the inputs) and llama.cpp
  grids are refused before any work;
- ``fp32``: the source's (dequantized) weights;
- ``8da4w``: torchao's own scheme (int8 dynamic activations, int4 symmetric weights), group size
  ``--block-size``, on every decoder linear (not the head).

Every export is checked before it is kept: ExecuTorch's logits of the probe against torch's of the
source weights, and the KV cache path (a prefill, then one token at a time) against the full prefill.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from ..errors import ConfigError, UnsupportedArchitectureError
from ..fsutil import atomic_directory, check_output_dir
from ..paths import recorded_path
from ..progress import stage as progress_stage
from .errors import ExportError, ExportVerificationError
from .formats import get_format, register_format
from .inspect import EXPORT_MANIFEST, read_export_manifest, verified_export_manifest, write_export_manifest
from .source import open_export_source, outlines
from .verify import check_logits, compare_logits, probe_text, source_tokenizer, torch_logits

FORMAT = "slmedge-executorch-export"  # the manifest's "format"
PROGRAM = "model.pte"
TYPES = ("codes", "fp32", "8da4w")
# torchao's schemes offered. Its weight-only ones (4w, 8w: IntxWeightOnlyConfig) are not: lowered to XNNPACK by
# executorch 1.5.1 they ran with top-1 agreement 1% against torch on the tiny llama (the check refused the file).
TORCHAO_TYPES = ("8da4w",)
MAX_CONTEXT = 2048  # the static KV cache's length: the model's positions, at most this
XNNPACK_GROUP = 32  # XNNPACK's group-wise kernels take groups that are multiples of 32 (and divide the inputs)
# The files of the source folder the export carries beside the program.
BESIDE = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "chat_template.jinja")
TOLERANCES: dict[str, dict[str, float]] = {
    "fp32": {"mean_kl": 1e-5, "top1": 0.99},
    # the artifact's weights exactly; XNNPACK's qd8 kernels quantize activations per token (int8), which 30
    # layers amplify: SmolLM2-135M's GPTQ W4 g32 program is at mean KL 0.052, top-1 85% from torch on the
    # artifact's weights (the tiny test models at < 0.02); wrong codes or scales land far outside
    "codes": {"mean_kl": 0.1, "top1": 0.8},
    # torchao chose the values (8da4w also quantizes activations): the program against torchao's quantized model
    # itself in eager torch, i.e. what the lowering changed (how far torchao's values are from the source is
    # recorded beside it, not judged: RTN's loss is the scheme's, SmolLM2's 8da4w is at mean KL 0.72). XNNPACK
    # quantizes the activations a little differently from torchao's eager kernels, which 30 layers of a noisy
    # model amplify: SmolLM2-135M's program is at mean KL 0.054, top-1 89% from its eager model; a lowering
    # that is wrong (torchao's 4w in executorch 1.5.1: off by 185x) lands far outside.
    "requantized": {"mean_kl": 0.1, "top1": 0.8},
}


class ExecuTorchExportError(ExportError):
    """An ExecuTorch export cannot be written as asked."""


class ExecuTorchVerificationError(ExecuTorchExportError, ExportVerificationError):
    """ExecuTorch's logits of the written program disagree with torch's; nothing is left at the output."""


def xnnpack_group_problem(group: int, columns: int) -> str | None:
    """Why XNNPACK has no group-wise kernel for ``group`` over ``columns`` inputs (None: it has)."""
    if group % XNNPACK_GROUP or columns % group:
        return f"a group of {group} over {columns} inputs (XNNPACK needs a multiple of 32 that divides the inputs)"
    return None


def _positive_codes(res):
    """The artifact's codes as XNNPACK's symmetric group-wise kernel can hold them: (qdata int8, scales > 0,
    offset (N, G) fp32). XNNPACK refuses a scale that is not positive ("Failed to define tensor ...:
    xnn_status_invalid_parameter" when the program loads), and slmedge's symmetric codes are Q4_0's
    ``d * (q - 8)`` whose ``d`` is negative where a group's largest magnitude is positive. A group with
    ``d < 0`` is stored as ``|d| * (-(q - 8) - 1)``, which stays in [-8, 7], and ``|d|`` per weight goes to
    the offset; a group with ``d == 0`` as codes 0 and scale 1. With the groups' zero points' share
    ``(mid - zeros) * d``, ``|d'| * qdata + offset`` is ``(codes - zeros) * d`` exactly."""
    import torch

    mid = 1 << (res.spec.bits - 1)
    n, k = res.codes.shape
    g = res.spec.group_width(k)
    d = res.scales.to(torch.float32)  # (N, G)
    q = (res.codes.to(torch.int16) - mid).reshape(n, k // g, g)
    neg, zero = (d < 0).unsqueeze(-1), (d == 0).unsqueeze(-1)
    q = torch.where(neg, -q - 1, q)
    q = torch.where(zero, torch.zeros_like(q), q)
    offset = (mid - res.zeros.to(torch.float32)) * d + torch.where(d < 0, -d, torch.zeros_like(d))
    scales = torch.where(d == 0, torch.ones_like(d), d.abs())
    return q.reshape(n, k).to(torch.int8), scales, offset


def kept_weight(res, codes=None):
    """An artifact's coded linear's (``LinearResult``) codes and scales as torchao's ``IntxUnpackedToInt8Tensor``
    with int8 dynamic activations (XNNPACK's qd8 kernels): int8 codes shifted by 2^(bits-1), zero point 0,
    positive scales (``_positive_codes``; ``codes``: its result, when computed already). XNNPACK's
    group-wise kernels read symmetric weights only (a group's own zero point is lost in lowering, as
    measured with executorch 1.5.1): ``kept_linear`` adds what the groups' zero points (and the sign of a
    negative scale) take away."""
    import torch
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
        IntxUnpackedToInt8Tensor, IntxUnpackedToInt8TensorActivationQuantization)

    n, k = res.codes.shape
    g = res.spec.group_width(k)
    qdata, scales, _ = codes or _positive_codes(res)
    return IntxUnpackedToInt8Tensor(qdata=qdata, scale=scales,
                                    zero_point=torch.zeros((n, k // g), dtype=torch.int8),
                                    target_dtype=getattr(torch, f"int{res.spec.bits}"), block_size=(1, g),
                                    dtype=torch.float32,
                                    activation_quantization=IntxUnpackedToInt8TensorActivationQuantization.INT8_ASYM_PER_TOKEN)


def kept_linear(res, bias=None):
    """A module computing the artifact's linear from its codes: ``x @ (qdata * scales)^T`` on XNNPACK's
    symmetric kernel (``_positive_codes``), plus, where groups have their own zero points or a negative
    scale, ``sum_group(x) @ offset^T`` (fp32, one column per group): together ``x @ ((codes - zeros) *
    scales)^T``, the codes kept as they are."""
    import torch

    class KeptLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            codes = _positive_codes(res)
            self.weight = torch.nn.Parameter(kept_weight(res, codes), requires_grad=False)
            self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)
            n, k = res.codes.shape
            self.group = res.spec.group_width(k)
            offset = codes[2]  # (N, G)
            self.offset = None
            if bool((offset != 0).any()):
                self.offset = torch.nn.Parameter(offset, requires_grad=False)

        def forward(self, x):
            y = torch.nn.functional.linear(x, self.weight, self.bias)
            if self.offset is not None:
                sums = x.reshape(*x.shape[:-1], -1, self.group).sum(-1)
                y = y + torch.nn.functional.linear(sums, self.offset)
            return y

        def dequantized(self):
            w = self.weight.dequantize()
            if self.offset is not None:
                w = w + self.offset.repeat_interleave(self.group, dim=1)
            return w

    return KeptLinear()


def _plan_codes(plan: dict) -> list[str]:
    """The coded linears, each checked keepable (ConfigError, exit 2, before any work)."""
    from ..compress.quant import QuantSpec

    coded = [n for n, o in plan.items() if o.coded]
    for name in coded:
        spec, (_, k) = plan[name].spec, plan[name].shape
        if not isinstance(spec, QuantSpec):
            raise ConfigError(f"{name}: llama.cpp's {spec.name} grid has no ExecuTorch form; export it as --type fp32 "
                              "or to GGUF")
        if spec.bits not in (4, 8):
            raise ConfigError(f"{name}: {spec.bits}-bit codes have no XNNPACK kernel (4 or 8 bits); "
                              "use --type fp32 or a torchao type")
        why = xnnpack_group_problem(spec.group_width(k), k)
        if spec.bits == 8 and spec.group_width(k) != k:  # executorch 1.5.1's lowering: "Only 4b group quantization"
            why = f"8-bit codes in groups of {spec.group_width(k)} (its 8-bit kernels are per channel: --group-size -1)"
        if why:
            raise ConfigError(f"{name}: XNNPACK has no kernel for {why}; use --type fp32 or a torchao type")
    return coded


def row_problem(recipe, etype: str) -> str | None:
    """Why a study row compressed with ``recipe`` (None: the base model) cannot become a program of type
    ``etype``, as far as the recipe tells before any work (a group's fit to the model's inputs is the
    export's own check); None where it can."""
    quantized = recipe is not None and (recipe.bits or recipe.grid or recipe.bpw)
    if etype == "codes" and not quantized:
        return "type codes keeps an artifact's codes and this row has none; use auto, fp32 or a torchao type"
    if etype not in ("auto", "codes") or not quantized:
        return None
    if recipe.grid or recipe.bpw:
        return ("a llama.cpp grid or a bits-per-weight budget has no ExecuTorch form (its codes are kept for 4-bit "
                "groups of multiples of 32 and 8-bit channels); use type fp32 or a torchao type")
    if recipe.bits not in (4, 8):
        return f"{recipe.bits}-bit codes have no XNNPACK kernel (4 or 8 bits); use type fp32 or a torchao type"
    if recipe.bits == 8 and recipe.group_size > 0:
        return (f"XNNPACK has no kernel for 8-bit codes in groups of {recipe.group_size} (its 8-bit kernels are per "
                "channel: group_size = -1); use type fp32 or a torchao type")
    if recipe.group_size > 0 and recipe.group_size % XNNPACK_GROUP:
        return (f"XNNPACK has no kernel for groups of {recipe.group_size} (a multiple of {XNNPACK_GROUP}); use type "
                "fp32 or a torchao type")
    return None


def _torchao_config(group: int):
    """torchao's 8da4w at ``group``."""
    import torch
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerGroup

    return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group))


def _decoder_linears(model) -> dict:
    import torch

    head = model.get_output_embeddings()
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}


def _lower(model, context: int):
    """``model`` with its static KV cache -> an ExecuTorch program (bytes) lowered to XNNPACK."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    from ..backends.executorch import cache_slots

    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static")
    # One cache slot more than the context: a feed of ``context`` tokens (the static cache's Dim must stay
    # below its length) at positions 0..context-1.
    wrapped = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=cache_slots(context))
    seq = torch.export.Dim("seq", min=1, max=context)
    ids = torch.zeros((1, 4), dtype=torch.long)
    with torch.no_grad():
        # strict: torch.export's non-strict trace of the static cache fails in run_decompositions (torch 2.14)
        program = wrapped.export(input_ids=ids, cache_position=torch.arange(4), strict=True,
                                 dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}})
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()],
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False))
    return edge.to_executorch().buffer


def _require():
    from ..backends.executorch import require_executorch

    require_executorch()
    try:
        import torchao  # noqa: F401
    except ImportError as exc:
        from ..backends.executorch import INSTALL, ExecuTorchNotInstalledError

        raise ExecuTorchNotInstalledError(f"torchao is not installed; install it with: {INSTALL}") from exc


def _report_rows(report: dict) -> list[tuple[str, str]]:
    return [("program", f"{PROGRAM}, XNNPACK, context {report['context']}"),
            ("codes kept exactly", f"{report['codes_kept']} linears")]


def _folder(path) -> Path:
    return Path(path) if Path(path).is_dir() else Path(path).parent


def inspect_executorch(path: Path) -> dict:
    """What an ExecuTorch export folder holds, as its manifest and config say (the program is not loaded)."""
    import json

    folder = _folder(path)
    cfg = folder / "config.json"
    manifest = read_export_manifest(folder) or {}
    manifest.pop("files", None)
    params = _config_params(folder)
    nbytes = (folder / PROGRAM).stat().st_size
    return {"path": str(folder), "format": "executorch",
            "architecture": json.loads(cfg.read_text(encoding="utf-8")).get("model_type") if cfg.is_file() else None,
            "file_bytes": nbytes, "params": params, "bits_per_weight": round(8 * nbytes / params, 3) if params else 0,
            "by_type": {}, "manifest": manifest or None}


def _config_params(folder: Path) -> int:
    """The model's parameters, from the config beside the program on the meta device (nothing
    allocated); 0 without one."""
    if not (folder / "config.json").is_file():
        return 0
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..quiet import quiet_torch_loggers

    quiet_torch_loggers()  # transformers imports torchao when it is installed
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)))
    return sum(p.numel() for p in model.parameters())


def executorch_model_facts(path) -> dict:
    """A program's shape (the config beside it), parameters, whether it runs integer kernels (XNNPACK's
    qd8 kernels: an artifact's codes, torchao's 8da4w) and its static KV cache's length (transformers'
    static cache: attention reads every slot, masked, at each step), for the roofline and the report."""
    import json

    from ..backends.executorch import cache_slots

    folder = _folder(path)
    cfg = folder / "config.json"
    config = json.loads(cfg.read_text(encoding="utf-8")) if cfg.is_file() else {}
    config = config.get("text_config") or config  # a multimodal config's decoder (Gemma 3)
    manifest = read_export_manifest(folder) or {}
    context = manifest.get("context")
    return {"config": config, "params": _config_params(folder) or None,
            "quantized": manifest.get("type") in ("codes", *TORCHAO_TYPES),
            # the static cache's slots, every one read at each decode step
            "kv_positions": cache_slots(int(context)) if context else None}


def _inspect_rows(info: dict) -> list[tuple[str, str]]:
    m = info["manifest"] or {}
    return [("program", f"{PROGRAM}, {m.get('backend', '?')}, type {m.get('type', '?')}, context {m.get('context', '?')}"),
            ("codes kept exactly", f"{m.get('codes_kept', 0)} linears")]


@register_format("executorch", label="ExecuTorch", noun="an ExecuTorch export", single_file=False, suffix=".pte",
                 folder_holds="model.pte, tokenizer, config", default_stem="{model}-executorch-{type}",
                 complete=lambda out: (Path(out) / EXPORT_MANIFEST).is_file(), read_manifest=read_export_manifest,
                 verified_manifest=lambda p: verified_export_manifest(p, "ExecuTorch"),
                 model_file=lambda p: Path(p) / PROGRAM if Path(p).is_dir() else Path(p),
                 tokenizer="beside", packages=("executorch", "torchao"), require=_require, row_problem=row_problem,
                 types=TYPES, tolerances=TOLERANCES, model_facts=executorch_model_facts,
                 options=("block_size",), error=ExecuTorchExportError, report_rows=_report_rows,
                 inspect=inspect_executorch, inspect_rows=_inspect_rows, recognizes=lambda p: (Path(p) / PROGRAM).is_file())
def export_executorch(source, out_dir, etype: str = "auto", exact: bool = False, verify: bool = True, *,
                      overwrite: bool = False, probe: str | None = None, n_threads: int | None = None,
                      block_size: int = 32) -> dict:
    """Write ``source`` (an slmedge artifact or an HF folder) as an ExecuTorch export folder ``out_dir``.

    ``etype``: ``auto`` (``codes`` for an artifact with codes, else ``fp32``), ``codes``, ``fp32``, or
    torchao's ``8da4w`` at group size ``block_size``."""
    started = time.perf_counter()
    key = get_format("executorch").check_type(etype)
    _require()
    check_output_dir(out_dir, overwrite, EXPORT_MANIFEST, inputs=[source])  # before any work
    src = open_export_source(source, lazy_layers=True)
    from ..models.architectures import ARCHITECTURES

    if src.model_type not in ARCHITECTURES:
        raise UnsupportedArchitectureError(f"ExecuTorch export does not support architecture '{src.model_type}'; "
                                           f"supported: {', '.join(ARCHITECTURES)}")
    plan = outlines(src.layers)
    has_codes = any(o.coded for o in plan.values())
    key = ("codes" if has_codes else "fp32") if key == "auto" else key
    if key == "codes" and not has_codes:
        raise ConfigError(f"--type codes: {src.path} has no codes to keep; choose fp32 or a torchao type "
                          f"({', '.join(TORCHAO_TYPES)})")
    if exact and key != "codes":
        raise ConfigError(f"--exact: {key} does not keep the artifact's codes; use --type codes")
    coded = _plan_codes(plan) if key == "codes" else []
    notes: list[str] = []
    if key in TORCHAO_TYPES:
        from .source import weight_shapes

        for name, shape in weight_shapes(src.path):
            if name.endswith(".weight") and len(shape) == 2 and "embed" not in name and "lm_head" not in name \
                    and "norm" not in name:
                why = xnnpack_group_problem(block_size, shape[1])
                if why:
                    raise ConfigError(f"--block-size: XNNPACK has no kernel for {why} ({name})")
        if has_codes:
            notes.append(f"{key} re-quantizes every decoder linear with torchao: the artifact's codes are not kept")
    elif key == "fp32" and has_codes:
        notes.append("fp32 holds the artifact's dequantized weights, not its codes")
    positions = int(getattr(src.config.get_text_config(), "max_position_embeddings", MAX_CONTEXT) or MAX_CONTEXT)
    context = min(positions, MAX_CONTEXT)
    with atomic_directory(out_dir, overwrite=overwrite, manifest=EXPORT_MANIFEST) as tmp:
        import torch

        from .verify import torch_model

        model = torch_model(src.path).eval()
        layers, requantized = {}, 0
        if key == "codes":
            linears = _decoder_linears(model)
            for name in coded:
                if name not in linears:
                    raise ExecuTorchExportError(f"the artifact has codes for {name} but the model has no such linear")
                res = src.layers[name]
                kept = kept_linear(res, linears[name].bias)
                if not torch.allclose(kept.dequantized(), linears[name].weight.detach(), rtol=2**-10, atol=1e-6):
                    raise ExecuTorchExportError(f"the codes of {name} do not dequantize to the artifact's weight")
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, kept)
                layers[name] = {"grid": res.spec.describe(), "codes_kept": True}
        elif key in TORCHAO_TYPES:
            from torchao.quantization import quantize_

            head = model.get_output_embeddings()
            requantized = len(_decoder_linears(model))
            quantize_(model, _torchao_config(block_size),
                      filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and m is not head)
            if verify:  # the reference: torchao's quantized model in eager torch, on the probe
                ids = source_tokenizer(src.path)(probe_text(probe), add_special_tokens=True)["input_ids"][:context]
                with torch.no_grad():
                    eager = (ids, model(torch.tensor([ids])).logits[0].float().numpy())
        with progress_stage("export and lower to XNNPACK"):
            buffer = _lower(model, context)
        del model
        (tmp / PROGRAM).write_bytes(buffer)
        del buffer
        for name in BESIDE:
            if (src.path / name).is_file():
                shutil.copyfile(src.path / name, tmp / name)
        kind = "requantized" if key in TORCHAO_TYPES else key
        verification = None
        if verify:
            with progress_stage("verify in ExecuTorch"):
                verification = verify_against_torch(tmp, src.path, TOLERANCES[kind], probe,
                                                    eager if key in TORCHAO_TYPES else None)
        manifest = write_export_manifest(tmp, {
            "format": FORMAT,
            "source": recorded_path(src.path, out_dir),
            "source_kind": "artifact" if src.artifact is not None else "hf_dir",
            "source_manifest_sha256": src.artifact.manifest_sha256 if src.artifact is not None else None,
            "model_type": src.model_type,
            "type": key,
            "group_size": block_size if key in TORCHAO_TYPES else None,
            "context": context,
            "backend": "XNNPACK",
            "exact": key == "codes",
            "codes_kept": len(layers),
            "requantized_by_torchao": requantized,  # the linears torchao quantized (8da4w)
            "layers": layers,
            "verification": verification,
            "notes": notes,
        }, started)
    report = dict(manifest)
    report["path"] = str(out_dir)
    report["source"] = str(src.path)
    report["bytes"] = manifest["files"][PROGRAM]["bytes"]
    return report


def verify_against_torch(folder: Path, src_path: Path, tolerance: dict, probe: str | None = None,
                         eager: tuple | None = None) -> dict:
    """ExecuTorch's logits of the program against torch's of the source weights (or, with ``eager`` = (ids,
    logits), against those: torchao's quantized model in eager torch, the source's own logits then recorded
    under ``vs_source``); then its KV cache path."""
    import numpy as np

    from ..backends.executorch import EtDecoder

    dec = EtDecoder(folder)
    if eager is None:
        ids = source_tokenizer(src_path)(probe_text(probe), add_special_tokens=True)["input_ids"][: dec.max_tokens]
        ref, against, extra = torch_logits(src_path, ids), f"torch's of {src_path.name}", {}
    else:
        ids, ref = list(eager[0][: dec.max_tokens]), eager[1][: dec.max_tokens]
        against = f"torchao's quantized model's in torch ({src_path.name})"
        source = compare_logits(torch_logits(src_path, ids), ref)
        extra = {"against": "torchao-eager", "vs_source": {k: source[k] for k in ("mean_kl", "top1_agreement")}}
    got = dec.logits(ids)
    inc = dec.incremental_logits(ids, max(1, len(ids) // 2))
    stats = check_logits(ref, got, tolerance, f"ExecuTorch's logits of the program disagree with {against}",
                         ExecuTorchVerificationError, kv_cache_max_abs_diff=float(np.abs(inc - got).max()), **extra)
    if compare_logits(got, inc)["mean_kl"] > max(1e-4, tolerance["mean_kl"] / 2):
        raise ExecuTorchVerificationError("the ExecuTorch program's KV cache path disagrees with its full prefill; "
                                          "nothing was written")
    return stats

"""ONNX export: the decoder traced with its KV cache; the artifact's codes become MatMulNBits.

The graph (``onnx_stub.trace_decoder``, torch.onnx's TorchScript exporter around the model) takes
``input_ids``, ``attention_mask``, ``position_ids`` and ``past_key_values.N.key/value`` and gives
``logits`` and ``present.N.key/value``: the layout onnxruntime, onnxruntime-genai and optimum's
``ORTModelForCausalLM`` read. What no exporter does is place calibrated integer codes, so that step
is ours:

- every ``MatMul`` whose weight is a compressed linear (found by its node name, checked by value
  against the artifact's dequantized weight) becomes ``com.microsoft::MatMulNBits`` with
  ``block_size`` = the artifact's group size, the codes packed as they are (element 2i in the low
  nibble), fp32 scales (the artifact's fp16 values), and packed zero points unless every group
  has the type's default zero (2^(bits-1), i.e. symmetric codes). A ragged last group is padded
  with its zero point (padding decodes to 0). MatMulNBits decodes ``(q - zp) * scale``: exactly
  the artifact's weights;
- MatMuls without codes (lm_head, skipped layers) get onnxruntime's own 8-bit weight-only RTN,
  and the token embedding is stored in fp16 behind a Cast, so the file is not dominated by
  fp32 tables (``--keep-fp32-head`` keeps both as they are);
- for sources without codes (or codes no ONNX type can hold) ``int4``/``int8`` use
  onnxruntime's quantizer (``MatMulNBitsQuantizer``, RTN, block 32) and ``int8-dynamic`` its
  ``quantize_dynamic`` (int8 weights, activations quantized at run time).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..compress.quant import QuantSpec, pack_codes
from ..errors import UnsupportedArchitectureError
from ..fsutil import atomic_directory, check_output_dir, sealed, sha256_file, write_json_atomic
from ..paths import recorded_path
from ..procs import native
from ..progress import stage as progress_stage
from .errors import ONNXExportError, ONNXVerificationError  # noqa: F401 - re-exported
from .formats import get_format, register_format
from .inspect import (EXPORT_MANIFEST, inspect_onnx, is_onnx_folder, onnx_model_facts, onnx_model_files, onnx_rows,
                      read_onnx_manifest, verified_onnx_manifest)
from .source import iter_weights, open_export_source, outlines
from .verify import check_logits, compare_logits, probe_text, source_tokenizer, torch_logits

ONNX_TYPES = ("fp32", "fp16", "int4", "int8", "int8-dynamic", "ort-rtn", "ort-k_quant", "ort-hqq")
# onnxruntime's own int4 quantizers, as an onnxruntime user calls them: MatMulNBitsQuantizer on every MatMul
# with a constant weight (the head included), 4-bit, asymmetric (its default), block --block-size, with the
# algorithm named. What onnxruntime gives for free: the baselines of a study, or a file of their own. On an
# artifact, its weights are dequantized and re-quantized by that algorithm (the codes are not kept).
ORT_ALGOS = {"ort-rtn": "rtn", "ort-k_quant": "k_quant", "ort-hqq": "hqq"}
LARGE = 2 * 1024**3 - 64 * 1024**2  # protobuf's 2 GB limit, with room for the graph itself

# Verification tolerances against torch logits of the source weights (fp32). "kept": codes
# placed as they are (MatMulNBits dequantizes exactly; the 8-bit head and fp16 embedding add a
# little); "requantized": onnxruntime's quantizer chose the values.
TOLERANCES: dict[str, dict[str, float]] = {
    "fp32": {"mean_kl": 1e-5, "top1": 0.99},
    "fp16": {"mean_kl": 2e-3, "top1": 0.9},
    "kept": {"mean_kl": 0.02, "top1": 0.85},
    "requantized": {"mean_kl": 0.5, "top1": 0.3},
    # codes kept, the head or the embedding 4-bit (--head-type/--embedding-type int4): a 4-bit head moves
    # every logit (SmolLM2-135M's GPTQ g32 codes with both 4-bit: mean KL 0.109, top-1 81% against torch
    # of the artifact), and the nearly flat logits of a tiny random model change their argmax often
    "kept-4bit-tables": {"mean_kl": 0.25, "top1": 0.6},
}


# --- architectures ----------------------------------------------------------------------------


def onnx_architectures() -> list[str]:
    """slmedge's architectures the ONNX export traces: every one in the table (the trace is the model's own
    forward; tests/test_export_onnx.py exports, runs and checks each one's tiny model)."""
    from ..models.architectures import ARCHITECTURES

    return list(ARCHITECTURES)


# --- codes -> MatMulNBits ---------------------------------------------------------------------


def cannot_place(spec: QuantSpec, columns: int) -> str | None:
    """Why a ``spec`` grid over ``columns`` inputs cannot be MatMulNBits blocks (None: it can). A llama.cpp
    grid (``models.grids``) never can: its scales are products of sub-block codes, its levels may be
    non-uniform or offset by a float min, none of which MatMulNBits' scale and integer zero point hold."""
    if not isinstance(spec, QuantSpec):
        return (f"llama.cpp's {spec.name} grid has no MatMulNBits form (its codes are kept in GGUF only); "
                "its dequantized weights are re-quantized")
    g = spec.group_width(columns)
    if g < 16 or g & (g - 1):
        what = "per-channel group" if spec.group_size == -1 or g == columns else f"group size {spec.group_size}"
        return f"{what} of {g} columns is not a power of two >= 16 (MatMulNBits block size)"
    return None


def matmulnbits_tensors(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, spec: QuantSpec):
    """(N, K) codes, (N, G) scales/zeros -> (bits, block_size, B, scales, zero_points or None)."""
    n, k = codes.shape
    bs = spec.group_width(k)
    nb = math.ceil(k / bs)
    bits = 4 if spec.bits <= 4 else 8
    zeros = np.asarray(zeros, dtype=np.uint8)
    pad = nb * bs - k
    if pad:  # a ragged last group: pad with its zero point, which decodes to exactly 0
        codes = np.concatenate([codes, np.repeat(zeros[:, -1:], pad, axis=1)], axis=1)
    import torch

    packed = pack_codes(torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)), bits).numpy()
    b = packed.reshape(n, nb, bs * bits // 8)
    s = np.asarray(scales, dtype=np.float32).reshape(n * nb)
    if np.all(zeros == 2 ** (bits - 1)):
        zp = None  # MatMulNBits' default zero point
    elif bits == 4:
        zp = pack_codes(torch.from_numpy(np.ascontiguousarray(zeros)), 4).numpy().reshape(-1)
    else:
        zp = zeros.reshape(-1).copy()
    return bits, bs, b, s, zp


def untie_head(model) -> list[str]:
    """A MatMul fed by ``Transpose(initializer)`` (a tied lm_head) gets its own transposed constant,
    so weight-only quantizers see a constant weight and ``embeddings_to_fp16`` can shrink the table."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    consumers: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers[i] = consumers.get(i, 0) + 1
    done, drop = [], set()
    for node in model.graph.node:
        if node.op_type != "MatMul":
            continue
        t = producers.get(node.input[1])
        if t is None or t.op_type != "Transpose" or t.input[0] not in inits:
            continue
        perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), None)
        data = numpy_helper.to_array(inits[t.input[0]])
        data = np.ascontiguousarray(data.transpose(perm) if perm else data.T)
        name = node.name.strip("/").replace("/", ".") + ".weight_t"
        model.graph.initializer.append(numpy_helper.from_array(data, name))
        node.input[1] = name
        if consumers.get(t.output[0], 0) == 1:
            drop.add(id(t))
        done.append(node.name)
    if drop:
        keep = [n for n in model.graph.node if id(n) not in drop]
        del model.graph.node[:]
        model.graph.node.extend(keep)
    return done


def embeddings_to_fp16(model, min_elements: int = 1 << 20) -> list[str]:
    """Store large fp32 tables read only by Gather (token embeddings) in fp16; cast the rows back."""
    from onnx import TensorProto, helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    users: dict[str, set] = {}
    for n in model.graph.node:
        for i in n.input:
            users.setdefault(i, set()).add(n.op_type)
    changed, nodes = [], []
    for node in model.graph.node:
        nodes.append(node)
        if node.op_type != "Gather" or node.input[0] not in inits or users.get(node.input[0]) != {"Gather"}:
            continue
        init = inits[node.input[0]]
        if init.data_type != TensorProto.FLOAT or int(np.prod(init.dims)) < min_elements:
            continue
        if init.name not in changed:
            half = numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name)
            init.CopyFrom(half)
            changed.append(init.name)
        out = node.output[0]
        node.output[0] = out + "_fp16"
        nodes.append(helper.make_node("Cast", [out + "_fp16"], [out], name=node.name + "_to_fp32", to=TensorProto.FLOAT))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return changed


EMBEDDING_TYPES = ("fp16", "int8", "int4")  # the token embedding: fp16 behind a Cast, or GatherBlockQuantized
HEAD_TYPES = ("int8", "int4")  # linears without codes (the head, skipped ones) beside an artifact's codes: MatMulNBits
# The range shrinks a block's scale is searched over (its min and max times each), the one with the
# least squared error kept per block: llama.cpp's make_qx_quants idea on onnxruntime's (scale, zero point) grid.
CLIPS = tuple(round(1.0 - 0.025 * i, 3) for i in range(17))  # 1.0 ... 0.6
_SEARCH_ROWS = 8192  # rows searched at once (a 262k-row embedding's fp32 copies stay small)


def searched_codes(w: np.ndarray, bits: int, block: int, symmetric: bool):
    """Block-wise codes of ``w`` (rows, cols) along its columns, each block's scale (and zero point) the one
    of ``CLIPS`` that rounds it with the least squared error, not min/max: (codes uint8, scales fp16-valued
    float32, zeros uint8), each (rows, ...) as ``matmulnbits_tensors`` takes them."""
    import torch

    from ..compress.quant import quantize_groups

    spec = QuantSpec(bits=bits, group_size=block, symmetric=symmetric)
    rows, cols = w.shape
    gid = torch.arange(cols) // spec.group_width(cols)
    groups = spec.num_groups(cols)
    codes, scales, zeros = [], [], []
    for start in range(0, rows, _SEARCH_ROWS):
        part = torch.from_numpy(np.ascontiguousarray(w[start:start + _SEARCH_ROWS], dtype=np.float32))
        best = torch.full((part.shape[0], groups), float("inf"))
        clip = torch.ones(part.shape[0], groups)
        for c in CLIPS:
            deq = quantize_groups(part, spec, clip=c)[0]
            err = torch.zeros(part.shape[0], groups).index_add_(1, gid, (deq - part).square_())
            better = err < best
            best = torch.where(better, err, best)
            clip = torch.where(better, torch.full_like(clip, c), clip)
        _, q, s, z = quantize_groups(part, spec, clip=clip)
        codes.append(q.numpy())
        scales.append(s.float().numpy())
        zeros.append(z.numpy())
    return np.concatenate(codes), np.concatenate(scales), np.concatenate(zeros), QuantSpec(bits, block, symmetric)


def _type_bits(kind: str) -> int:
    return 4 if kind == "int4" else 8


def tied_tables(model) -> dict[str, str]:
    """MatMul node -> the initializer it reads through a Transpose (a head tied to the token embedding)."""
    inits = {i.name for i in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    out = {}
    for node in model.graph.node:
        t = producers.get(node.input[1]) if node.op_type == "MatMul" else None
        if t is not None and t.op_type == "Transpose" and t.input[0] in inits:
            out[node.name] = t.input[0]
    return out


def quantize_uncoded(model, names: list[str], kind: str, block_size: int, accuracy_level: int) -> dict[str, tuple]:
    """The MatMuls ``names`` (constant weights, no codes: the head, skipped linears) become MatMulNBits of
    ``kind`` (int4: asymmetric; int8: symmetric) at ``block_size``, scales searched (``searched_codes``).
    Returns node name -> (codes, scales, zero points initializer names, spec, K) for sharing with a tied
    embedding (``quantize_embeddings``)."""
    from onnx import numpy_helper

    from .onnx_stub import nbits_replacement

    bits = _type_bits(kind)
    inits = {i.name: i for i in model.graph.initializer}
    want = set(names)
    made, nodes, drop = {}, [], set()
    for node in model.graph.node:
        if node.name not in want or node.input[1] not in inits:
            nodes.append(node)
            continue
        w_t = numpy_helper.to_array(inits[node.input[1]])  # (K, N)
        k, n = w_t.shape
        q, s, z, spec = searched_codes(w_t.T, bits, min(block_size, 1 << (k.bit_length() - 1)) if k < block_size
                                       else block_size, symmetric=bits == 8)
        del w_t
        bits_, bs, b, sc, zp = matmulnbits_tensors(q, s, z, spec)
        layer = node.name.strip("/").replace("/", ".").removesuffix(".MatMul")
        new_nodes, tensors = nbits_replacement(node, layer, k, n, bits_, bs, b, sc, zp, accuracy_level)
        nodes.extend(new_nodes)
        model.graph.initializer.extend(tensors)
        drop.add(node.input[1])
        made[node.name] = (tensors[0].name, tensors[1].name, tensors[2].name if zp is not None else None, spec, k)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    _drop_unused(model, drop)
    return made


def _drop_unused(model, names: set) -> None:
    used = {i for n in model.graph.node for i in n.input}
    keep = [i for i in model.graph.initializer if i.name not in names or i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)


def quantize_embeddings(model, kind: str, block_size: int, shared: Mapping[str, tuple] | None = None) -> dict[str, bool]:
    """The fp32 tables read only by Gather of ``input_ids`` (the token embedding) become ``com.microsoft::GatherBlockQuantized``
    (uint8 data, ``bits`` 4 or 8, blocks of ``block_size`` along the hidden size, fp16 scales, zero points
    unless symmetric; int4 asymmetric, int8 symmetric; scales searched by ``searched_codes``), its rows cast
    back to fp32. ``shared``: table -> a tied head's MatMulNBits tensors (``quantize_uncoded``); a table of
    the same bits and block, whose width the block divides, is read from those through Reshapes (one copy
    of the codes for both). Returns table -> whether it reads a tied head's codes."""
    import torch
    from onnx import TensorProto, helper, numpy_helper

    from ..compress.quant import pack_codes

    bits = _type_bits(kind)
    inits = {i.name: i for i in model.graph.initializer}
    users: dict[str, set] = {}
    for n in model.graph.node:
        for i in n.input:
            users.setdefault(i, set()).add(n.op_type)
    done: dict[str, tuple] = {}  # table -> (the GatherBlockQuantized inputs: data, scales, zero points; fp32 scales)
    nodes, drop = [], set()
    for node in model.graph.node:
        table = node.input[0] if node.input else ""
        if node.op_type != "Gather" or table not in inits or users.get(table) != {"Gather"}:
            nodes.append(node)
            continue
        init = inits[table]
        if init.data_type != TensorProto.FLOAT or len(init.dims) != 2 or node.input[1] != "input_ids":
            nodes.append(node)
            continue
        rows, cols = (int(d) for d in init.dims)
        if table not in done:
            tied = (shared or {}).get(table)
            if tied is not None and tied[3].bits == bits and tied[3].group_size == block_size and cols % block_size == 0:
                names = []
                for src in (tied[0], tied[1], tied[2]):
                    if src is None:
                        continue
                    shape = numpy_helper.from_array(np.asarray([rows, -1], dtype=np.int64), f"{src}_rows_shape")
                    model.graph.initializer.append(shape)
                    nodes.append(helper.make_node("Reshape", [src, shape.name], [f"{src}_rows"], name=f"{src}_rows"))
                    names.append(f"{src}_rows")
                done[table] = (names, True)
            else:
                q, s, z, spec = searched_codes(numpy_helper.to_array(init), bits, block_size, symmetric=bits == 8)
                data = pack_codes(torch.from_numpy(np.ascontiguousarray(q)), 4).numpy() if bits == 4 else q
                tensors = [numpy_helper.from_array(np.ascontiguousarray(data, dtype=np.uint8), table + "_Q"),
                           numpy_helper.from_array(s.astype(np.float16), table + "_scales")]
                if not np.all(z == 2 ** (bits - 1)):
                    zp = z if bits == 8 else pack_codes(torch.from_numpy(np.ascontiguousarray(z)), 4).numpy()
                    tensors.append(numpy_helper.from_array(np.ascontiguousarray(zp, dtype=np.uint8), table + "_zp"))
                model.graph.initializer.extend(tensors)
                done[table] = ([t.name for t in tensors], False)
            drop.add(table)
        (data, scales, *zp), fp32_scales = done[table]
        out = node.output[0]
        fp16_out = not fp32_scales
        nodes.append(helper.make_node("GatherBlockQuantized", [data, node.input[1], scales, *zp],
                                      [out + "_fp16" if fp16_out else out], name=node.name + "_quantized",
                                      domain="com.microsoft", gather_axis=0, quantize_axis=1, block_size=block_size,
                                      bits=bits))
        if fp16_out:
            nodes.append(helper.make_node("Cast", [out + "_fp16"], [out], name=node.name + "_to_fp32", to=TensorProto.FLOAT))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    _drop_unused(model, drop)
    if done and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return {t: fp32 for t, (_, fp32) in sorted(done.items())}


def check_head_options(embedding_type: str, head_type: str, keep_fp32_head: bool) -> None:
    """--embedding-type and --head-type: known types, and not beside --keep-fp32-head (ConfigError, exit 2)."""
    from ..errors import ConfigError

    if embedding_type not in EMBEDDING_TYPES:
        raise ConfigError(f"--embedding-type: unknown {embedding_type!r}; choose from {', '.join(EMBEDDING_TYPES)}")
    if head_type not in HEAD_TYPES:
        raise ConfigError(f"--head-type: unknown {head_type!r}; choose from {', '.join(HEAD_TYPES)}")
    if keep_fp32_head and (embedding_type, head_type) != ("fp16", "int8"):
        raise ConfigError("--keep-fp32-head keeps the head and the embedding fp32; it cannot go with "
                          "--embedding-type or --head-type")


def ort_quantize_matmuls(model, bits: int, block_size: int, symmetric: bool, accuracy_level: int,
                         exclude: list[str] | None = None, algo: str | None = None):
    """onnxruntime's own weight-only quantizer on every MatMul with a constant weight (not in ``exclude``):
    its default (RTN in its C++ kernel), or ``algo`` (``rtn``, ``k_quant``, ``hqq``: its algorithm configs)."""
    from onnxruntime.quantization import matmul_nbits_quantizer as q

    if algo is None:
        config = q.DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric,
                                                accuracy_level=accuracy_level, bits=bits)
    else:
        config = {"rtn": lambda: q.RTNWeightOnlyQuantConfig(),
                  "k_quant": lambda: q.KQuantWeightOnlyQuantConfig(),
                  "hqq": lambda: q.HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits)}[algo]()
    quant = q.MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=symmetric,
                                   accuracy_level=accuracy_level, nodes_to_exclude=exclude or [], algo_config=config)
    with warnings.catch_warnings(), _quiet_root_logger(), native("onnxruntime's quantizer", "the ONNX model being exported"), \
            open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # its algorithms print a progress bar
        warnings.simplefilter("ignore")
        try:
            quant.process()
        except (ValueError, RuntimeError, TypeError, IndexError) as exc:  # its algorithms' own checks, in numpy's words
            raise ONNXExportError(f"onnxruntime's {algo or 'default'} quantizer failed at block {block_size}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    return quant.model.model


@contextlib.contextmanager
def _quiet_root_logger():
    """onnxruntime's quantizers log every node at INFO on the root logger."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        root.setLevel(level)


# --- the export -------------------------------------------------------------------------------


def _auto_type(plan: dict) -> str:
    """int4/int8 from the artifact's codes (``LinearOutline`` per linear), else fp32."""
    coded = [o for o in plan.values() if o.coded]
    if not coded:
        return "fp32"
    return "int4" if max(o.spec.bits for o in coded) <= 4 else "int8"


def _save(model, path: Path) -> None:
    import onnx

    try:
        size = model.ByteSize()
        large = size > LARGE
    except Exception:  # noqa: BLE001 - protobuf refuses to size messages past 2 GB
        large = True
    if large:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + "_data", size_threshold=1024)
    else:
        onnx.save_model(model, str(path))


# The files of a model folder that an ONNX export carries beside the graph: the model's config and its tokenizer.
_BESIDE = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")


def trace_export(src_path: Path, config, out: Path, fp16: bool):
    """The decoder of ``src_path`` traced into ``out/model.onnx`` (its config and tokenizer files copied
    beside it); returns the graph (``onnx.ModelProto``), its linears' stubs, the linears and the tied ones.

    The model traced holds no linear weight (``onnx_stub.build_stub_model``): each linear is a stub in the
    graph, and the caller places its weight or codes one at a time, so the model is never whole, in fp32
    or otherwise (a compact artifact has no dense weights at all)."""
    import onnx
    import torch

    from .onnx_stub import build_stub_model, find_stubs, trace_decoder
    from .source import weight_files

    weight_files(src_path)  # safetensors weights, or the export is refused (pickled weights are never read)
    out.mkdir(parents=True, exist_ok=True)
    model, linears, tied = build_stub_model(src_path, config, torch.float16 if fp16 else torch.float32,
                                            lambda names: iter_weights(src_path, names))
    trace_decoder(model, out / "model.onnx")
    del model
    for name in _BESIDE:
        if (src_path / name).is_file():
            shutil.copyfile(src_path / name, out / name)
    graph = onnx.load(str(out / "model.onnx"), load_external_data=True)
    return graph, find_stubs(graph, linears), linears, tied


def place_weights(model, stubs: dict, layers: list[str], src_path: Path, tied: dict) -> None:
    """The stubs of ``layers`` become MatMuls with their source weights, transposed and in the
    graph's type (``Stub.weight``), read one at a time; a tied head reads the embedding through a
    Transpose."""
    from .onnx_stub import replace_stubs, weight_replacement

    replacements = {}
    for layer in layers:
        if layer in tied:
            replacements[layer] = weight_replacement(stubs[layer], layer, None, tied[layer])
    want = {f"{layer}.weight": layer for layer in layers if layer not in tied}
    for key, w in iter_weights(src_path, set(want)):
        stub = stubs[want[key]]
        w_t = stub.weight(np.ascontiguousarray(w.T))
        del w
        replacements[want[key]] = weight_replacement(stub, want[key], w_t)
    missing = [layer for layer in layers if layer not in replacements]
    if missing:
        raise ONNXExportError(f"{src_path} has no weight {missing[0]}.weight")
    replace_stubs(model, stubs, replacements)


def place_codes(model, stubs: dict, layers: Mapping, linears: dict, accuracy_level: int) -> dict:
    """The stubs (all placeable) of coded linears in ``layers`` become MatMulNBits over the artifact's
    codes, as they are; ``layers`` (``export.source.LazyLayers``) reads one linear's codes at a time,
    and they are dropped once packed. Returns the per-linear report."""
    from .onnx_stub import replace_stubs

    report, replacements = {}, {}
    todo = [name for name in stubs if name in layers]
    with progress_stage("export tensors (codes)", total=len(todo)) as shown:
        for layer in todo:
            report[layer] = _place_one(layers, layer, linears, stubs, replacements, accuracy_level)
            shown.advance()
    replace_stubs(model, stubs, replacements)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        from onnx import helper

        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return report


def _place_one(layers, layer: str, linears: dict, stubs: dict, replacements: dict, accuracy_level: int) -> dict:
    """One coded linear's MatMulNBits (into ``replacements``); its report row."""
    from .onnx_stub import nbits_replacement

    res = layers[layer]
    codes, scales, zeros = res.codes.numpy(), res.scales.numpy(), res.zeros.numpy()
    k, n = linears[layer]
    if codes.shape != (n, k):
        raise ONNXExportError(f"the artifact's codes of {layer} are {codes.shape[0]}x{codes.shape[1]}, "
                              f"its linear is {n}x{k}; refusing to place codes")
    grid = res.spec.describe()
    bits, bs, b, s, zp = matmulnbits_tensors(codes, scales, zeros, res.spec)
    del codes, scales, zeros, res
    replacements[layer] = nbits_replacement(stubs[layer].matmul, layer, k, n, bits, bs, b, s, zp, accuracy_level)
    return {"type": f"MatMulNBits{bits}", "block_size": bs, "grid": grid, "zero_points": zp is not None,
            "codes_kept": True}


def verify_against_torch(onnx_dir: Path, src_path: Path, tolerance: dict, probe: str | None = None,
                         n_threads: int | None = None, quantized_activations: bool = False) -> dict:
    """onnxruntime's logits of the file against torch's of the source weights; then the KV cache path."""
    from ..backends.ort import OrtDecoder

    ids = source_tokenizer(src_path)(probe_text(probe), add_special_tokens=True)["input_ids"]
    ref = torch_logits(src_path, ids)
    dec = OrtDecoder(onnx_dir, n_threads=n_threads)
    got = dec.logits(ids)
    # The same file fed incrementally through its KV cache must give the same logits.
    split = max(1, len(ids) // 2)
    inc = dec.incremental_logits(ids, split)
    stats = check_logits(ref, got, tolerance,
                         f"onnxruntime's logits of the ONNX export disagree with torch's of {src_path.name}",
                         ONNXVerificationError, kv_cache_max_abs_diff=float(np.abs(inc - got).max()))
    inc_stats = compare_logits(got, inc)
    # Quantized activations (int8-dynamic, MatMulNBits accuracy_level 4) take their ranges per call,
    # so a prefill and single steps differ a little; otherwise the two paths agree to float error.
    limit = tolerance["mean_kl"] / 2 if quantized_activations else 1e-4
    if inc_stats["mean_kl"] > limit or inc_stats["top1_agreement"] < tolerance["top1"]:
        raise ONNXVerificationError(
            f"the ONNX export's KV cache path disagrees with its full prefill (mean KL {inc_stats['mean_kl']:.2e}); "
            "nothing was written")
    return stats


def _report_rows(report: dict) -> list[tuple[str, str]]:
    """`slmedge export`'s rows for an ONNX report."""
    return [("ops", ", ".join(f"{k} x{v}" for k, v in report["ops"].items()
                              if k in ("MatMul", "MatMulNBits", "MatMulInteger", "Gather", "Cast"))),
            ("codes kept exactly", f"{report['codes_kept']} linears; "
             f"{report['requantized_by_onnxruntime']} by onnxruntime's quantizer")]


def _model_file(path) -> Path:
    """The .onnx file of an export folder (or the file itself)."""
    from ..backends.ort import model_file

    return model_file(path)


@register_format("onnx", label="ONNX", noun="an ONNX export", single_file=False, suffix=".onnx",
                 folder_holds="model, config, tokenizer", default_stem="{model}-onnx-{type}",
                 complete=lambda out: (Path(out) / EXPORT_MANIFEST).is_file(), read_manifest=read_onnx_manifest,
                 verified_manifest=verified_onnx_manifest, model_file=_model_file, model_files=onnx_model_files,
                 model_facts=onnx_model_facts, tokenizer="beside", packages=("onnx", "onnxruntime"),
                 types=ONNX_TYPES, tolerances=TOLERANCES,
                 options=("block_size", "accuracy_level", "keep_fp32_head", "embedding_type", "head_type"),
                 error=ONNXExportError, report_rows=_report_rows, inspect=inspect_onnx, inspect_rows=onnx_rows,
                 recognizes=is_onnx_folder)
def export_onnx(source, out_dir, otype: str = "auto", exact: bool = False, verify: bool = True, *,
                overwrite: bool = False, probe: str | None = None, n_threads: int | None = None,
                block_size: int = 32, accuracy_level: int = 4, keep_fp32_head: bool = False,
                embedding_type: str = "fp16", head_type: str = "int8") -> dict:
    """Write ``source`` (an slmedge artifact or an HF folder) as an ONNX decoder directory ``out_dir``.

    ``otype``: ``auto`` (int4/int8 from the artifact's codes, else fp32), ``fp32``, ``fp16``,
    ``int4``, ``int8`` (weight-only, MatMulNBits) or ``int8-dynamic`` (onnxruntime's
    ``quantize_dynamic``). ``block_size``: onnxruntime quantizer's block for weights without
    codes. The directory (model.onnx, config, tokenizer, ``slmedge-export.json``) appears only
    when complete and verified.
    """

    started = time.perf_counter()
    key = get_format("onnx").check_type(otype)
    if block_size < 16 or block_size & (block_size - 1):
        raise ONNXExportError(f"block size must be a power of two >= 16, got {block_size}")
    check_head_options(embedding_type, head_type, keep_fp32_head)
    check_output_dir(out_dir, overwrite, EXPORT_MANIFEST, inputs=[source])  # before any work
    # An artifact's codes are read one linear at a time, when placed (a 3.8B model's unpacked codes
    # alone are 3.6 GB); what is decided before that reads only their outlines.
    src = open_export_source(source, lazy_layers=True)
    plan = outlines(src.layers)
    supported = onnx_architectures()
    if src.model_type not in supported:
        raise UnsupportedArchitectureError(
            f"ONNX export does not support architecture '{src.model_type}'; supported: {', '.join(supported)}")
    key = _auto_type(plan) if key == "auto" else key
    has_codes = any(o.coded for o in plan.values())
    notes: list[str] = []
    ort_algo = ORT_ALGOS.get(key)
    if ort_algo:
        if exact:
            raise ONNXExportError(f"--exact: {key} is onnxruntime's own {ort_algo} quantizer on every linear; it keeps "
                                  "no codes (use int4 or int8 to keep an artifact's)")
        # onnxruntime's RTN and k-quant reshape each weight into blocks: a block that does not divide a linear's
        # inputs fails inside it (numpy's "cannot reshape"), after the graph is traced; said here, before any work.
        from .source import weight_shapes

        widths = {shape[1] for name, shape in weight_shapes(src.path) if len(shape) == 2 and "embed" not in name}
        uneven = sorted(w for w in widths if w % block_size)
        if uneven and ort_algo != "hqq":  # (HQQ pads a short block)
            fits = [b for b in (16, 32, 64, 128, 256) if all(w % b == 0 for w in widths)]
            raise ONNXExportError(f"{key}: onnxruntime's {ort_algo} quantizer needs the block size to divide every "
                                  f"linear's inputs; block {block_size} does not divide {uneven[0]}"
                                  + (f": use --block-size {' or '.join(map(str, fits))}" if fits else ""))
    if exact and key in ("fp32", "fp16", "int8-dynamic") and has_codes:
        raise ONNXExportError(f"--exact: {key} cannot hold the artifact's codes; use int4 or int8 (MatMulNBits)")
    if exact and key in ("int4", "int8") and not has_codes:
        raise ONNXExportError(f"--exact: {src.path} has no codes to keep; {key} would be onnxruntime's own RTN")
    if any(o.masked for o in plan.values()):
        notes.append("pruned weights are written dense with their zeros; onnxruntime gains no speed from "
                     "unstructured sparsity")
    report_layers: dict[str, dict] = {}
    # What becomes of each coded linear, decided before any work: kept as MatMulNBits, or (codes no
    # MatMulNBits block can hold) re-quantized by onnxruntime, or refused with --exact.
    keep, refused = [], []
    if key in ("int4", "int8") and has_codes:
        bits = 4 if key == "int4" else 8
        coded = [n for n, o in plan.items() if o.coded]
        # (codes on a llama.cpp grid are re-quantized whatever their width: cannot_place)
        too_wide = [n for n in coded if isinstance(plan[n].spec, QuantSpec) and plan[n].spec.bits > bits]
        if too_wide:
            raise ONNXExportError(f"{key} cannot hold {plan[too_wide[0]].spec.bits}-bit codes "
                                  f"({too_wide[0]}); use int8")
        for name in coded:
            res = plan[name]
            why = cannot_place(res.spec, res.shape[1])
            if why is None:
                keep.append(name)
                continue
            if exact:
                raise ONNXExportError(f"{name}'s codes ({res.spec.describe()}) cannot be kept in ONNX: {why}; "
                                      "rerun without --exact to let onnxruntime re-quantize it")
            refused.append(name)
            report_layers[name] = {"type": "requantized", "grid": res.spec.describe(), "requantized_because": why,
                                   "codes_kept": False}
        if refused:
            msg = (f"{len(refused)} linear(s) cannot keep their codes in ONNX and are re-quantized by "
                   f"onnxruntime (RTN, block {block_size}): their calibration is not kept")
            warnings.warn(msg, stacklevel=2)
            notes.append(msg)
    elif ort_algo and has_codes:
        for name, res in plan.items():
            if res.coded:
                report_layers[name] = {"type": "requantized", "grid": res.spec.describe(),
                                       "requantized_because": f"{key}: onnxruntime's {ort_algo} quantizer", "codes_kept": False}
        msg = f"{key} re-quantizes every weight with onnxruntime's {ort_algo} quantizer: the artifact's codes are not kept"
        warnings.warn(msg, stacklevel=2)
        notes.append(msg)
    to_place = set(keep)  # the linears whose codes are placed (read one at a time by place_codes)
    with atomic_directory(out_dir, overwrite=overwrite, manifest=EXPORT_MANIFEST) as tmp:
        stage = tmp / ".trace"
        fp16 = key == "fp16"
        with progress_stage("trace the graph"):
            model, stubs, linears, tied = trace_export(src.path, src.config, stage, fp16=fp16)
        unknown = sorted(set(to_place) - set(stubs))
        if unknown:
            raise ONNXExportError(f"the artifact has codes for {unknown[0]} but the ONNX graph has no such MatMul")
        # Every linear without codes to keep gets its weight first (the head, skipped linears, all of
        # them for fp32/fp16/int8-dynamic), while the graph is small; the codes go in last.
        place_weights(model, stubs, [n for n in stubs if n not in to_place], src.path, tied)
        head, emb = [], []
        if key in ("int4", "int8") or ort_algo:
            bits = 8 if key == "int8" else 4
            tied_to = {} if keep_fp32_head else tied_tables(model)
            if not keep_fp32_head:
                untie_head(model)
            remaining = [n.name for n in model.graph.node if n.op_type == "MatMul"
                         and n.input[1] in {i.name for i in model.graph.initializer}]
            made = {}
            if has_codes and not refused and not ort_algo:
                # Only the head and skipped linears are left: --head-type (8-bit by default, little error).
                if not keep_fp32_head:
                    made = quantize_uncoded(model, remaining, head_type, block_size, accuracy_level)
                    head = [n for n in remaining]
            else:  # slmedge's plain int4/int8 symmetric; onnxruntime's algorithms asymmetric, as it defaults to
                model = ort_quantize_matmuls(model, bits, block_size, not ort_algo, accuracy_level, algo=ort_algo)
            if not keep_fp32_head and embedding_type == "fp16":
                emb = embeddings_to_fp16(model)
                if emb:
                    notes.append(f"token embedding stored in fp16 ({', '.join(emb)})")
            elif not keep_fp32_head:
                shared = {t: made[n] for n, t in tied_to.items() if n in made}
                emb = quantize_embeddings(model, embedding_type, block_size, shared)
                if emb:
                    notes.append(f"token embedding stored as {embedding_type} GatherBlockQuantized, block {block_size} "
                                 f"({', '.join(emb)})" + ("; it reads the tied head's codes" if any(emb.values()) else ""))
            if to_place:
                from .onnx_stub import find_stubs

                stubs = find_stubs(model, {n: linears[n] for n in to_place})
                report_layers.update(place_codes(model, stubs, src.layers, linears, accuracy_level))
                report_layers = {n: report_layers[n] for n in linears if n in report_layers}
        final = tmp / "model.onnx"
        if key == "int8-dynamic":
            from onnxruntime.quantization import QuantType, quantize_dynamic

            plain = tmp / ".plain.onnx"
            _save(model, plain)
            with warnings.catch_warnings(), _quiet_root_logger(), native("onnxruntime's quantizer", plain):
                warnings.simplefilter("ignore")
                quantize_dynamic(str(plain), str(final), weight_type=QuantType.QInt8, per_channel=True,
                                 use_external_data_format=plain.with_name(plain.name + "_data").exists())
            for p in tmp.glob(".plain.onnx*"):
                p.unlink()
            if has_codes:
                msg = "int8-dynamic re-quantizes every weight with onnxruntime's quantizer: the artifact's codes are not kept"
                warnings.warn(msg, stacklevel=2)
                notes.append(msg)
        else:
            _save(model, final)
        del model
        for name in _BESIDE:
            if (stage / name).is_file():
                shutil.move(str(stage / name), tmp / name)
        shutil.rmtree(stage)
        kept = sum(1 for r in report_layers.values() if r.get("codes_kept"))
        kind = key if key in ("fp32", "fp16") else ("kept" if has_codes and kept and key in ("int4", "int8")
                                                   and kept == len(report_layers) else "requantized")
        if kind == "kept" and ((head and head_type == "int4") or (emb and embedding_type == "int4")):
            kind = "kept-4bit-tables"
        verification = None
        if verify:
            qact = key == "int8-dynamic" or ((key in ("int4", "int8") or ort_algo) and accuracy_level >= 2)
            with progress_stage("verify in onnxruntime"):
                verification = verify_against_torch(tmp, src.path, TOLERANCES[kind], probe, n_threads, qact)
        ops = _op_counts(final)
        files = sorted(p for p in tmp.iterdir() if p.is_file())
        manifest = {
            "format": "slmedge-onnx-export",
            "source": recorded_path(src.path, out_dir),  # relative to the folder: no absolute local path
            "source_kind": "artifact" if src.artifact is not None else "hf_dir",
            "source_manifest_sha256": src.artifact.manifest_sha256 if src.artifact is not None else None,
            "model_type": src.model_type,
            "type": key,
            "exact": bool(has_codes and kept and kept == len(report_layers) and key in ("int4", "int8")),
            "codes_kept": kept,
            "requantized_by_onnxruntime": (len(report_layers) - kept) if has_codes else (ops.get("MatMulNBits", 0)
                                                                                         + ops.get("MatMulInteger", 0)),
            "head_int8": head if head_type == "int8" else [],
            "head_type": head_type if head else None,
            "embedding_type": embedding_type if emb else None,
            "accuracy_level": accuracy_level,
            "layers": report_layers,
            "ops": ops,
            "verification": verification,
            "notes": notes,
            "files": {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files},
            "seconds": round(time.perf_counter() - started, 2),
        }
        manifest = sealed(manifest)
        write_json_atomic(tmp / EXPORT_MANIFEST, manifest)
    manifest = dict(manifest)
    manifest["path"] = str(out_dir)
    manifest["source"] = str(src.path)  # the report: where this run read it (onnxruntime-genai's export reads it too)
    manifest["bytes"] = sum(f["bytes"] for n, f in manifest["files"].items() if n.startswith("model.onnx"))
    return manifest


def _op_counts(path: Path) -> dict:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))

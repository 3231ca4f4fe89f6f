"""GGUF tensor types: the artifact's integer codes as GGUF blocks, and llama.cpp's quantizer for the rest.

Linears on one of llama.cpp's grids (``models.grids``: Q4_0 ... Q6_K, IQ4_NL, IQ4_XS) are written in
their grid's own block type, codes and scales as the artifact keeps them (``gguf_blocks``), and decode
to the artifact's weights bit for bit. For the uniform grid (bits, group size, symmetry):

GGUF blocks hold 32 consecutive values along the input dimension. Where the artifact's grid
fits a block type (every 32-block inside one group), the codes are placed as they are, so the
GPTQ/AWQ calibration reaches llama.cpp unchanged (DESIGN.md "numeric contracts"):

- Q4_0 ``x = d*(n-8)``: symmetric codes of up to 4 bits, ``n = q - zero + 8``, ``d = scale``;
- Q4_1 ``x = d*n + m``: any codes of up to 4 bits, ``n = q``, ``d = scale``, ``m = -scale*zero``
  (m rounded to fp16: the only value that is not carried exactly);
- Q8_0 ``x = d*n``: symmetric codes of up to 8 bits, ``n = q - zero`` as int8.

Scales are already fp16 in the artifact, so Q4_0/Q8_0 blocks decode to exactly the artifact's
weights. Any other combination is re-quantized by llama.cpp's own quantizer
(``llama_model_quantize``) from the artifact's dequantized weights.

Llama-family models need the q/k rows permuted for llama.cpp's rotary layout (pairs (i, i+d/2)
of the HF "rotate_half" layout become adjacent); codes, scales and zero points are permuted
together: rows are output features.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..compress.quant import QuantSpec
from ..models.grids import GRIDS, Grid, grid_for_width
from ..procs import native
from .errors import GGUFExportError

BLOCK = 32  # values per block along the input dimension, for every type written here


@dataclass(frozen=True)
class QType:
    name: str
    ggml: str  # gguf.GGMLQuantizationType member name
    ftype: str  # gguf.LlamaFileType member name
    max_bits: int = 0  # codes of the uniform grid of up to this many bits fit (0: none do)
    needs_symmetric: bool = False
    # The llama.cpp grid whose codes it keeps (models.grids; its fallback on rows its blocks do not
    # divide); "*": every grid, each tensor in its own type (``auto`` on an artifact on llama.cpp's grids).
    grid: str | None = None


QTYPES: dict[str, QType] = {
    "f32": QType("f32", "F32", "ALL_F32"),
    "f16": QType("f16", "F16", "MOSTLY_F16"),
    "q8_0": QType("q8_0", "Q8_0", "MOSTLY_Q8_0", 8, True, grid="q8_0"),
    "q4_0": QType("q4_0", "Q4_0", "MOSTLY_Q4_0", 4, True, grid="q4_0"),
    "q4_1": QType("q4_1", "Q4_1", "MOSTLY_Q4_1", 4, False, grid="q4_1"),
    "q5_0": QType("q5_0", "Q5_0", "MOSTLY_Q5_0", grid="q5_0"),
    "q5_1": QType("q5_1", "Q5_1", "MOSTLY_Q5_1", grid="q5_1"),
    "iq4_nl": QType("iq4_nl", "IQ4_NL", "MOSTLY_IQ4_NL", grid="iq4_nl"),
    "iq4_xs": QType("iq4_xs", "IQ4_XS", "MOSTLY_IQ4_XS", grid="iq4_xs"),
    "q3_k": QType("q3_k", "Q3_K", "MOSTLY_Q3_K_S", grid="q3_k"),
    "q4_k": QType("q4_k", "Q4_K", "MOSTLY_Q4_K_S", grid="q4_k"),
    "q5_k": QType("q5_k", "Q5_K", "MOSTLY_Q5_K_S", grid="q5_k"),
    "q6_k": QType("q6_k", "Q6_K", "MOSTLY_Q6_K", grid="q6_k"),
    # llama.cpp's mixtures (types per tensor by its own rules): an artifact's codes on the mixture's
    # main grid are kept, in that grid's type, wherever llama.cpp's rules would pick another.
    "q4_k_s": QType("q4_k_s", "Q4_K", "MOSTLY_Q4_K_S", grid="q4_k"),
    "q4_k_m": QType("q4_k_m", "Q4_K", "MOSTLY_Q4_K_M", grid="q4_k"),
    "q5_k_m": QType("q5_k_m", "Q5_K", "MOSTLY_Q5_K_M", grid="q5_k"),
    "q3_k_m": QType("q3_k_m", "Q3_K", "MOSTLY_Q3_K_M", grid="q3_k"),
    "q2_k": QType("q2_k", "Q2_K", "MOSTLY_Q2_K"),  # written only by llama.cpp's quantizer
}


def grids_qtype(coded: list) -> QType:
    """``auto`` for an artifact whose linears are on llama.cpp's grids: each coded tensor in its own grid's
    type; llama.cpp's file type (what its quantizer gives the tensors left uncoded) that of the grid
    holding the most weights (``coded``: (grid, rows * columns) per linear)."""
    weights: dict[str, int] = {}
    for grid, n in coded:
        weights[grid.name] = weights.get(grid.name, 0) + n
    main = GRIDS[max(weights, key=weights.get)]
    return QType(main.name, main.ggml, main.ftype, grid="*")

# --- codes -> blocks --------------------------------------------------------------------------


def cannot_place(spec, columns: int, qtype: QType) -> str | None:
    """Why the codes of a ``spec`` grid over ``columns`` inputs cannot be placed in ``qtype``
    blocks as they are (None: they can)."""
    if isinstance(spec, Grid):
        if qtype.grid == "*":
            return None
        if qtype.grid is None:
            return f"{qtype.name} holds no codes of llama.cpp's grids"
        want = grid_for_width(qtype.grid, columns)
        if spec.name != want.name:
            return (f"codes on grid {spec.name} are not {qtype.name}'s "
                    f"{want.name}{'' if want.name == qtype.grid else f' (its fallback for {columns}-wide rows)'}")
        return None
    if not qtype.max_bits:
        return f"{qtype.name} holds no integer codes"
    if spec.bits > qtype.max_bits:
        return f"{spec.bits}-bit codes do not fit {qtype.name} ({qtype.max_bits}-bit)"
    if qtype.needs_symmetric and not spec.symmetric:
        return f"asymmetric codes need a zero offset, which {qtype.name} does not have"
    if columns % BLOCK:
        return f"width {columns} is not a multiple of {BLOCK}"
    g = spec.group_width(columns)
    if g % BLOCK and g != columns:
        return f"group size {spec.group_size} is not a multiple of {BLOCK}"
    return None


def codes_to_blocks(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, spec: QuantSpec,
                    qtype: QType) -> np.ndarray:
    """(rows, cols) codes, (rows, G) fp16 scales and zeros -> (rows, nbytes) uint8 GGUF blocks."""
    rows, cols = codes.shape
    nb = cols // BLOCK
    g = spec.group_width(cols)
    gidx = (np.arange(nb) * BLOCK) // g  # the group of each block (blocks never straddle groups)
    d = np.asarray(scales, dtype=np.float16)[:, gidx]  # (rows, nb)
    z = np.asarray(zeros, dtype=np.int16)[:, gidx][:, :, None]
    q = np.asarray(codes, dtype=np.int16).reshape(rows, nb, BLOCK)
    d_bytes = d.reshape(rows, nb, 1).view(np.uint8)  # (rows, nb, 2)
    if qtype.name == "q8_0":
        n = (q - z).astype(np.int8).view(np.uint8)
        parts = [d_bytes, n]
    else:
        if qtype.name == "q4_0":
            n = (q - z + 8).astype(np.uint8)
            head = [d_bytes]
        else:  # q4_1
            m = (-(d.astype(np.float32) * z[:, :, 0].astype(np.float32))).astype(np.float16)
            n = q.astype(np.uint8)
            head = [d_bytes, m.reshape(rows, nb, 1).view(np.uint8)]
        # llama.cpp's layout: byte j holds element j (low nibble) and element j+16 (high nibble).
        packed = n[:, :, : BLOCK // 2] | (n[:, :, BLOCK // 2 :] << 4)
        parts = [*head, packed.astype(np.uint8)]
    return np.ascontiguousarray(np.concatenate(parts, axis=2).reshape(rows, -1))


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py LlamaModel.permute), any trailing dims."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- llama.cpp's quantizer --------------------------------------------------------------------


def llamacpp_quantize(src_path: Path, dst_path: Path, qtype: QType, n_threads: int | None = None,
                      keep: dict[str, str] | None = None, imatrix: dict | None = None) -> None:
    """llama.cpp's quantizer on the staged file: its tensors in float get the types its own rules give
    them in a file of ``qtype``; ``keep`` (GGUF name -> ggml type name) are tensors already holding codes,
    told to stay in their type (a per-tensor override), so they are copied whatever its rules would pick.
    ``imatrix``: {GGUF tensor name: mean squared input per column (float32)} (``export.imatrix.read_imatrix``),
    passed as ``llama-quantize --imatrix`` passes it."""
    import ctypes
    import re

    from ..models.gguf_check import quiet_native_stderr
    from ..models.source import require_llama_cpp

    llama_cpp = require_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{qtype.ftype}")
    params.nthread = n_threads or max(1, os.cpu_count() or 1)
    params.allow_requantize = False  # tensors already holding codes are copied, never re-quantized
    alive = []  # what the C side points into, kept alive until the call returns
    if keep:
        import gguf

        overrides = (llama_cpp.llama_model_tensor_override * (len(keep) + 1))()
        patterns = [f"^{re.escape(name)}$".encode() for name in keep]
        alive.append(patterns)
        for i, (pattern, ggml) in enumerate(zip(patterns, keep.values())):
            overrides[i].pattern = pattern
            overrides[i].type = int(gguf.GGMLQuantizationType[ggml])
        overrides[len(keep)].pattern = None
        alive.append(overrides)
        params.tt_overrides = overrides
    if imatrix:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, values) in enumerate(sorted(imatrix.items())):
            arr = np.ascontiguousarray(values, dtype=np.float32)
            alive.append((name.encode(), arr))
            entries[i].name = alive[-1][0]
            entries[i].data = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = arr.size
        entries[len(imatrix)].name = None  # the terminator
        alive.append(entries)
        params.imatrix = entries
    with quiet_native_stderr(), native("llama.cpp's quantizer", src_path):
        rc = llama_cpp.llama_model_quantize(str(src_path).encode(), str(dst_path).encode(), params)
    if rc != 0:
        raise GGUFExportError(f"llama.cpp's quantizer failed ({rc}) to write {qtype.name}")


def check_requantized(path: Path, stage: Path, placed: dict, report_tensors: dict) -> None:
    """After llama.cpp's quantizer (``stage`` -> ``path``): record final types; the codes placed in the
    stage file (``placed``: name -> (offset, bytes) of their data there) must be byte-identical in the
    final one. Compared one tensor at a time with plain reads (not through a reader's memory map, which
    would count every page of both files as the process's own memory)."""
    import gguf

    final = [(t.name, t.tensor_type, int(t.data_offset), int(t.n_bytes)) for t in gguf.GGUFReader(str(path)).tensors]
    with open(stage, "rb") as before, open(path, "rb") as after:
        for name, ttype, offset, nbytes in final:
            info = report_tensors.setdefault(name, {"codes_kept": False})
            info["type"] = ttype.name
            if name in placed:
                if nbytes != placed[name][1] or _read(after, offset, nbytes) != _read(before, *placed[name]):
                    raise GGUFExportError(f"llama.cpp's quantizer changed the placed codes of {name}")
            elif info.get("codes_kept"):
                info["codes_kept"] = False


def _read(handle, offset: int, nbytes: int) -> bytes:
    handle.seek(offset)
    return handle.read(nbytes)

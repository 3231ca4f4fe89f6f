"""GGUF block layouts of llama.cpp's grids: an artifact's codes and fields -> the bytes of each block.

One packer per block type, from ggml-common.h's structs and the packing loops of ggml-quants.c
(``quantize_row_*``): each places the codes and the fp16 / integer scale codes an artifact keeps
(``models.grids``) where llama.cpp reads them, without computing anything. Whether a block decodes
to the artifact's weights is checked by decoding what was written (``gguf.quants.dequantize``)
against ``models.grids.decode``, bit for bit (``export.gguf``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..models.grids import Grid
from ..registry import Registry

PACKERS: Registry = Registry("GGUF block packer")


def register_packer(ggml: str) -> Callable:
    def wrap(fn):
        return PACKERS.add(ggml, fn)

    return wrap


def pack_blocks(grid: Grid, codes: np.ndarray, fields: dict) -> np.ndarray:
    """(rows, cols) codes and the grid's fields (numpy) -> (rows, bytes per row) uint8 GGUF blocks."""
    rows, cols = codes.shape
    nb = cols // grid.block
    q = np.asarray(codes, dtype=np.uint8).reshape(rows, nb, grid.block)
    f = {k: np.asarray(v) for k, v in fields.items()}
    parts = PACKERS[grid.ggml](q, f, rows, nb)
    out = np.concatenate([p.reshape(rows, nb, -1).astype(np.uint8, copy=False) for p in parts], axis=2)
    if out.shape[2] != grid.type_size:
        raise AssertionError(f"{grid.name}: {out.shape[2]} bytes per block, llama.cpp's are {grid.type_size}")
    return np.ascontiguousarray(out.reshape(rows, nb * grid.type_size))


def _f16(a: np.ndarray, rows: int, nb: int) -> np.ndarray:
    return np.asarray(a, dtype=np.float16).reshape(rows, nb, 1).view(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """32 4-bit values per group of the last axis -> 16 bytes: value j low, value j+16 high."""
    shape = q.shape[:-1] + (q.shape[-1] // 32, 32)
    g = (q & 0x0F).reshape(shape)
    return (g[..., :16] | (g[..., 16:] << 4)).reshape(q.shape[:-1] + (-1,))


def _high_bits32(q: np.ndarray) -> np.ndarray:
    """Bit 4 of each of 32 values -> a little-endian uint32 (4 bytes): Q5_0/Q5_1's qh."""
    bits = ((q >> 4) & 1).astype(np.uint32)
    word = (bits << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
    return word.astype("<u4").view(np.uint8).reshape(q.shape[:-1] + (4,))


@register_packer("Q4_0")
def _q4_0(q, f, rows, nb):
    return [_f16(f["d"], rows, nb), _nibbles(q)]


@register_packer("IQ4_NL")
def _iq4_nl(q, f, rows, nb):
    return [_f16(f["d"], rows, nb), _nibbles(q)]


@register_packer("Q4_1")
def _q4_1(q, f, rows, nb):
    return [_f16(f["d"], rows, nb), _f16(f["m"], rows, nb), _nibbles(q)]


@register_packer("Q5_0")
def _q5_0(q, f, rows, nb):
    return [_f16(f["d"], rows, nb), _high_bits32(q), _nibbles(q)]


@register_packer("Q5_1")
def _q5_1(q, f, rows, nb):
    return [_f16(f["d"], rows, nb), _f16(f["m"], rows, nb), _high_bits32(q), _nibbles(q)]


@register_packer("Q8_0")
def _q8_0(q, f, rows, nb):
    return [_f16(f["d"], rows, nb), (q.astype(np.int16) - 128).astype(np.int8).view(np.uint8)]


@register_packer("IQ4_XS")
def _iq4_xs(q, f, rows, nb):
    sc = np.asarray(f["sc"], dtype=np.uint16).reshape(rows, nb, 8)  # 6-bit codes, scale = d * (sc - 32)
    low = (sc & 0x0F).astype(np.uint8)
    scales_l = low[..., 0::2] | (low[..., 1::2] << 4)  # (rows, nb, 4)
    scales_h = ((sc >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=-1, dtype=np.uint16)
    scales_h = scales_h.astype("<u2").view(np.uint8).reshape(rows, nb, 2)
    return [_f16(f["d"], rows, nb), scales_h, scales_l, _nibbles(q)]


def _scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes holding 8 6-bit scale codes and 8 6-bit min codes (get_scale_min_k4)."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    out = np.zeros(ls.shape[:-1] + (12,), dtype=np.uint8)
    out[..., 0:4] = ls[..., 0:4] | ((ls[..., 4:8] >> 4) << 6)
    out[..., 4:8] = lm[..., 0:4] | ((lm[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (ls[..., 4:8] & 0x0F) | ((lm[..., 4:8] & 0x0F) << 4)
    return out


def _k_nibbles(q: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: per 64 values, 32 bytes: value l low nibble, value l+32 high nibble."""
    g = (q & 0x0F).reshape(q.shape[:-1] + (-1, 64))
    return (g[..., :32] | (g[..., 32:] << 4)).reshape(q.shape[:-1] + (-1,))


@register_packer("Q4_K")
def _q4_k(q, f, rows, nb):
    sc = np.asarray(f["sc"]).reshape(rows, nb, 8)
    mc = np.asarray(f["mc"]).reshape(rows, nb, 8)
    return [_f16(f["d"], rows, nb), _f16(f["dmin"], rows, nb), _scales_k4(sc, mc), _k_nibbles(q)]


@register_packer("Q5_K")
def _q5_k(q, f, rows, nb):
    sc = np.asarray(f["sc"]).reshape(rows, nb, 8)
    mc = np.asarray(f["mc"]).reshape(rows, nb, 8)
    hi = ((q >> 4) & 1).reshape(rows, nb, 4, 2, 32)  # chunk c of 64: its first 32 -> bit 2c, last 32 -> bit 2c+1
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)  # (4, 2)
    qh = (hi << shifts[None, None, :, :, None]).sum(axis=(2, 3), dtype=np.uint16).astype(np.uint8)
    return [_f16(f["d"], rows, nb), _f16(f["dmin"], rows, nb), _scales_k4(sc, mc), qh, _k_nibbles(q)]


@register_packer("Q6_K")
def _q6_k(q, f, rows, nb):
    L = q.reshape(rows, nb, 2, 4, 32)  # two halves of 128, each four runs of 32
    lo = L & 0x0F
    ql = np.concatenate([lo[:, :, :, 0] | (lo[:, :, :, 2] << 4), lo[:, :, :, 1] | (lo[:, :, :, 3] << 4)], axis=-1)
    hi = (L >> 4) & 0x03
    qh = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)
    scales = (np.asarray(f["sc"], dtype=np.int16).reshape(rows, nb, 16) - 128).astype(np.int8).view(np.uint8)
    return [ql.reshape(rows, nb, 128), qh.reshape(rows, nb, 64), scales, _f16(f["d"], rows, nb)]


@register_packer("Q3_K")
def _q3_k(q, f, rows, nb):
    h = (q >> 2) & 1  # code c in 0..7 is value c - 4: the high bit says c > 3
    hmask = (h.reshape(rows, nb, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=2, dtype=np.uint16)
    low = (q & 0x03).reshape(rows, nb, 2, 4, 32)
    qs = low[:, :, :, 0] | (low[:, :, :, 1] << 2) | (low[:, :, :, 2] << 4) | (low[:, :, :, 3] << 6)
    ls = np.asarray(f["sc"], dtype=np.uint8).reshape(rows, nb, 16)
    scales = np.zeros((rows, nb, 12), dtype=np.uint8)
    scales[..., 0:8] = (ls[..., 0:8] & 0x0F) | ((ls[..., 8:16] & 0x0F) << 4)
    hi = ls >> 4  # (rows, nb, 16): code j's top two bits go to byte 8 + j % 4, at bits 2 * (j // 4)
    scales[..., 8:12] = (hi.reshape(rows, nb, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(
        axis=2, dtype=np.uint16).astype(np.uint8)
    return [hmask.astype(np.uint8), qs.reshape(rows, nb, 64), scales, _f16(f["d"], rows, nb)]

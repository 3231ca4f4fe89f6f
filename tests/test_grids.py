"""llama.cpp's grids (issue 40): codes kept bit for bit in GGUF, scales chosen by importance, llama.cpp's
fallback for rows its super-blocks do not divide, and mixed grids to a bits-per-weight budget.

llama.cpp itself is the reference wherever it can be: its own block decoder (ggml's ``to_float``), its
quantizer (``ggml_quantize_chunk`` with an importance matrix, ``llama_model_quantize``), and its logits
on the written files (the export's verification)."""

import ctypes
import json
import os
import warnings

import gguf
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import one_line_error, require_import, small_recipe
from slmedge.cli import app
from slmedge.compress.api import compress
from slmedge.compress.artifact import Artifact
from slmedge.compress.budget import TOLERANCE, allocate, candidates, linear_bits
from slmedge.compress.grid_fit import element_weights, fit, weighted_error
from slmedge.compress.methods import METHODS
from slmedge.compress.methods.gptq import gptq_quantize_grid
from slmedge.compress.quant import QuantSpec, quantize_groups
from slmedge.compress.recipe import Recipe
from slmedge.errors import ArtifactError, ConfigError
from slmedge.export import gguf as gx
from slmedge.export.gguf import export_gguf
from slmedge.export.gguf_blocks import PACKERS, pack_blocks
from slmedge.export.gguf_quant import unpermute_rows
from slmedge.export.inspect import MANIFEST_KEY, read_gguf_manifest
from slmedge.models.gguf_seal import check_gguf
from slmedge.models.grids import GRIDS, KVALUES_IQ4NL, Grid, decode, grid_for_width, register_grid
from slmedge.registry import Registry

runner = CliRunner()
SUPER = [n for n, g in GRIDS.items() if g.fallback]  # the 256-wide types, which fall back on narrower rows
LLAMACPP_FTYPES = {"q3_k": "MOSTLY_Q3_K_S", "q4_k": "MOSTLY_Q4_K_S", "q5_k": "MOSTLY_Q5_K_S", "q6_k": "MOSTLY_Q6_K",
                   "iq4_xs": "MOSTLY_IQ4_XS"}


def _same_bits(a, b) -> bool:
    a, b = np.ascontiguousarray(a, dtype=np.float32), np.ascontiguousarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _ggml():
    """llama.cpp's ggml library as llama-cpp-python ships it (its quantizers and block decoders)."""
    llama_cpp = require_import("llama_cpp", "llama-cpp-python is not installed (scripts/setup.sh installs it)")
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))

    class Traits(ctypes.Structure):  # ggml.h: struct ggml_type_traits
        _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                    ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                    ("from_float_ref", ctypes.c_void_p)]

    lib.ggml_get_type_traits.restype = ctypes.POINTER(Traits)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_void_p]
    return lib


def _llamacpp_decode(lib, grid: Grid, blocks: np.ndarray, shape) -> np.ndarray:
    traits = lib.ggml_get_type_traits(int(gguf.GGMLQuantizationType[grid.ggml])).contents
    assert traits.type_size == grid.type_size and traits.blck_size == grid.block
    out = np.zeros(int(np.prod(shape)), dtype=np.float32)
    src = np.ascontiguousarray(blocks)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(traits.to_float)(
        src.ctypes.data, out.ctypes.data, out.size)
    return out.reshape(shape)


def _llamacpp_quantize(lib, grid: Grid, w: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """llama.cpp's own quantization of ``w`` on ``grid`` (with an importance matrix), decoded."""
    rows, cols = w.shape
    src = np.ascontiguousarray(w.numpy(), dtype=np.float32)
    dst = np.zeros((rows, cols // grid.block * grid.type_size), dtype=np.uint8)
    imp = None if importance is None else np.ascontiguousarray(importance.numpy(), dtype=np.float32)
    lib.ggml_quantize_chunk(int(gguf.GGMLQuantizationType[grid.ggml]), src.ctypes.data, dst.ctypes.data, 0, rows, cols,
                            None if imp is None else imp.ctypes.data)
    return torch.from_numpy(gguf.quants.dequantize(dst, gguf.GGMLQuantizationType[grid.ggml]))


def _weights(rows=48, cols=512, seed=0):
    """Weights with what real ones have: outlier columns, an all-zero block, a constant block."""
    torch.manual_seed(seed)
    w = torch.randn(rows, cols) * 0.05
    w[:, 7] *= 12
    w[3, :32] = 0
    w[4, 32:64] = 0.01
    importance = torch.rand(cols) ** 4 + 1e-3
    importance[7] = 40.0
    return w, importance


# --- the registry and the blocks ------------------------------------------------------------------


def test_the_grid_registry_refuses_a_duplicate_and_every_grid_has_its_gguf_block():
    with pytest.raises(ValueError, match="grid 'q4_k' registered twice"):
        register_grid(GRIDS["q4_k"])
    assert isinstance(GRIDS, Registry) and set(GRIDS) >= {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "iq4_xs",
                                                          "q3_k", "q4_k", "q5_k", "q6_k"}
    for name, grid in GRIDS.items():
        assert grid.ggml in PACKERS, name
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[grid.ggml]]
        assert (block, size) == (grid.block, grid.type_size), name
        assert len(grid.levels) == 2**grid.bits and list(grid.levels) == sorted(grid.levels), name
    assert GRIDS["iq4_nl"].levels == KVALUES_IQ4NL == gguf.quants.IQ4_NL.kvalues


@pytest.mark.parametrize("name", list(GRIDS))
@pytest.mark.parametrize("weighted", [False, True], ids=["data-free", "importance"])
def test_blocks_decode_to_the_fitted_weights_bit_for_bit_in_gguf_and_in_llamacpp(name, weighted):
    grid = GRIDS[name]
    w, importance = _weights()
    found = fit(grid, w, importance if weighted else None)
    assert _same_bits(decode(grid, found.codes, found.fields), found.weight)
    assert set(found.fields) == set(grid.fields) and found.codes.dtype == torch.uint8
    assert int(found.codes.max()) < len(grid.levels)
    blocks = pack_blocks(grid, found.codes.numpy(), {k: v.numpy() for k, v in found.fields.items()})
    assert blocks.shape == (w.shape[0], w.shape[1] // grid.block * grid.type_size)
    assert _same_bits(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[grid.ggml]), found.weight)
    assert _same_bits(_llamacpp_decode(_ggml(), grid, blocks, w.shape), found.weight)
    # the all-zero block decodes to zeros; nothing is NaN anywhere
    assert torch.isfinite(found.weight).all() and not found.weight[3, :32].any()


@pytest.mark.parametrize("name", list(GRIDS))
def test_the_importance_weighted_search_is_as_good_as_llamacpps_own(name):
    """On the error llama.cpp's quantizer minimises (its quant_weights formula with the importance matrix),
    slmedge's fit is no worse than ggml_quantize_chunk's (within 1%; measured lower for most types)."""
    grid = GRIDS[name]
    w, importance = _weights(rows=64, cols=1024, seed=1)
    mine = fit(grid, w, importance).weight
    theirs = _llamacpp_quantize(_ggml(), grid, w, importance)
    wt = element_weights(grid, w, importance)
    err_mine, err_theirs = float(((w - mine) ** 2 * wt).sum()), float(((w - theirs) ** 2 * wt).sum())
    assert err_mine <= 1.01 * err_theirs, (name, err_mine, err_theirs)


# --- scales chosen by importance ---------------------------------------------------------------------


def test_importance_weighted_rounding_beats_min_max_rounding_on_a_dominant_input_channel():
    """A layer whose input channel 5 is 30x the others: rounding weighted by the inputs' mean squares
    keeps that column's weights precise, min/max rounding does not look at the inputs. Compared on the
    same Q4_0 format (min/max: the uniform grid's symmetric 4-bit g32, the very codes Q4_0 holds)."""
    torch.manual_seed(0)
    x = torch.randn(4096, 256)
    x[:, 5] *= 30
    w = torch.randn(64, 256) * 0.02
    w[:, 5] *= 0.1  # a small weight on the loud channel: min/max scales are set by the other weights
    importance = (x * x).mean(dim=0)
    minmax = quantize_groups(w, QuantSpec(4, 32, True))[0]
    weighted = fit(GRIDS["q4_0"], w, importance).weight
    data_free = fit(GRIDS["q4_0"], w, None).weight
    out = x @ w.t()
    for q in (weighted, data_free):
        assert _same_bits(q, fit(GRIDS["q4_0"], w, importance if q is weighted else None).weight)  # deterministic

    def output_error(q):
        return float(((x @ q.t() - out) ** 2).sum())

    # measured: 0.131 against 0.180 (importance-weighted), about the same ratio on the output
    assert weighted_error(w, weighted, importance) < 0.8 * weighted_error(w, minmax, importance)
    assert output_error(weighted) < 0.8 * output_error(minmax)
    assert output_error(weighted) < output_error(data_free)
    # the same on the other grids: weighting by importance lowers the layer's output error
    for name in ("q4_k", "iq4_xs", "q3_k", "q5_0", "q4_1"):
        grid = GRIDS[name]
        assert output_error(fit(grid, w, importance).weight) < output_error(fit(grid, w, None).weight), name


def test_q4_1_with_a_float_min_reproduces_a_tensor_already_on_a_q4_1_grid_exactly():
    """Weights as llama.cpp's Q4_1 quantizer writes them (SmolLM2's embedded GGUF is such a file): every
    block on d*q + m with a free fp16 m (any sign, not a multiple of d). The uniform asymmetric grid (an
    integer zero point) cannot hold them; the q4_1 grid finds them again, bit for bit."""
    torch.manual_seed(0)
    raw = (torch.randn(64, 512) * 0.05 + torch.linspace(-0.2, 0.2, 64)[:, None]).numpy()
    blocks = gguf.quants.quantize(raw, gguf.GGMLQuantizationType.Q4_1)
    on_grid = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1))
    importance = torch.rand(512) + 0.1
    for imp in (None, importance):
        again = fit(GRIDS["q4_1"], on_grid, imp)
        assert _same_bits(again.weight, on_grid)
    assert not torch.equal(quantize_groups(on_grid, QuantSpec(4, 32, False))[0], on_grid)


def test_gptq_onto_a_grid_keeps_its_scales_and_beats_rounding_on_the_layers_output():
    torch.manual_seed(0)
    mix = torch.randn(256, 256) * 0.3 + torch.eye(256)
    x = torch.randn(2048, 256) @ mix  # correlated inputs: what GPTQ's error compensation uses
    w = torch.randn(96, 256) * 0.05
    H = 2 * x.t() @ x / x.shape[0]
    out = x @ w.t()
    for name in ("q4_k", "iq4_xs", "q3_k", "q4_1", "iq4_nl"):
        grid = GRIDS[name]
        imp = torch.diagonal(H) / 2
        Q, codes, fields, perm = gptq_quantize_grid(w, H, grid, imp, actorder=True)
        assert _same_bits(decode(grid, codes, fields), Q)  # what the artifact rebuilds, the GGUF decodes
        rounded = fit(grid, w, imp)
        assert all(torch.equal(fields[k], rounded.fields[k]) for k in fields)  # the scales are the search's
        assert float(((x @ Q.t() - out) ** 2).sum()) < 0.8 * float(((x @ rounded.weight.t() - out) ** 2).sum()), name


# --- llama.cpp's fallback -----------------------------------------------------------------------------


def test_the_declared_bpw_range_is_that_of_the_grids():
    from slmedge.limits import LIMITS

    sizes = [g.bits_per_weight for g in GRIDS.values()]
    assert (LIMITS["bpw"].lo, LIMITS["bpw"].hi) == (min(sizes), max(sizes))


def test_fallbacks_are_llamacpps():
    assert {n: g.fallback for n, g in GRIDS.items() if g.fallback} == {
        "iq4_xs": "iq4_nl", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
    assert grid_for_width("q4_k", 512).name == "q4_k" and grid_for_width("q4_k", 576).name == "q5_0"
    assert grid_for_width("q4_0", 576).name == "q4_0"
    with pytest.raises(ConfigError, match="rows divisible by 32"):
        grid_for_width("q4_k", 48)


def _llamacpp_pure_types(f32_gguf, ftype: str, out) -> dict[str, str]:
    """The type llama.cpp's quantizer gives each 2-D blk tensor of ``f32_gguf`` in a ``pure`` file of ``ftype``
    (its own choice of types per tensor off: only its fallback for incompatible rows applies)."""
    from slmedge.models.gguf_check import quiet_native_stderr

    llama_cpp = require_import("llama_cpp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{ftype}")
    params.pure = True
    params.nthread = 1
    with quiet_native_stderr():
        assert llama_cpp.llama_model_quantize(str(f32_gguf).encode(), str(out).encode(), params) == 0
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors
            if t.name.startswith("blk.") and len(t.shape) == 2}


# --- codes through GGUF on tiny models of every GGUF architecture ---------------------------------------


def _check_gguf_holds_the_artifact(path, art_dir, report) -> dict[str, str]:
    """Every coded linear of the artifact is a tensor of its grid's type in the file, whose blocks decode
    to the artifact's weights bit for bit (llama.cpp's q/k row order undone). Returns GGUF name -> type."""
    from slmedge.export.source import iter_weights
    from slmedge.models.architectures import ARCHITECTURES

    layers = Artifact.open(art_dir).layers()
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    config = json.loads((art_dir / "config.json").read_text())
    heads = {rel: config.get(attr) or config["num_attention_heads"]
             for rel, attr in ARCHITECTURES[config["model_type"]].gguf.permute}
    weights = dict(iter_weights(art_dir, {f"{n}.weight" for n in layers}))
    types = {}
    for name, info in report["tensors"].items():
        if not info.get("codes_kept"):
            continue
        layer = info["hf_name"].removesuffix(".weight")
        t, res = tensors[name], layers[layer]
        assert t.tensor_type.name == res.spec.ggml, (layer, t.tensor_type.name, res.spec.ggml)
        decoded = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        rel = next((r for r in heads if layer.endswith("." + r)), None)
        if rel is not None:
            decoded = unpermute_rows(decoded, heads[rel])
        assert _same_bits(decoded, weights[f"{layer}.weight"]), layer
        types[name] = t.tensor_type.name
    assert len(types) == len(layers)
    return types


GGUF_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")  # gemma2 has no GGUF export


@pytest.mark.parametrize("wide", [True, False], ids=["wide", "narrow"])
@pytest.mark.parametrize("model_type", GGUF_TYPES)
def test_each_grid_reaches_gguf_bit_for_bit_and_llamacpp_agrees_with_torch(model_type, wide, tiny_models, wide_models,
                                                                           calib_file, tmp_path):
    """Every grid on a wide model (its 256-wide rows in K-quant / IQ4_XS blocks, the 288-wide down
    projection in llama.cpp's fallback) and the super-block grids on a narrow one (every row falls back):
    the codes reach the file bit for bit, the export's check of llama.cpp's logits against torch's passes,
    and the types are the very ones llama.cpp's own quantizer picks for the same tensors. The tensors
    without codes stay F16 (keep_f16_uncoded), so the check measures the codes alone: llama.cpp's rules
    would put the untied token embeddings of Mistral and Phi-3 in the grid's type by plain rounding, which
    alone moves a tiny random model's logits by a mean KL of ~7e-2."""
    src = (wide_models if wide else tiny_models)(model_type)
    f32 = tmp_path / "f32.gguf"
    export_gguf(src, f32, qtype="f32", verify=False)
    for name in (GRIDS if wide else SUPER):
        recipe = small_recipe(calib_file, method="rtn", grid=name, importance=wide)
        art = compress(str(src), recipe, tmp_path / name, device="cpu").artifact
        assert Artifact.open(art).version == 3
        report = export_gguf(art, tmp_path / f"{name}.gguf", keep_f16_uncoded=True)
        assert report["exact"] and report["codes_kept"] == len(Artifact.open(art).layers()), name
        assert report["verification"]["mean_kl"] < gx.TOLERANCES["kept"]["mean_kl"]
        types = _check_gguf_holds_the_artifact(tmp_path / f"{name}.gguf", art, report)
        if name in LLAMACPP_FTYPES:
            theirs = _llamacpp_pure_types(f32, LLAMACPP_FTYPES[name], tmp_path / f"{name}-llamacpp.gguf")
            assert types == {n: theirs[n] for n in types}, name
            assert any(t != GRIDS[name].ggml for t in types.values()) or wide  # narrow rows all fell back
            if wide:
                assert GRIDS[name].ggml in types.values()


@pytest.mark.parametrize("method,grid", [("gptq", "q4_k"), ("gptq", "iq4_xs"), ("awq", "q4_1"), ("awq", "q6_k"),
                                         ("gptq", "iq4_nl"), ("awq", "q3_k")])
def test_gptq_and_awq_onto_grids_reach_gguf_bit_for_bit(method, grid, wide_models, calib_file, tmp_path):
    src = wide_models("qwen2")
    art = compress(str(src), small_recipe(calib_file, method=method, grid=grid), tmp_path / "art", device="cpu").artifact
    layers = Artifact.open(art).layers()
    assert {r.spec.name for r in layers.values()} == {grid, GRIDS[grid].fallback or grid}
    report = export_gguf(art, tmp_path / "m.gguf")
    assert report["exact"] and report["verification"]["mean_kl"] < gx.TOLERANCES["kept"]["mean_kl"]
    _check_gguf_holds_the_artifact(tmp_path / "m.gguf", art, report)
    _check_the_manifest_says_it_once(tmp_path / "m.gguf", art)


def _check_the_manifest_says_it_once(path, art):
    """The GGUF's manifest as stored: no spaces, the recipe's settings that applied (``Recipe.applied``:
    ``method``'s own, none of another method's), and no grid beside a type that names it; read back
    (``read_gguf_manifest``), every tensor whose codes were kept names its grid again, and the file's
    seal still holds."""
    text = gguf.GGUFReader(str(path)).fields[MANIFEST_KEY].contents()
    stored = json.loads(text)
    assert text == json.dumps(stored, sort_keys=True, separators=(",", ":"))
    recipe = Recipe.from_dict(Artifact.open(art).manifest["recipe"])
    assert stored["recipe"] == recipe.applied()
    own, others = set(METHODS[recipe.method].cls.settings), {"damp", "block_size", "act_order", "awq_grid", "awq_clip"}
    assert own and own <= set(stored["recipe"]) and not (others - own) & set(stored["recipe"])
    assert not {"bits", "group_size", "symmetric"} & set(stored["recipe"])  # the uniform grid's: not on a grid
    assert stored["recipe"]["calibration"] == recipe.calibration and "sparsity" not in stored["recipe"]  # unset
    kept = [entry for entry in stored["tensors"].values() if entry["codes_kept"]]
    assert kept and not any("grid" in entry for entry in kept)
    back = read_gguf_manifest(path)["tensors"]
    kept = {name: entry for name, entry in back.items() if entry["codes_kept"]}
    assert len(kept) == len(Artifact.open(art).layers()) and all(e["grid"] == e["type"] for e in kept.values())
    assert all("grid" not in entry for entry in back.values() if not entry["codes_kept"])
    assert check_gguf(path)["recipe"] == recipe.applied()
    shown = runner.invoke(app, ["inspect", str(path)], env={"COLUMNS": "1000"})
    rows = [[cell.strip() for cell in line.split("│")[1:3]] for line in shown.output.splitlines() if line.count("│") >= 3]
    assert shown.exit_code == 0 and ["recipe", json.dumps(recipe.applied(), sort_keys=True)] in rows, shown.output


def test_same_seed_same_artifact_bytes(wide_models, calib_file, tmp_path):
    src = wide_models("llama")
    for method in ("gptq", "awq"):
        a = compress(str(src), small_recipe(calib_file, method=method, grid="q4_k"), tmp_path / f"{method}1", device="cpu")
        b = compress(str(src), small_recipe(calib_file, method=method, grid="q4_k"), tmp_path / f"{method}2", device="cpu")
        for f in ("quantization.safetensors", "weights.safetensors"):
            assert (a.artifact / f).read_bytes() == (b.artifact / f).read_bytes(), (method, f)


def test_pruning_onto_a_grid_keeps_pruned_weights_zero_and_refuses_grids_without_a_zero(wide_models, calib_file,
                                                                                           tmp_path):
    src = wide_models("llama")
    for method in ("sparsegpt", "wanda"):
        out = compress(str(src), small_recipe(calib_file, method=method, grid="q3_k", sparsity="0.5", bits=None),
                       tmp_path / method, device="cpu")
        # 256-wide rows on Q3_K, the 288-wide down projection on llama.cpp's fallback Q4_0
        assert {e["grid"] for e in Artifact.open(out.artifact).manifest["layers"].values()} == {"q3_k", "q4_0"}
        with pytest.raises(ConfigError, match="no zero level"):
            small_recipe(calib_file, method=method, grid="iq4_nl", sparsity="0.5", bits=None).validate()
    art = Artifact.open(tmp_path / "sparsegpt")
    model = art.load_model()
    for name, res in art.layers().items():
        w = model.get_submodule(name).weight.data
        assert not w[~res.mask].any() and abs(float(res.mask.float().mean()) - 0.5) < 0.01


# --- the artifact --------------------------------------------------------------------------------------


def test_grid_artifacts_are_format_version_3_and_uniform_ones_stay_2(artifacts, tiny_models, tmp_path):
    from safetensors.torch import load_file

    uniform = Artifact.open(artifacts("llama", "rtn", bits=4, group_size=32, symmetric=True))
    on_grid = Artifact.open(artifacts("llama", "rtn", grid="q4_0"))
    assert uniform.version == 2 and on_grid.version == 3
    entry = next(iter(on_grid.manifest["layers"].values()))
    assert entry["grid"] == "q4_0" and entry["bits"] == 4 and "group_size" not in entry
    # Q4_0 is the uniform symmetric 4-bit grid in blocks of 32 (levels d * (q - 8)): each code is that grid's
    # rounding of the weight at its block's scale d, which the search chose (the uniform artifact's min/max
    # scale is one of its candidates: where it chose that one, the codes are the uniform artifact's own).
    weights = load_file(str(tiny_models("llama") / "model.safetensors"))
    shared = 0
    uniform_layers = uniform.layers()
    for name, res in on_grid.layers().items():
        assert res.codes.dtype == torch.uint8 and res.fields["d"].dtype == torch.float16
        d = res.fields["d"].float().repeat_interleave(32, dim=1)
        rounded = torch.clamp(torch.round(weights[name + ".weight"].float() / d) + 8, 0, 15)
        assert torch.equal(res.codes.long(), rounded.long()), name
        u = uniform_layers[name]
        same = (res.fields["d"].float() == u.scales.float()).repeat_interleave(32, dim=1)
        assert torch.equal(res.codes.long()[same], u.codes.long()[same]), name
        shared += int(same.sum())
    assert shared  # some blocks did take the min/max scale (else the last check compared nothing)
    manifest = json.loads((on_grid.path / "slmedge.json").read_text())
    manifest["format_version"] = 4
    import shutil

    newer = tmp_path / "newer"
    shutil.copytree(on_grid.path, newer)
    (newer / "slmedge.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="format version 4.*reads versions 1 to 3"):
        Artifact.open(newer)


def test_compressed_tensors_and_onnx_do_not_write_grid_codes(artifacts, tmp_path):
    from slmedge.export.compressed_tensors import CompressedTensorsExportError, plan_layers
    from slmedge.export.onnx import cannot_place
    from slmedge.export.source import open_export_source

    art = artifacts("llama", "rtn", grid="q4_k")
    # the exporter's plan refuses what the format cannot hold, before anything is written
    with pytest.raises(CompressedTensorsExportError, match="llama.cpp's q5_0 grid.*--format gguf"):
        plan_layers(open_export_source(art, lazy_layers=True))
    for grid in GRIDS.values():  # ONNX re-quantizes them (warning) or, with --exact, refuses
        assert "no MatMulNBits form" in cannot_place(grid, 256)
    assert cannot_place(QuantSpec(4, 32, True), 256) is None


def test_export_type_other_than_the_grid_requantizes_with_a_warning_or_refuses_with_exact(artifacts, tmp_path):
    art = artifacts("llama", "rtn", grid="q4_0")
    with pytest.warns(UserWarning, match="re-quantized by llama.cpp"):
        report = export_gguf(art, tmp_path / "k.gguf", qtype="iq4_nl")
    assert report["codes_kept"] == 0 and not report["exact"]
    with pytest.raises(gx.GGUFExportError, match="codes on grid q4_0 are not iq4_nl's iq4_nl"):
        export_gguf(art, tmp_path / "e.gguf", qtype="iq4_nl", exact=True)
    assert not (tmp_path / "e.gguf").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert export_gguf(art, tmp_path / "q.gguf", qtype="q4_0")["exact"]  # its own type: no warning


# --- settings --------------------------------------------------------------------------------------------


def test_grid_settings_are_checked_before_any_work(tiny_models, tmp_path):
    bad = [dict(grid="q9_9", match="unknown grid"), dict(grid="q4_k", bpw=4.5, match="not both"),
           dict(importance=True, match="uniform grid"), dict(bpw=2.0, match="bpw must be"),
           dict(method="wanda", sparsity="0.5", bits=None, grid="q4_1", match="no zero level"),
           dict(method="sparsegpt", sparsity="0.5", bits=None, bpw=5.0, match="zero level")]
    for kw in bad:
        match = kw.pop("match")
        with pytest.raises(ConfigError, match=match):
            Recipe(**{"method": "rtn", **kw}).validate()
    out = tmp_path / "out"
    res = runner.invoke(app, ["compress", str(tiny_models("llama")), "--method", "rtn", "--grid", "q9_9", "-o", str(out)])
    one_line_error(res, "unknown grid 'q9_9'")
    assert res.exit_code == 2 and not out.exists()


# --- mixed grids to a budget ------------------------------------------------------------------------------


@pytest.mark.parametrize("method,bpw", [("rtn", 4.2), ("rtn", 5.0), ("gptq", 4.6), ("awq", 6.0)])
def test_a_bits_per_weight_budget_lands_within_one_percent(method, bpw, wide_models, calib_file, tmp_path):
    src = wide_models("llama")
    out = compress(str(src), small_recipe(calib_file, method=method, bpw=bpw), tmp_path / "art", device="cpu")
    got = out.summary["bits_per_weight"]
    assert (1 - TOLERANCE) * bpw <= got <= bpw, got
    art = Artifact.open(out.artifact)
    layers = art.layers()
    bits = sum(linear_bits(*r.codes.shape, r.spec) for r in layers.values())
    assert bits / sum(r.codes.numel() for r in layers.values()) == pytest.approx(got, abs=1e-4)
    # the GGUF holds exactly those blocks
    report = export_gguf(out.artifact, tmp_path / "m.gguf")
    assert report["exact"]
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    coded = [t for t in reader.tensors if report["tensors"][t.name].get("codes_kept")]
    assert sum(int(t.n_bytes) for t in coded) * 8 == bits


def test_the_allocation_picks_by_sensitivity_and_refuses_what_no_mix_reaches(tiny_models, tmp_path):
    shapes = {"a": (256, 256), "b": (256, 256)}
    # "a" loses much more than "b" on every grid: the budget's spare bits go to "a"
    errors = {"a": {g.name: 10 / g.bits_per_weight**4 for g in candidates(256)},
              "b": {g.name: 0.1 / g.bits_per_weight**4 for g in candidates(256)}}
    picked = allocate(shapes, errors, 5.5)
    assert GRIDS[picked["a"]].bits_per_weight > GRIDS[picked["b"]].bits_per_weight
    res = runner.invoke(app, ["compress", str(tiny_models("llama")), "--method", "rtn", "--bpw", "4.0",
                              "-o", str(tmp_path / "out"), "--nsamples", "4", "--seqlen", "32"])
    one_line_error(res, "bpw 4 is below what llama.cpp's grids can reach")  # 64-wide rows: 4.5 at least
    assert res.exit_code == 2 and not (tmp_path / "out").exists()


class _TwoPaths(torch.nn.Module):
    """A block whose residual stream takes ``loud``'s output as it is, ``quiet``'s a hundredth of it, and
    ``dead``'s not at all."""

    def __init__(self, width: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.loud, self.quiet, self.dead = (torch.nn.Linear(width, width) for _ in range(3))

    def forward(self, h):
        return (h + self.loud(h) + 0.01 * self.quiet(h) + 0 * self.dead(h),)


def test_a_budget_weighs_each_linear_by_how_much_of_the_block_output_it_moves():
    from slmedge.compress.engine import output_reach

    block = _TwoPaths()
    todo = {"loud": block.loud, "quiet": block.quiet, "dead": block.dead}
    before = {name: lin.weight.detach().clone() for name, lin in todo.items()}
    batches = [torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    reach = output_reach(block, todo, batches, lambda h: {}, seed=3)
    with torch.no_grad():
        out = sum(float(block(h)[0].pow(2).sum()) for h in batches)
        loud = sum(float(block.loud(h).pow(2).sum()) for h in batches)
        quiet = sum(float(block.quiet(h).pow(2).sum()) for h in batches)
    # loud's output is the residual's own: the share it moves is its energy over the block output's
    assert reach["loud"] == pytest.approx(loud / out, rel=1e-4)
    assert reach["quiet"] == pytest.approx(1e-4 * quiet / out, rel=1e-3)  # a hundredth of it, squared
    assert reach["dead"] == 0.0
    assert all(torch.equal(lin.weight, before[name]) for name, lin in todo.items())  # the weights as they were
    assert output_reach(block, todo, batches, lambda h: {}, seed=3) == reach  # seeded


def test_a_budget_keeps_to_the_grids_it_is_given(wide_models, calib_file, tmp_path):
    # K-quants only: 256-wide inputs take Q4_K or Q6_K, the 288-wide down projection llama.cpp's
    # fallbacks for them (Q5_0, Q8_0); never the other grids, and still within 1% of the budget.
    src, allowed = wide_models("llama"), ("q4_k", "q6_k")
    recipe = small_recipe(calib_file, method="rtn", bpw=5.6, bpw_grids=list(allowed))
    out = compress(str(src), recipe, tmp_path / "art", device="cpu")
    got = out.summary["bits_per_weight"]
    assert (1 - TOLERANCE) * 5.6 <= got <= 5.6, got
    layers = Artifact.open(out.artifact).layers()
    used = {name: r.spec.name for name, r in layers.items()}
    for name, grid in used.items():
        cols = layers[name].codes.shape[1]
        assert grid in {grid_for_width(g, cols).name for g in allowed}, (name, grid)
    assert {"q4_k", "q6_k"} <= set(used.values())  # a mix, not one grid
    assert any(g in ("q5_0", "q8_0") for n, g in used.items() if "down_proj" in n)
    assert Artifact.open(out.artifact).manifest["recipe"]["bpw_grids"] == list(allowed)
    assert Recipe.from_dict(Artifact.open(out.artifact).manifest["recipe"]).bpw_grids == allowed
    # the allowed grids bound the reachable budgets, refused before any work with the grids named
    res = runner.invoke(app, ["compress", str(src), "--method", "rtn", "--bpw", "7.5", "--bpw-grids", "q3_k,q4_k",
                              "-o", str(tmp_path / "out"), "--nsamples", "4", "--seqlen", "32"])
    one_line_error(res, "bpw 7.5 is above what the grids q3_k, q4_k can use")
    assert res.exit_code == 2 and not (tmp_path / "out").exists()


def test_budget_grid_lists_are_checked_before_any_work(tiny_models, tmp_path):
    bad = [dict(bpw_grids=("q4_k",), match="give the budget too"),
           dict(bpw=5.0, bpw_grids=("q4_k", "q9_9"), match="unknown grid 'q9_9'"),
           dict(bpw=5.0, bpw_grids=("q4_k", "q4_k"), match="names a grid twice"),
           dict(bpw=5.0, bpw_grids=(), match="names no grid"),
           dict(bpw=5.0, bpw_grids=("q4_k", 4), match=r"must be grid names, got \['q4_k', 4\]")]
    for kw in bad:
        match = kw.pop("match")
        with pytest.raises(ConfigError, match=match):
            Recipe(**{"method": "rtn", **kw}).validate()
    out = tmp_path / "out"
    for args, match in ((["--bpw-grids", "q4_k"], "give the budget too"),
                        (["--bpw", "5", "--bpw-grids", " , "], "bpw_grids (--bpw-grids) names no grid")):
        res = runner.invoke(app, ["compress", str(tiny_models("llama")), "--method", "rtn", *args, "-o", str(out)])
        one_line_error(res, match)
        assert res.exit_code == 2 and not out.exists()


def test_an_artifact_from_before_a_new_setting_is_still_reused(tiny_models, calib_file, tmp_path, monkeypatch):
    # `slmedge run` reuses an artifact of the same recipe. One written before bpw_grids existed has no such
    # key; at its default the setting does what that version did, so the artifact is the same recipe's.
    from slmedge.cli.run import _reusable

    recipe = small_recipe(calib_file, method="rtn", bits=4)
    plain = Recipe.to_dict
    with monkeypatch.context() as m:
        m.setattr(Recipe, "to_dict", lambda self: {k: v for k, v in plain(self).items() if k != "bpw_grids"})
        out = compress(str(tiny_models("llama")), recipe, tmp_path / "art", device="cpu")
    assert "bpw_grids" not in Artifact.open(out.artifact).manifest["recipe"]
    assert _reusable(out.artifact, recipe) is not None
    assert _reusable(out.artifact, small_recipe(calib_file, method="rtn", bits=4, seed=1)) is None

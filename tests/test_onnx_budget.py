"""A size budget for ONNX (compress --bpw with --bpw-grids naming MatMulNBits layouts): the allocation,
the codes the method rounds onto, and the export that keeps them, on tiny random models."""


import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from typer.testing import CliRunner

from conftest import one_line_error, small_recipe
from slmedge.cli import app
from slmedge.compress.api import compress
from slmedge.compress.artifact import Artifact
from slmedge.compress.budget import TOLERANCE, allocate, candidates, check_budget, linear_bits
from slmedge.compress.layouts import DEFAULT_LAYOUTS, Layout, layout_names, parse_layout
from slmedge.compress.quant import QuantSpec
from slmedge.compress.recipe import Recipe
from slmedge.errors import ConfigError
from slmedge.export.onnx import export_onnx

runner = CliRunner()
LAYOUTS = ("int4-g32-sym", "int4-g32", "int4-g64", "int4-g128", "int8-g32", "int8-g128")


def test_layout_sizes_are_what_matmulnbits_stores():
    # 4-bit, block 32, zero points: 4 bits a code, an fp32 scale and a 4-bit zero point per 32 weights
    assert parse_layout("int4-g32").bits_per_weight(256) == 4 + 32 / 32 + 4 / 32
    assert parse_layout("int4-g32-sym").bits_per_weight(256) == 5.0
    assert parse_layout("int8-g128").bits_per_weight(256) == 8 + 32 / 128  # symmetric: no zero points
    assert parse_layout("int8-g64-asym").bits_per_weight(256) == 8 + 40 / 64
    # an odd number of 4-bit zero points per row is padded to a whole byte
    assert parse_layout("int4-g32").linear_bits(3, 96) == 3 * (96 * 4 + 3 * 32 + 16)
    assert layout_names(["onnx"]) == DEFAULT_LAYOUTS
    assert layout_names(["int4-g32-asym", "int8-g64-sym"]) == ("int4-g32", "int8-g64")
    assert parse_layout("int4-g64").spec == QuantSpec(4, 64, False)


def test_a_layout_is_offered_only_where_its_block_divides_the_rows():
    assert [c.name for c in candidates(288, LAYOUTS)] == ["int4-g32-sym", "int4-g32", "int8-g32"]
    assert {c.name for c in candidates(256, LAYOUTS)} == set(LAYOUTS)
    with pytest.raises(ConfigError, match="none of the ONNX layouts int4-g128 fits its 288-wide rows"):
        check_budget({"down": (64, 288)}, 4.5, ("int4-g128",))


def test_the_onnx_allocation_gives_the_sensitive_linear_the_bits():
    shapes = {"a": (256, 256), "b": (256, 256)}
    errors = {"a": {c.name: 10 / c.bits_per_weight(256) ** 4 for c in candidates(256, LAYOUTS)},
              "b": {c.name: 0.1 / c.bits_per_weight(256) ** 4 for c in candidates(256, LAYOUTS)}}
    picked = allocate(shapes, errors, 6.41)
    assert parse_layout(picked["a"]).bits == 8 and parse_layout(picked["b"]).bits == 4
    used = sum(linear_bits(*shapes[n], parse_layout(picked[n])) for n in shapes)
    assert (1 - TOLERANCE) * 6.41 * 2 * 256 * 256 <= used <= 6.41 * 2 * 256 * 256


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_an_onnx_budget_lands_within_it_and_the_export_keeps_the_chosen_layouts(method, wide_models, calib_file,
                                                                                 tmp_path):
    src = wide_models("llama")
    bpw = 6.0
    out = compress(str(src), small_recipe(calib_file, method=method, bpw=bpw, bpw_grids=LAYOUTS), tmp_path / "art",
                   device="cpu")
    got = out.summary["bits_per_weight"]
    assert (1 - TOLERANCE) * bpw <= got <= bpw, got
    layers = Artifact.open(out.artifact).layers()
    specs = {name: res.spec for name, res in layers.items()}
    assert all(isinstance(s, QuantSpec) for s in specs.values())
    assert {s.bits for s in specs.values()} == {4, 8}, specs  # a mix, not one layout everywhere
    assert all(288 % s.group_size == 0 for n, s in specs.items() if "down_proj" in n)  # no block past the rows
    bits = sum(Layout(s.bits, s.group_size, s.symmetric).linear_bits(*layers[n].codes.shape) for n, s in specs.items())
    assert bits / sum(r.codes.numel() for r in layers.values()) == pytest.approx(got, abs=1e-4)
    assert sum(u["linears"] for u in out.summary["grids"].values()) == len(layers)

    report = export_onnx(out.artifact, tmp_path / "onnx", exact=True)  # the parity check against torch runs
    assert report["verification"] and report["exact"] and report["codes_kept"] == len(layers), report
    model = onnx.load(str(tmp_path / "onnx" / "model.onnx"))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    nodes = {n.input[1][: -len(".weight_Q")]: n for n in model.graph.node if n.op_type == "MatMulNBits"}
    stored = 0
    for name, res in layers.items():
        node = nodes[name]
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        assert (a["bits"], a["block_size"]) == (res.spec.bits, res.spec.group_size), name
        assert (len(node.input) > 3) == (not res.spec.symmetric), name  # zero points only where asymmetric
        # the codes are the artifact's, as they are (4-bit: element 2i in the low nibble)
        packed = inits[node.input[1]].reshape(res.codes.shape[0], -1)
        codes = (np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
                 if a["bits"] == 4 else packed)
        assert np.array_equal(codes, res.codes.numpy()), name
        scales = inits[node.input[2]].reshape(res.codes.shape[0], -1)
        assert np.array_equal(scales, res.scales.float().numpy()), name
        stored += sum(inits[i].nbytes * 8 for i in node.input[1:] if i)
    assert stored == bits  # the budget counted what the file holds


@pytest.mark.parametrize("args,words", [
    (["--bpw", "4.1", "--bpw-grids", "int4-g32,int8-g32"], ["bpw 4.1 is below what the ONNX layouts", "5.1250"]),
    (["--bpw", "8.75", "--bpw-grids", "int4-g32,int8-g32"], ["bpw must be"]),
    (["--bpw", "8.4", "--bpw-grids", "int4-g32,int4-g64"], ["bpw 8.4 is above what the ONNX layouts"]),
    (["--bpw", "5", "--bpw-grids", "int4-g48"], ["no kernel for block size 48", "16, 32, 64, 128, 256"]),
    (["--bpw", "5", "--bpw-grids", "int4-g512"], ["no kernel for block size 512"]),
    (["--bpw", "5", "--bpw-grids", "int3-g32"], ["4- or 8-bit codes"]),
    (["--bpw", "5", "--bpw-grids", "int4-32"], ["unknown ONNX layout 'int4-32'"]),
    (["--bpw", "5", "--bpw-grids", "int4-g32,q4_k"], ["mixes ONNX layouts (int4-g32) and llama.cpp grids (q4_k)"]),
    (["--bpw", "5", "--bpw-grids", "int4-g32,int4-g32-asym"], ["names a grid twice"]),
])
def test_bad_onnx_budgets_are_one_line_and_write_nothing(args, words, tiny_models, tmp_path):
    out = tmp_path / "out"
    res = runner.invoke(app, ["compress", str(tiny_models("llama")), "--method", "rtn", *args, "-o", str(out),
                              "--nsamples", "4", "--seqlen", "32"])
    one_line_error(res, *words)
    assert res.exit_code == 2 and not out.exists()


def test_an_onnx_budget_recipe_round_trips_in_canonical_names():
    r = Recipe(method="gptq", bits=None, bpw=5.0, bpw_grids=("int4-g32-asym", "int8-g64")).validate()
    assert r.on_layouts and r.bpw_grids == ("int4-g32", "int8-g64")
    again = Recipe.from_dict(r.to_dict()).validate()
    assert again.bpw_grids == r.bpw_grids and again.on_layouts
    assert not Recipe(method="gptq", bits=None, bpw=5.0, bpw_grids=("q4_k",)).validate().on_layouts
    with pytest.raises(ConfigError, match="give the budget too"):
        Recipe(method="gptq", bpw_grids=("int4-g32",)).validate()

"""slmedge compress: calibrate and compress a model into an artifact directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from ..data import DEFAULT_CALIBRATION
from ..models.grids import GRIDS
from .common import Table, bounded, check_model, check_output_dir, console, errors_to_exit, progress_bar
from .data import DATA_DIR_HELP

if TYPE_CHECKING:  # the command line's modules import no torch until a command runs (slmedge --help)
    from ..compress.recipe import Recipe


def recipe_from_options(method, bits, group_size, symmetric, sparsity, calibration, nsamples, seqlen, seed, batch_size,
                        skip, include_head, damp, block_size, act_order, true_sequential, awq_grid, awq_clip,
                        awq_max_tokens, awq_search_dtype, grid=None, bpw=None, importance=None,
                        bpw_grids=None) -> Recipe:
    from ..compress.methods import METHODS
    from ..compress.recipe import DEFAULT_SKIP, Recipe

    info = METHODS.get(method)
    if bits is None and info is not None and info.kind == "quantize" and grid is None and bpw is None:
        bits = 4
    if isinstance(bpw_grids, str):  # "q4_k,q5_k,q6_k"
        bpw_grids = tuple(name.strip().lower() for name in bpw_grids.split(",") if name.strip())
    skip_patterns = tuple(p for p in DEFAULT_SKIP if not (include_head and p == "lm_head")) + tuple(skip or ())
    return Recipe(method=method, bits=bits, group_size=group_size, symmetric=symmetric, sparsity=sparsity,
                  calibration=calibration, nsamples=nsamples, seqlen=seqlen, seed=seed, batch_size=batch_size,
                  skip=skip_patterns, damp=damp, block_size=block_size, act_order=act_order,
                  true_sequential=true_sequential, awq_grid=awq_grid, awq_clip=awq_clip, awq_max_tokens=awq_max_tokens,
                  awq_search_dtype=awq_search_dtype, grid=grid, bpw=bpw, bpw_grids=bpw_grids, importance=importance)


def check_compress(model, recipe: Recipe, output, *, overwrite: bool, revision=None, data_dir=None,
                   text_field: str = "text", option: str = "-o", device: str | None = None,
                   trust_remote_code: bool = False, given=None) -> Path:
    """Everything a compression can be refused for before the model is loaded, in this order: the
    recipe, the model source (resolved: a missing one creates no output folder), what the model and
    the machine bound the settings by (its positions, the memory available), the calibration text
    (read, not tokenized; Hub datasets are fetched later), the output folder. Returns it. ``given``:
    the recipe's settings the user gave (``Recipe.validate``)."""
    from ..compress.api import check_compress_bounds, default_output
    from ..compress.artifact import MANIFEST
    from ..compress.methods import METHODS
    from ..data.calibration import read_texts

    recipe = recipe.validate(given)
    check_model(model, revision, trust_remote_code)
    check_compress_bounds(model, recipe, revision, device)
    if METHODS[recipe.method].cls(recipe).needs_calibration:
        if recipe.calibration.startswith("hf:"):
            from ..data.calibration import check_hub

            check_hub(recipe.calibration)  # fetched once the model is loaded; the network is asked now
        else:
            read_texts(recipe.calibration, data_dir, text_field)
    out = Path(output) if output is not None else default_output(model or "smollm2-135m", recipe)
    check_output_dir(out, option=option if output is not None else "the default output", overwrite=overwrite,
                     manifest=MANIFEST, inputs=[model] if model else [], what="an artifact")
    return out


def print_summary(outcome, as_json: bool = False) -> None:
    s = outcome.summary
    if as_json:
        console.print_json(json.dumps({"artifact": str(outcome.artifact), **s}))
        return
    table = Table(title=f"slmedge compress: {s['recipe']}", show_header=False)
    base = outcome.manifest["base_model"]
    table.add_row("model", str(base.get("name") or base.get("id") or base.get("path")))
    table.add_row("architecture", outcome.manifest["architecture"])
    table.add_row("compressed linears", f"{s['compressed_linears']} ({s['compressed_parameters']:,} of {s['parameters']:,} parameters)")
    if s["bits_per_weight"] is not None:
        from ..compress.layouts import is_layout_name

        rec = outcome.manifest.get("recipe", {})
        what = ("ONNX MatMulNBits: codes + fp32 scales + zero points" if rec.get("bpw") and rec.get("bpw_grids")
                and all(map(is_layout_name, rec["bpw_grids"])) else "GGUF blocks: codes + scales"
                if rec.get("grid") or rec.get("bpw") else "codes + fp16 scales + zero points")
        table.add_row("bits per compressed weight", f"{s['bits_per_weight']:.3f} ({what})")
    if len(s.get("grids") or {}) > 1:  # the grids the linears went on, when not one
        table.add_row("grids", ", ".join(f"{g} on {u['linears']} linear{'s' * (u['linears'] != 1)} "
                                         f"({u['bits_per_weight']:g} bits per weight)" for g, u in s["grids"].items()))
    fb = s.get("fallback")
    if fb:
        to = "/".join(f"{t} ({s['grids'][t]['bits_per_weight']:g} bits per weight)" for t in fb["to"])
        table.add_row("llama.cpp's fallback", f"{to} instead of {fb['grid']} on {fb['count']} of {fb['of']} linears "
                      f"({', '.join(fb['linears'])}): {fb['why']}")
    if s["sparsity"]:
        table.add_row("sparsity of compressed linears", f"{s['sparsity']:.2%}")
    calib = outcome.manifest.get("calibration")
    if calib:
        table.add_row("calibration", f"{calib['spec']}: {calib['nsamples']} x {calib['seqlen']} tokens, seed {calib['seed']}")
    t = s["timings"]
    table.add_row("time", f"{t.get('compress_s', 0):.1f} s compressing, {t.get('load_s', 0):.1f} s loading")
    if outcome.artifact is not None:
        table.add_row("artifact", str(outcome.artifact))
    console.print(table)


# The built-in methods by name (tests/test_cli_help.py holds it to the registry, which imports torch).
METHOD_HELP = "Method: rtn, gptq, awq (quantize); magnitude, wanda, sparsegpt (prune). slmedge methods says what each does."
GRID_HELP = ("Quantize onto one of llama.cpp's grids instead of the uniform one (--bits/--group-size/--sym): "
             + ", ".join(GRIDS) + ". Its codes are kept exactly in the GGUF; rows its super-blocks do not divide "
             "take llama.cpp's own fallback type. For llama.cpp, --method gptq --grid iq4_xs measured best at its "
             "size (docs/benchmarks.md); for ONNX and compressed-tensors leave it out (the uniform grid).")


@bounded(bits="bits", group_size="group_size", nsamples="nsamples", seqlen="seqlen", seed="seed",
         batch_size="batch_size", damp="damp", block_size="block_size", awq_grid="awq_grid",
         awq_max_tokens="awq_max_tokens", bpw="bpw")
def compress_command(
    model: Optional[str] = typer.Argument(None, help="HF id, local HF folder, .gguf file, or an embedded name (smollm2-135m, gemma3-270m). Default: smollm2-135m."),
    method: str = typer.Option("awq", "--method", "-m", help=METHOD_HELP),
    bits: Optional[int] = typer.Option(None, "--bits", "-b", help="Bit width 2..8 (default 4 for quantizers; pruners only quantize when given)."),
    group_size: int = typer.Option(128, "--group-size", "-g", help="Columns per scale; -1 for per-channel. A last, shorter group is handled."),
    symmetric: bool = typer.Option(False, "--sym/--asym", help="Symmetric (zero point 2^(b-1)) or asymmetric grid."),
    grid: Optional[str] = typer.Option(None, "--grid", help=GRID_HELP),
    bpw: Optional[float] = typer.Option(None, "--bpw", help="Mix llama.cpp's grids (or, with ONNX layouts in --bpw-grids, onnxruntime's MatMulNBits layouts) to this many bits per weight of the compressed linears (as the GGUF or ONNX file stores them), each linear's choice from measured error weighted by its reach into the residual stream; lands within 1% below it."),
    bpw_grids: Optional[str] = typer.Option(None, "--bpw-grids", help="With --bpw: what the budget may choose among, comma-separated. llama.cpp grids for GGUF (e.g. q3_k,iq4_xs,q4_k,q5_k,q6_k; rows a grid's super-blocks do not divide take llama.cpp's fallback for it; default: all), or ONNX MatMulNBits layouts int4-gB/int8-gB with B in 16,32,64,128,256 and an optional -sym/-asym (int4: zero points unless -sym; int8: none unless -asym; a layout is used where B divides the rows; 'onnx' = int4-g32-sym,int4-g32,int4-g64,int4-g128,int8-g32,int8-g64,int8-g128), e.g. int4-g32,int4-g128,int8-g32; export with slmedge export --format onnx --exact."),
    importance: Optional[bool] = typer.Option(None, "--importance/--no-importance", help="On a llama.cpp grid: weigh each weight by its input channel's mean square over the calibration text when searching scales (default: GPTQ/AWQ/Wanda do, RTN does not; --importance makes RTN calibrate)."),
    sparsity: Optional[str] = typer.Option(None, "--sparsity", "-s", help="Pruning: a ratio in [0, 1) or N:M (N zeros in every M weights), e.g. 0.5 or 2:4."),
    calibration: str = typer.Option(DEFAULT_CALIBRATION, "--calibration", "-c", help="c4, multilingual[:LANGS], a .txt/.jsonl file, hf:DATASET[:CONFIG][:SPLIT], or several joined by + (a mix: c4+multilingual)."),
    nsamples: int = typer.Option(128, "--nsamples", help="Calibration samples."),
    seqlen: int = typer.Option(512, "--seqlen", help="Tokens per calibration sample."),
    seed: int = typer.Option(0, "--seed", help="Seed for sampling calibration windows; same seed, same artifact."),
    batch_size: int = typer.Option(8, "--batch-size", help="Calibration samples per block forward (bounds activation memory)."),
    skip: Optional[list[str]] = typer.Option(None, "--skip", help="Extra module-name patterns to leave alone (lm_head and embeddings are skipped by default)."),
    include_head: bool = typer.Option(False, "--include-head", help="Also compress lm_head (not with awq)."),
    damp: float = typer.Option(0.01, "--damp", help="GPTQ/SparseGPT: fraction of mean(diag H) added to the diagonal."),
    block_size: int = typer.Option(128, "--block-size", help="GPTQ/SparseGPT: columns updated together."),
    act_order: bool = typer.Option(True, "--act-order/--no-act-order", help="GPTQ: quantize columns by decreasing Hessian diagonal (static groups)."),
    true_sequential: Optional[bool] = typer.Option(None, "--true-sequential/--no-true-sequential", help="Later linears of a block see earlier ones compressed (default: the method's reference: on for GPTQ/SparseGPT, off for Wanda)."),
    awq_grid: int = typer.Option(20, "--awq-grid", help="AWQ: scale-exponent grid points."),
    awq_clip: bool = typer.Option(True, "--awq-clip/--no-awq-clip", help="AWQ: search clipping ratios."),
    awq_max_tokens: int = typer.Option(2048, "--awq-max-tokens", help="AWQ: calibration tokens used by the search losses."),
    awq_search_dtype: str = typer.Option("auto", "--awq-search-dtype", help="AWQ: dtype the search's forwards multiply in: auto (bfloat16 where the device has it natively), bfloat16, float32."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Artifact directory (default: slmedge-out/<model>-<recipe>)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output directory."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", envvar="SLMEDGE_DATA_DIR", help=DATA_DIR_HELP),
    text_field: str = typer.Option("text", "--text-field", help="JSONL / dataset field holding the text."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit)."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Run code shipped with a Hub model (off unless you ask)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
):
    """Calibrate and compress a model into an artifact directory.

    \b
    Examples:
      slmedge compress                  # AWQ 4-bit of the embedded SmolLM2-135M
      slmedge compress MODEL --method gptq --bits 4 --group-size 64 -o out/gptq
      slmedge compress MODEL --method wanda --sparsity 0.5
      slmedge compress MODEL --method sparsegpt --sparsity 2:4 --bits 8
      slmedge compress model.gguf --method rtn --bits 8 --group-size -1 --sym
      # llama.cpp's Q4_K grid, its codes kept in the GGUF:
      slmedge compress MODEL --method gptq --grid q4_k -o out/gptq-q4k
      # importance-weighted rounding:
      slmedge compress MODEL --method rtn --grid iq4_nl --importance
      # mixed grids to 4.8 bits per weight; K-quants only:
      slmedge compress MODEL --method awq --bpw 4.8
      slmedge compress MODEL --method gptq --bpw 4.9 --bpw-grids q4_k,q5_k,q6_k
      # onnxruntime MatMulNBits layouts (4/8-bit) to 5 bits per weight:
      slmedge compress MODEL --method gptq --bpw 5 --bpw-grids onnx
    """
    from ..compress.api import compress

    with errors_to_exit():
        recipe = recipe_from_options(method, bits, group_size, symmetric, sparsity, calibration, nsamples, seqlen, seed,
                                     batch_size, skip, include_head, damp, block_size, act_order, true_sequential,
                                     awq_grid, awq_clip, awq_max_tokens, awq_search_dtype, grid, bpw, importance,
                                     bpw_grids)
        from .common import given_options

        output = check_compress(model, recipe, output, overwrite=overwrite, revision=revision, data_dir=data_dir,
                                text_field=text_field, device=device, trust_remote_code=trust_remote_code,
                                given=given_options("bits", "group_size", "symmetric"))
        with progress_bar() as progress:
            outcome = compress(model, recipe, output, data_dir=data_dir, device=device, overwrite=overwrite,
                               trust_remote_code=trust_remote_code, revision=revision, text_field=text_field,
                               progress=progress)
        print_summary(outcome, as_json)

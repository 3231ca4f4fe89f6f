"""slmedge run: the main job on the embedded default, no arguments needed.

Compress SmolLM2-135M with GPTQ onto llama.cpp's IQ4_XS grid (the file that measured best at its
size, docs/benchmarks.md), export the codes to GGUF as they are, evaluate the base model (torch)
and the compressed GGUF (llama.cpp) on this machine — a short perplexity in the seed study's seven
languages, a few hundred task items, fidelity, memory, latency — and print them side by side.
Artifact and export are reused when they match. Progress shows on stderr (slmedge.progress).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from ..errors import ArtifactError, ConfigError, SlmedgeError
from ..models.artifact_format import is_artifact, manifest_path
from .common import Table, bounded, check_output_file, console, errors_to_exit, progress_bar, supervised
from .data import DATA_DIR_HELP
from .evaluate import flips_text

if TYPE_CHECKING:  # torch: imported when the command runs, not for slmedge --help
    from ..compress.recipe import Recipe

MAIN_TASKS = ("arc_easy", "piqa", "winogrande", "hellaswag", "xcopa_th", "xcopa_zh")
# The main job's file: GPTQ on IQ4_XS measured lowest in mean KL of every 4-bit GGUF at its size,
# llama.cpp's own IQ4_XS, Q4_0 and Q3_K_M included (docs/benchmarks.md, "GGUF against llama-imatrix").
MAIN_METHOD, MAIN_GRID = "gptq", "iq4_xs"
WHY_MAIN = "GPTQ on the IQ4_XS grid: the file that measured best at this size,\nsee docs/benchmarks.md"


@bounded(bits="bits", group_size="group_size", nsamples="nsamples", seqlen="seqlen", windows="ppl_windows",
         limit="limit")
def run_command(
    model: Optional[str] = typer.Argument(None, help="Model source (default: the embedded smollm2-135m)."),
    method: str = typer.Option(MAIN_METHOD, "--method", "-m", help="Compression method."),
    grid: str = typer.Option(MAIN_GRID, "--grid", help="llama.cpp grid the codes go on (kept as they are in the GGUF); "
                             "'none': the uniform grid of --bits and --group-size (4-bit, group 32: Q4_1 blocks)."),
    bits: int = typer.Option(4, "--bits", "-b", help="Bit width, with --grid none."),
    group_size: int = typer.Option(32, "--group-size", "-g", help="Group size, with --grid none (32: one scale per GGUF block, so Q4_1 holds the codes at no extra size)."),
    nsamples: int = typer.Option(32, "--nsamples", help="Calibration samples (C4 and the multilingual text, half each)."),
    seqlen: int = typer.Option(512, "--seqlen", help="Tokens per calibration sample and per perplexity window."),
    windows: int = typer.Option(1, "--ppl-windows", help="Perplexity windows per language."),
    limit: int = typer.Option(40, "--limit", help="Items per task (six tasks)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Artifact directory."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Recompress even if a matching artifact exists."),
    results_db: Optional[Path] = typer.Option(None, "--results-db", envvar="SLMEDGE_RESULTS_DB", help="SQLite results store."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", envvar="SLMEDGE_DATA_DIR", help=DATA_DIR_HELP),
):
    """The main job: compress, export to GGUF, evaluate base and compressed side by side.

    Writes into slmedge-out/: the compressed artifact (a folder) and its GGUF file beside it; the
    results go to the results store.

    \b
    Examples:
      slmedge run
      slmedge run --limit 100 --ppl-windows 4
      slmedge run --method awq --grid none    # AWQ W4 g32, uniform grid: Q4_1
    """
    from ..compress.api import compress, default_output
    from ..compress.recipe import Recipe
    from ..evaluate.api import EvalSettings, Evaluation
    from ..evaluate.store import ResultsStore
    from ..export.formats import get_format
    from ..export.gguf import export_gguf
    from .common import given_options
    from .compress import check_compress
    from .evaluate import check_evaluation, check_store_location

    spec = model or "smollm2-135m"
    supervised("run")  # a crash in llama.cpp: one line naming it and the file (common.supervised)
    with errors_to_exit():
        # Every setting and location first: nothing is compressed, exported or recorded before all pass.
        # On the uniform grid (--grid none) asymmetric codes: GGUF Q4_1 holds them exactly (scale and
        # offset per 32-value block).
        on_grid = grid.strip().lower() not in ("none", "")
        recipe = Recipe(method=method, bits=bits, group_size=group_size, symmetric=False, nsamples=nsamples,
                        seqlen=seqlen, grid=grid.strip().lower() if on_grid else None)
        recipe.validate(given_options("bits", "group_size"))  # their defaults are the uniform grid's, unused on a grid
        settings = EvalSettings(seqlen=seqlen, ppl_windows=windows, tasks=MAIN_TASKS, limit=limit, pp=256,
                                tg=64, repeats=2, fidelity_windows=1, data_dir=str(data_dir) if data_dir else None)
        check_evaluation(model, settings)
        out = Path(output) if output else default_output(spec, recipe)
        gguf = get_format("gguf")
        gguf_path = out.with_name(gguf.output_name(out.name))  # beside the artifact, named by the format
        artifact = _reusable(out, recipe, data_dir) if not overwrite else None
        if artifact is None:
            check_compress(model, recipe, out, overwrite=overwrite, data_dir=data_dir,
                           option="-o" if output else "the default output")
        check_output_file(gguf_path, option="the GGUF export", overwrite=True, inputs=[out],
                          ours=lambda p: _gguf_ours(gguf, p), what=gguf.what, example=gguf.output_name("model"),
                          ours_noun=f"a {gguf.label} file")
        store = ResultsStore(results_db) if check_store_location(results_db) else None  # a foreign file: refused now
        if (recipe.method, recipe.grid) == (MAIN_METHOD, MAIN_GRID):
            console.print(WHY_MAIN, markup=False, highlight=False)
        _print_outputs(out, gguf_path, results_db, "will go to", highlight=False)
        try:
            with progress_bar() as progress:
                if artifact is None:
                    with _section(progress, "compress"):
                        outcome = compress(model, recipe, out, data_dir=data_dir, overwrite=overwrite,
                                           progress=progress)
                    from .compress import print_summary

                    print_summary(outcome)
                    del outcome
                else:
                    console.print(f"reusing {out} (same recipe, checksums verified); --overwrite to recompress")
                if not _fresh(gguf_path, out):
                    with _section(progress, "export"):
                        report = export_gguf(out, gguf_path, "auto", overwrite=True)
                    v = report["verification"]
                    console.print(f"exported {gguf_path} ({report['qtype']}, codes kept in {report['codes_kept']} "
                                  f"tensors; llama.cpp vs torch: top-1 {v['top1_agreement']:.1%}, "
                                  f"mean KL {v['mean_kl']:.2e})")
                store = store or ResultsStore(results_db)
                rows = []
                for ev_spec, label in ((spec, "base (torch)"), (str(gguf_path), "compressed (llama.cpp)")):
                    # The base has no reference; the compressed GGUF is compared with the base.
                    metrics = tuple(m for m in settings.metrics if m != "fidelity" or not label.startswith("base"))
                    with _section(progress, f"evaluate {label}"):
                        ev = Evaluation(ev_spec, dataclasses.replace(settings, metrics=metrics), store, None,
                                        progress)
                        if not label.startswith("base"):
                            ev.sub.base_spec = ev.sub.base_spec or spec
                        try:
                            rows.append((label, ev.run()))
                        finally:
                            ev.close()
        finally:
            if store is not None:
                store.close()
        _print_side_by_side(rows, recipe, Path(spec).name)
        _print_outputs(out, gguf_path, store.path, "are in")


def _section(progress, label: str):
    """A named part of the job on the progress display (nothing where it is off)."""
    import contextlib

    return progress.section(label) if progress is not None else contextlib.nullcontext()


def _print_outputs(artifact: Path, gguf_path: Path, store, verb: str, highlight: bool = True) -> None:
    """Where the main job's outputs go (at the start) or are (at the end)."""
    from ..evaluate.store import default_path

    store = Path(store).expanduser() if store else default_path()
    console.print(f"outputs {verb} {artifact.parent}/:\n"
                  f"  {artifact.name}/: the compressed artifact (codes, weights, tokenizer)\n"
                  f"  {gguf_path.name}: the GGUF file (llama.cpp loads it)\n"
                  f"results store: {store} (slmedge report reads it)", markup=False, highlight=highlight)


def _gguf_ours(fmt, path: Path) -> bool:
    try:
        return fmt.read_manifest(path) is not None
    except Exception:  # noqa: BLE001 - not a GGUF file slmedge wrote
        return False


def _fresh(gguf_path: Path, artifact: Path) -> bool:
    """An export of exactly this artifact and unchanged since it was written: the file matches the
    digest its manifest records, and the manifest names the artifact's manifest by its sha256."""
    from ..export.formats import get_format
    from ..fsutil import sha256_file

    fmt = get_format("gguf")
    if not gguf_path.is_file() or not fmt.reusable(gguf_path):
        return False
    manifest = fmt.checked_manifest(gguf_path)
    return manifest.get("source_manifest_sha256") == sha256_file(manifest_path(artifact))


def _print_side_by_side(rows, recipe, model: str) -> None:
    (bl, base), (cl, comp) = rows
    t = Table("metric", bl, cl, title=f"{model}: base vs {recipe.describe()} as GGUF, this machine")
    bp, cp = base["metrics"]["perplexity"], comp["metrics"]["perplexity"]
    for name in bp:
        t.add_row(f"perplexity {name}", f"{bp[name]['perplexity']:.2f}", f"{cp[name]['perplexity']:.2f}")
    t.add_row("bits/byte (mean over corpora)", f"{sum(r['bits_per_byte'] for r in bp.values()) / len(bp):.4f}",
              f"{sum(r['bits_per_byte'] for r in cp.values()) / len(cp):.4f}")
    bt, ct = base["metrics"]["tasks"], comp["metrics"]["tasks"]
    for name in bt:
        key = "acc_norm" if "acc_norm" in bt[name] else "acc"
        # The flips counted on the metric shown: items whose acc_norm answer changed.
        flipped = "flips_norm_vs_reference" if key == "acc_norm" else "flips_vs_reference"
        extra = f", {flips_text(ct[name], flipped)} flipped" if flipped in ct[name] else ""
        t.add_row(f"{name} {key} (n={bt[name]['n']})", f"{bt[name][key]:.3f}", f"{ct[name][key]:.3f}" + extra)
    f = comp["metrics"].get("fidelity")
    if f:
        t.add_row("mean KL vs base / top-1 agreement", "-", f"{f['kl_mean']:.4f} / {f['top1_agreement']:.1%}")
    bm, cm = base["metrics"]["memory"], comp["metrics"]["memory"]
    t.add_row("file size", f"{bm['file_bytes'] / 1e6:.1f} MB (fp32 safetensors)", f"{cm['file_bytes'] / 1e6:.1f} MB")
    if "peak_rss_bytes" in bm:
        t.add_row("peak RSS", f"{bm['peak_rss_bytes'] / 1e6:.0f} MB", f"{cm['peak_rss_bytes'] / 1e6:.0f} MB")
    bl_, cl_ = base["metrics"]["latency"], comp["metrics"]["latency"]
    t.add_row(f"prefill tokens/s (pp{bl_['prompt_tokens']})", f"{bl_['prefill_tps']['median']:.0f}",
              f"{cl_['prefill_tps']['median']:.0f}")
    t.add_row(f"decode tokens/s (tg{bl_['generated']})", f"{bl_['decode_tps']['median']:.1f}",
              f"{cl_['decode_tps']['median']:.1f}")
    console.print(t)


def _is_artifact(path: Path) -> bool:
    return is_artifact(path)


def _reusable(path: Path, recipe: Recipe, data_dir=None):
    """The artifact at ``path`` when it was compressed with ``recipe`` on the calibration windows the
    recipe gives today (the same token ids: a changed data file, or windows now led by BOS, recompress)."""
    from ..compress.artifact import Artifact
    from ..compress.recipe import Recipe

    if not _is_artifact(path):
        return None
    try:
        art = Artifact.open(path)
    except ArtifactError:
        return None
    try:  # read as today's recipe: a setting added since is at its default, which does what it did then
        saved = Recipe.from_dict(art.manifest.get("recipe") or {}).to_dict()
    except (ConfigError, TypeError, ValueError):
        return None
    from ..data.calibration import shared_spec

    if saved != {**recipe.to_dict(), "calibration": shared_spec(recipe.calibration)}:  # as the artifact records it
        return None
    calibration = art.manifest.get("calibration")
    if calibration is None:  # a method without calibration: the recipe is all it was made from
        return art
    from ..data.calibration import load_calibration

    try:
        now = load_calibration(recipe.calibration, art.load_tokenizer(), recipe.nsamples, recipe.seqlen, recipe.seed,
                               data=data_dir)
    except (SlmedgeError, OSError, ValueError):
        return None  # compressing again says what is wrong with the data
    return art if now.identity.get("tokens_sha256") == calibration.get("tokens_sha256") else None

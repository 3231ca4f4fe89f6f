"""slmedge run: the main job on the embedded default, no arguments needed.

Compress SmolLM2-135M with AWQ 4-bit, export the codes to GGUF (Q4_1 blocks, calibration kept),
evaluate the base model (torch) and the compressed GGUF (llama.cpp) on this machine — a short
perplexity in the seed study's seven languages, a few hundred task items, fidelity, memory,
latency — and print them side by side. Artifact and export are reused when they match.
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


@bounded(bits="bits", group_size="group_size", nsamples="nsamples", seqlen="seqlen", windows="ppl_windows",
         limit="limit")
def run_command(
    model: Optional[str] = typer.Argument(None, help="Model source (default: the embedded smollm2-135m)."),
    method: str = typer.Option("awq", "--method", "-m", help="Compression method."),
    bits: int = typer.Option(4, "--bits", "-b", help="Bit width."),
    group_size: int = typer.Option(32, "--group-size", "-g", help="Group size (32: one scale per GGUF block, so Q4_1 holds the codes at no extra size)."),
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

    \b
    Examples:
      slmedge run
      slmedge run --method gptq --limit 100 --ppl-windows 4
    """
    from ..compress.api import compress, default_output
    from ..compress.recipe import Recipe
    from ..evaluate.api import EvalSettings, Evaluation
    from ..evaluate.store import ResultsStore
    from ..export.formats import get_format
    from ..export.gguf import export_gguf
    from .compress import check_compress
    from .evaluate import check_evaluation, check_store_location

    spec = model or "smollm2-135m"
    supervised("run")  # a crash in llama.cpp: one line naming it and the file (common.supervised)
    with errors_to_exit():
        # Every setting and location first: nothing is compressed, exported or recorded before all pass.
        # Asymmetric codes: GGUF Q4_1 holds them exactly (scale and offset per 32-value block).
        recipe = Recipe(method=method, bits=bits, group_size=group_size, symmetric=False, nsamples=nsamples,
                        seqlen=seqlen).validate()
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
        try:
            with progress_bar() as progress:
                if artifact is None:
                    outcome = compress(model, recipe, out, data_dir=data_dir, overwrite=overwrite, progress=progress)
                    from .compress import print_summary

                    print_summary(outcome)
                    del outcome
                else:
                    console.print(f"reusing {out} (same recipe, checksums verified); --overwrite to recompress")
                if not _fresh(gguf_path, out):
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
                    ev = Evaluation(ev_spec, dataclasses.replace(settings, metrics=metrics), store, None, progress)
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
        console.print(f"artifact: {out}\nGGUF: {gguf_path}\nresults store: {store.path}")


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

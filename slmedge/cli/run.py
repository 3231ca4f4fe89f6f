"""slmedge run: the main job on the embedded default, no arguments needed."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..compress.api import compress, default_output
from ..compress.artifact import Artifact
from ..compress.recipe import Recipe
from ..errors import ArtifactError
from ..evaluate.corpora import load_corpus
from ..evaluate.perplexity import perplexity
from ..models.source import load
from .common import console, errors_to_exit, progress_bar


def run_command(
    model: Optional[str] = typer.Argument(None, help="Model source (default: the embedded smollm2-135m)."),
    method: str = typer.Option("awq", "--method", "-m", help="Compression method."),
    bits: int = typer.Option(4, "--bits", "-b", help="Bit width."),
    group_size: int = typer.Option(128, "--group-size", "-g", help="Group size (-1: per channel)."),
    nsamples: int = typer.Option(64, "--nsamples", help="Calibration samples of --seqlen tokens (C4)."),
    seqlen: int = typer.Option(512, "--seqlen", help="Tokens per calibration sample and per perplexity window."),
    windows: int = typer.Option(8, "--ppl-windows", help="WikiText-2 windows for the quick perplexity check."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Artifact directory."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Recompress even if a matching artifact exists."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", envvar="SLMEDGE_DATA_DIR", help="Data folder (default ../shared/data)."),
):
    """The main job: compress the default model with AWQ 4-bit and compare perplexity.

    An artifact already written by the same recipe is reused, so running it twice is cheap.

    \b
    Examples:
      slmedge run
      slmedge run --method gptq --group-size 64
    """
    with errors_to_exit():
        recipe = Recipe(method=method, bits=bits, group_size=group_size, nsamples=nsamples, seqlen=seqlen).validate()
        out = Path(output) if output else default_output(model or "smollm2-135m", recipe)
        artifact = _reusable(out, recipe) if not overwrite else None
        with progress_bar() as progress:
            if artifact is None:
                outcome = compress(model, recipe, out, data_dir=data_dir, overwrite=overwrite, progress=progress)
                from .compress import print_summary

                print_summary(outcome)
                compressed, tokenizer = outcome.loaded.model, outcome.loaded.tokenizer
                artifact = Artifact.open(out)
            else:
                console.print(f"reusing {out} (same recipe, checksums verified); --overwrite to recompress")
                compressed, tokenizer = artifact.load_model(), artifact.load_tokenizer()
            text = load_corpus("wikitext2", data_dir)
            base = load(model).model
            rows = []
            for label, m in (("base", base), (recipe.describe(), compressed)):
                rows.append((label, perplexity(m, tokenizer, text, seqlen=seqlen, max_windows=windows, progress=progress)))
        table = Table(title=f"WikiText-2 perplexity, {windows} windows of {seqlen} tokens")
        table.add_column("model")
        table.add_column("perplexity", justify="right")
        table.add_column("bits/byte", justify="right")
        for label, r in rows:
            table.add_row(label, f"{r.perplexity:.2f} ± {r.perplexity_stderr:.2f}", f"{r.bits_per_byte:.4f}")
        console.print(table)
        console.print(f"artifact: {out}")


def _is_artifact(path: Path) -> bool:
    return (path / "slmedge.json").is_file()


def _reusable(path: Path, recipe: Recipe):
    if not _is_artifact(path):
        return None
    try:
        art = Artifact.open(path)
    except ArtifactError:
        return None
    return art if art.manifest.get("recipe") == recipe.to_dict() else None

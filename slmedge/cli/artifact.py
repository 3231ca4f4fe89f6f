"""slmedge artifact: what can be done with an artifact directory besides exporting it."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import console, errors_to_exit

artifact_app = typer.Typer(help="Artifact directories: materialize a plain Hugging Face folder.", no_args_is_help=True,
                           rich_markup_mode=None)


@artifact_app.command("materialize")
def materialize_command(
    artifact: Path = typer.Argument(..., help="An slmedge artifact directory."),
    output: Path = typer.Option(..., "--output", "-o", help="The Hugging Face folder to write (new or empty)."),
):
    """Write an artifact as a plain Hugging Face folder (config, tokenizer, fp32 model.safetensors)
    that transformers' from_pretrained loads alone. A compact (format version 2) artifact keeps
    only codes and the untouched tensors: its weights are rebuilt bit for bit.

    \b
    Examples:
      slmedge artifact materialize out/gptq -o hf-folder
    """
    from ..models.artifact_weights import materialize

    with errors_to_exit():
        dest = materialize(artifact, output)
    size = sum(f.stat().st_size for f in dest.iterdir() if f.is_file())
    console.print(f"wrote {dest} ({size / 1e6:.1f} MB): AutoModelForCausalLM.from_pretrained('{dest}') loads it")

"""slmedge export / slmedge inspect."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Optional

import typer

from .common import (Table, bounded, check_model, check_output_dir, check_output_file, console, err_console,
                     errors_to_exit, progress_bar, supervised)
from ..data import DEFAULT_CALIBRATION
from .data import DATA_DIR_HELP


def _fmt_bytes(n: int | None) -> str:
    """A size in decimal units (1 MB = 10^6 bytes), as evaluate and the docs' tables give sizes."""
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _print_export(report: dict, fmt) -> None:
    """The report of an export in ``fmt`` (an ExportFormat, which adds its own rows)."""
    table = Table(title=f"slmedge export: {fmt.name} {report.get('qtype') or report.get('type')}", show_header=False)
    table.add_row("output", str(report["path"]))
    table.add_row("source", f"{report['source']} ({report['source_kind']})")
    table.add_row("size", _fmt_bytes(report.get("bytes")))
    for label, value in fmt.report_rows(report):
        table.add_row(label, value)
    v = report.get("verification")
    if v:
        line = (f"top-1 {v['top1_agreement']:.1%}, mean KL {v['mean_kl']:.2e}, max |Δlogit| "
                f"{v['max_abs_logit_diff']:.3g} over {v['positions']} positions")
        if "kv_cache_max_abs_diff" in v:
            line += f"; KV-cache path max |Δ| {v['kv_cache_max_abs_diff']:.2g}"
        if v.get("against") == "torchao-eager":  # torchao chose the values: the lowering is what was checked
            table.add_row("verified against torchao's model in torch", line)
            src = v.get("vs_source") or {}
            if src:
                table.add_row("torchao's model against the source",
                              f"top-1 {src['top1_agreement']:.1%}, mean KL {src['mean_kl']:.2e} (the scheme's own loss)")
        else:
            table.add_row("verified against torch", line)
    else:
        table.add_row("verified against torch", "skipped (--no-verify)")
    for note in report.get("notes", []):
        table.add_row("note", note)
    table.add_row("time", f"{report['seconds']:.1f} s")
    console.print(table)


@bounded(threads="threads", block_size="export_block_size", accuracy_level="accuracy_level")
def export_command(
    source: Optional[str] = typer.Argument(None, help="An slmedge artifact, HF folder, .gguf file, Hub id or embedded name (default smollm2-135m)."),
    fmt: str = typer.Option("gguf", "--format", "-f", help="gguf (llama.cpp), onnx (onnxruntime), onnxruntime-genai (an ONNX folder with genai_config.json), "
                             "compressed-tensors (transformers, vLLM: an artifact's codes, pack-quantized) or executorch (a .pte program for XNNPACK)."),
    qtype: str = typer.Option("auto", "--type", "-t", help="GGUF: auto, f32, f16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, iq4_xs, q3_k, q4_k, q5_k, q6_k, q4_k_s, q4_k_m, q5_k_m, q3_k_m, q2_k (an artifact's codes are kept where the type's grid holds them: q8_0, q4_0, q4_1 for the uniform grid; the type of its own llama.cpp grid for --grid; the rest by llama.cpp's quantizer). ONNX: auto, fp32, fp16, int4, int8, int8-dynamic, ort-rtn, ort-k_quant, ort-hqq (onnxruntime's own 4-bit quantizers on every linear, as a user calls them). ExecuTorch: auto, codes, fp32, 8da4w (torchao's). auto: the type that keeps the artifact's codes."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="A GGUF file; for the other formats a folder (default slmedge-out/<source>-<type>)."),
    exact: bool = typer.Option(False, "--exact", help="Fail instead of re-quantizing weights whose codes the type cannot hold."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Run the file in its runtime on a probe and compare with torch."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Threads for quantizing and verifying (default: all cores)."),
    block_size: int = typer.Option(32, "--block-size", help="ONNX: onnxruntime quantizer's block for weights without codes; ExecuTorch: torchao's group size (a multiple of 32)."),
    accuracy_level: int = typer.Option(4, "--accuracy-level", help="ONNX MatMulNBits accuracy_level: 4 (default) multiplies with int8-quantized activations, as llama.cpp does, several times faster on CPU; 0 computes in fp32 (exact, slow for the 8-bit head)."),
    keep_fp32_head: bool = typer.Option(False, "--keep-fp32-head", help="ONNX int4/int8: leave lm_head and the embedding in fp32 (default: 8-bit head, fp16 embedding)."),
    embedding_type: str = typer.Option("fp16", "--embedding-type", help="ONNX int4/int8: the token embedding: fp16 (default), int8 or int4 (com.microsoft GatherBlockQuantized, --block-size blocks, scales searched for the least error; a tied head of the same type and block shares its codes)."),
    head_type: str = typer.Option("int8", "--head-type", help="ONNX with codes: the head and other linears without codes as MatMulNBits: int8 (default, symmetric) or int4 (zero points), --block-size blocks, scales searched for the least error."),
    keep_f16_uncoded: bool = typer.Option(False, "--keep-f16-uncoded", help="GGUF with codes: keep tensors the recipe left alone (embedding, head) at f16 instead of llama.cpp's choice for the type."),
    imatrix: Optional[Path] = typer.Option(None, "--imatrix", help="GGUF: an importance matrix in llama.cpp's format (slmedge imatrix or llama-imatrix) that weights llama.cpp's quantizer, as llama-quantize --imatrix does."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision."),
    as_json: bool = typer.Option(False, "--json", help="Print the full report (per-tensor types) as JSON."),
):
    """Export a model or artifact to GGUF, ONNX, onnxruntime-genai, compressed-tensors or ExecuTorch, checked against torch.

    \b
    Examples:
      # GPTQ codes as Q4_0 blocks; AWQ codes as MatMulNBits:
      slmedge export out/gptq --format gguf --type q4_0 -o model.gguf
      slmedge export out/awq --format onnx --type int4 -o onnx_dir/
      slmedge export smollm2-135m --format gguf --type q4_k_m -o base-q4km.gguf
      slmedge export MODEL --format gguf --type iq4_xs --imatrix m.imatrix.gguf
      slmedge export out/gptq --format gguf --type q4_1 --exact -o m.gguf
      # for transformers and vLLM; for onnxruntime-genai apps:
      slmedge export out/gptq --format compressed-tensors -o ct_dir/
      slmedge export out/awq --format onnxruntime-genai -o genai_dir/
      slmedge export out/gptq --format executorch -o et_dir/
    """
    from ..export.api import export
    from ..export.formats import get_format

    supervised("export")  # a crash in llama.cpp or onnxruntime: one line naming it and the file
    with errors_to_exit():
        _check_export(source, fmt, qtype, output, overwrite, threads, accuracy_level, revision, block_size, imatrix,
                      embedding_type, head_type, keep_fp32_head)
        with warnings.catch_warnings(record=True) as caught, progress_bar():  # tensor by tensor, on stderr
            warnings.simplefilter("always")
            report = export(source, fmt, qtype, output, exact=exact, verify=verify, overwrite=overwrite,
                            n_threads=threads, block_size=block_size, accuracy_level=accuracy_level,
                            keep_fp32_head=keep_fp32_head, keep_f16_uncoded=keep_f16_uncoded, revision=revision,
                            imatrix=imatrix, embedding_type=embedding_type, head_type=head_type)
        for w in caught:
            if issubclass(w.category, UserWarning) and "slmedge" in str(getattr(w, "filename", "")):
                err_console.print(f"[yellow]warning:[/] {w.message}", highlight=False, soft_wrap=True)
        if as_json:
            console.print_json(json.dumps(report, default=str))
        else:
            _print_export(report, get_format(fmt))


def _check_export(source, fmt, qtype, output, overwrite, threads, accuracy_level, revision, block_size=32,
                  imatrix=None, embedding_type="fp16", head_type="int8", keep_fp32_head=False) -> None:
    """Everything an export can be refused for without reading the model: the format and its type,
    the ranges, the source (resolved: a missing one writes nothing), the output location."""
    from ..errors import OutputExistsError
    from ..export.api import check_export_options, default_output

    target = check_export_options(fmt, qtype, accuracy_level=accuracy_level, n_threads=threads,
                                  block_size=block_size, imatrix=imatrix, embedding_type=embedding_type,
                                  head_type=head_type, keep_fp32_head=keep_fp32_head)
    src = check_model(source, revision)
    if output is not None:
        out = Path(output)
        option = "-o"
    elif src.kind in ("artifact", "hf_dir"):  # the default name follows from the folder (others: once converted)
        out, option = default_output(src.path, target.name, qtype), "the default output"
    else:
        return
    target.check_output(out)
    inputs = [source] if source is not None else []
    if target.single_file:
        check_output_file(out, option=option, overwrite=overwrite, inputs=inputs, ours=lambda p: _ours(target, p),
                          what=target.what, example=target.output_name("model"),
                          ours_noun=f"a {target.label} file")
    else:
        check_output_dir(out, option=option, overwrite=True, inputs=inputs, what=target.what)
        if out.is_dir() and any(out.iterdir()):
            # What slmedge did not write there first: --overwrite is advised only where it would then work.
            if not _ours(target, out):
                entries = sorted(p.name for p in out.iterdir())
                shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
                raise OutputExistsError(f"{option} {out} holds what slmedge did not write there ({shown}; no export "
                                        "manifest); --overwrite only replaces slmedge's own outputs: choose another "
                                        "output")
            if not overwrite:
                raise OutputExistsError(f"{option} {out} is not empty; pass --overwrite to replace it")


def _ours(target, path: Path) -> bool:
    """An output slmedge wrote in this format: it carries the format's manifest."""
    try:
        return target.read_manifest(path) is not None
    except Exception:  # noqa: BLE001 - not a file of this format at all, or a damaged one
        return False


def inspect_command(
    path: Path = typer.Argument(..., help="A .gguf file, an .onnx file or ONNX export directory, a compressed-tensors folder, or an slmedge artifact."),
    as_json: bool = typer.Option(False, "--json", help="Print everything as JSON."),
    tensors: bool = typer.Option(False, "--tensors", help="With a manifest: list every tensor's type and whether its codes were kept."),
):
    """Print what is inside a GGUF file, an ONNX, onnxruntime-genai, compressed-tensors or ExecuTorch export, or an artifact.

    \b
    Examples:
      slmedge inspect model.gguf
      slmedge inspect onnx_dir/ --json
    """
    from ..export.formats import FORMATS
    from ..export.inspect import inspect_path

    with errors_to_exit():
        info = inspect_path(path)
        if as_json:
            console.print_json(json.dumps(info, default=str))
            return
        table = Table(title=f"{info['path']} ({info['format']})", show_header=False)
        table.add_row("architecture", str(info.get("architecture")))
        if info["format"] == "slmedge-artifact":
            table.add_row("recipe", json.dumps(info["recipe"]))
            table.add_row("compressed linears", str(info["compressed_linears"]))
            table.add_row("files", ", ".join(f"{n} {_fmt_bytes(b)}" for n, b in info["files"].items()))
            table.add_row("format version", f"{info['format_version']}" + (" (dense fp32 weights)" if info["format_version"] < 2
                                                                           else " (compact: weights rebuilt from the codes)"))
            console.print(table)
            where = Table("what", "size", "share", title="where the bytes go")
            total = sum(info["storage"].values()) or 1
            for kind, n in sorted(info["storage"].items(), key=lambda kv: -kv[1]):
                where.add_row(kind, _fmt_bytes(n), f"{n / total:.1%}")
            console.print(where)
            return
        table.add_row("size", _fmt_bytes(info["file_bytes"]) + (" (with external data)" if info.get("external_data") else ""))
        table.add_row("weights", f"{info['params']:,} parameters, {info['bits_per_weight']} bits per weight")
        for label, value in FORMATS[info["format"]].inspect_rows(info):
            table.add_row(label, value)
        m = info.get("manifest")
        if m:
            ts = m.get("tensors") or m.get("layers") or {}
            kept = sum(1 for t in ts.values() if t.get("codes_kept"))
            table.add_row("slmedge manifest", f"source {m.get('source')} ({m.get('source_kind')}), type "
                          f"{m.get('qtype') or m.get('type')}, codes kept exactly in {kept} of {len(ts)} tensors")
            if m.get("recipe"):  # the settings that applied (Recipe.applied), as the file records them
                table.add_row("recipe", json.dumps(m["recipe"]))
        console.print(table)
        types = Table("type", "tensors", "parameters", "size", "bits/weight", title="tensors by type")
        for kind, e in info["by_type"].items():
            types.add_row(kind, str(e["tensors"]), f"{e['params']:,}", _fmt_bytes(e["bytes"]), str(e["bits_per_weight"]))
        console.print(types)
        if tensors and m:
            t = Table("tensor", "type", "codes kept", "grid")
            for name, e in (m.get("tensors") or m.get("layers") or {}).items():
                t.add_row(name, str(e.get("type")), "yes" if e.get("codes_kept") else "no", str(e.get("grid") or ""))
            console.print(t)


@bounded(nsamples="nsamples", seqlen="seqlen", seed="seed", batch_size="batch_size")
def imatrix_command(
    model: Optional[str] = typer.Argument(None, help="HF id, local HF folder, .gguf file, or an embedded name (default smollm2-135m)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="The importance matrix, a .gguf file (default slmedge-out/<model>.imatrix.gguf)."),
    calibration: str = typer.Option(DEFAULT_CALIBRATION, "--calibration", "-c", help="c4, multilingual[:LANGS], a .txt/.jsonl file, hf:DATASET[:CONFIG][:SPLIT], or several joined by + (a mix: c4+multilingual)."),
    nsamples: int = typer.Option(128, "--nsamples", help="Calibration samples (llama-imatrix's chunks)."),
    seqlen: int = typer.Option(512, "--seqlen", help="Tokens per calibration sample (llama-imatrix's -c)."),
    seed: int = typer.Option(0, "--seed", help="Seed for sampling calibration windows: the same as slmedge compress's with the same settings."),
    batch_size: int = typer.Option(8, "--batch-size", help="Calibration samples per block forward (bounds activation memory)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an importance matrix slmedge wrote."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", envvar="SLMEDGE_DATA_DIR", help=DATA_DIR_HELP),
    text_field: str = typer.Option("text", "--text-field", help="JSONL / dataset field holding the text."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit)."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Run code shipped with a Hub model (off unless you ask)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
):
    """Write an importance matrix in llama.cpp's format from slmedge's calibration (for llama-quantize --imatrix).

    Each linear's sum of squared inputs per column over the calibration windows (computed in fp32,
    block by block), as llama-imatrix computes it; slmedge export --imatrix and llama-quantize
    --imatrix read it.

    \b
    Examples:
      slmedge imatrix                   # SmolLM2-135M on C4, 128 x 512 tokens
      slmedge imatrix MODEL --calibration multilingual -o model.imatrix.gguf
      llama-quantize --imatrix model.imatrix.gguf model-f16.gguf out.gguf IQ4_XS
    """
    from ..export.imatrix import check_output, default_output, imatrix_recipe, make_imatrix

    with errors_to_exit():
        imatrix_recipe(calibration, nsamples, seqlen, seed, batch_size)
        check_model(model, revision, trust_remote_code)
        check_output(Path(output) if output is not None else default_output(model), overwrite)
        with progress_bar() as progress:
            report = make_imatrix(model, output, calibration=calibration, nsamples=nsamples, seqlen=seqlen, seed=seed,
                                  batch_size=batch_size, data_dir=data_dir, device=device, overwrite=overwrite,
                                  trust_remote_code=trust_remote_code, revision=revision, text_field=text_field,
                                  progress=progress)
        if as_json:
            console.print_json(json.dumps(report, default=str))
            return
        table = Table(title="slmedge imatrix", show_header=False)
        base = report["base_model"]
        calib = report["calibration"]
        table.add_row("model", str(base.get("name") or base.get("id") or base.get("path")))
        table.add_row("calibration", f"{calib['spec']}: {calib['nsamples']} x {calib['seqlen']} tokens, seed {calib['seed']}")
        table.add_row("entries", f"{report['entries']} weight tensors")
        table.add_row("size", _fmt_bytes(report["bytes"]))
        table.add_row("time", f"{report['seconds']:.1f} s")
        table.add_row("importance matrix", report["path"])
        console.print(table)

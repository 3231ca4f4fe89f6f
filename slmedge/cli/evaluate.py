"""slmedge evaluate: perplexity, fidelity, tasks, memory and latency on torch, onnxruntime or llama.cpp."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import typer

from .common import (Table, bounded, check_model, check_output_file, check_writable_place, console, errors_to_exit,
                     progress_bar, supervised)
from ..fsutil import output_lock
from .data import DATA_DIR_HELP


def _split(value: Optional[str]) -> Optional[tuple[str, ...]]:
    if value is None:
        return None
    return tuple(v.strip() for v in value.split(",") if v.strip())


def flips_text(r: dict, key: str) -> str:
    """A flip share as the count it is: '3 of 40 (7.5%)'."""
    return f"{round(r[key] * r['n'])} of {r['n']} ({r[key]:.1%})"


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.1f} MB"


def print_results(res: dict) -> None:
    m = res["metrics"]
    head = f"{res['model']} · {res['runtime']} · {res['threads']} threads · target {res['target']}"
    if "perplexity" in m:
        t = Table("corpus", "perplexity", "bits/byte", "tokens", title=f"perplexity — {head}")
        for name, r in m["perplexity"].items():
            t.add_row(name, f"{r['perplexity']:.3f} ± {r['perplexity_stderr']:.3f}", f"{r['bits_per_byte']:.4f}",
                      str(r["tokens"]))
        console.print(t)
    if "fidelity" in m:
        f = m["fidelity"]
        t = Table("statistic", "value", title=f"fidelity vs {f['reference']} ({f['reference_runtime']})")
        t.add_row("mean KL", f"{f['kl_mean']:.5f} ± {f['kl_mean_stderr']:.5f}")
        t.add_row("median KL", f"{f['kl_median']:.5f}")
        t.add_row("99th pct KL", f"{f['kl_p99']:.5f}")
        t.add_row("top-1 agreement", f"{f['top1_agreement']:.2%}")
        t.add_row("RMS Δp", f"{f['rms_delta_p']:.3%}")
        if "hidden_snr_db" in f:
            t.add_row("hidden-state SNR", f"{f['hidden_snr_db']:.2f} dB")
        t.add_row("tokens", str(f["tokens"]) + (" (reference from cache)" if f["reference_cached"] else ""))
        console.print(t)
    if "tasks" in m:
        t = Table("task", "n", "acc", "acc_norm", "answers flipped vs ref (acc / acc_norm)", title="zero-shot tasks")
        for name, r in m["tasks"].items():
            norm = f"{r['acc_norm']:.4f} ± {r['acc_norm_stderr']:.4f}" if "acc_norm" in r else "-"
            flips = " / ".join(flips_text(r, key) for key in ("flips_vs_reference", "flips_norm_vs_reference")
                               if key in r) or "-"
            t.add_row(name, str(r["n"]), f"{r['acc']:.4f} ± {r['acc_stderr']:.4f}", norm, flips)
        console.print(t)
    if "memory" in m:
        r = m["memory"]
        t = Table("memory", "value")
        t.add_row("file size", _mb(r["file_bytes"]))
        if r.get("bits_per_weight"):
            t.add_row("bits per weight", f"{r['bits_per_weight']:.3f}")
        tokens = r.get("kv_cache_tokens", r["context"])
        t.add_row(f"KV cache, static: {tokens} positions in the program" if r.get("kv_cache_static") else
                  f"KV cache at {tokens} tokens", _mb(r["kv_cache_bytes"]))
        if "peak_rss_bytes" in r:
            t.add_row("peak RSS (child process)", _mb(r["peak_rss_bytes"]))
        console.print(t)
    if "latency" in m:
        r = m["latency"]
        t = Table("latency", "median", "min", "max", title=f"pp{r['prompt_tokens']} / tg{r['generated']}, "
                  f"{r['repeats']} runs after warm-up")
        for key, label, fmt in (("ttft_s", "time to first token (s)", "{:.3f}"),
                                ("prefill_tps", "prefill tokens/s", "{:.1f}"), ("decode_tps", "decode tokens/s", "{:.1f}")):
            s = r[key]
            t.add_row(label, fmt.format(s["median"]), fmt.format(s["min"]), fmt.format(s["max"]))
        if r.get("emulated"):
            t.caption = "EMULATED (qemu): not device latency"
        console.print(t)
        roof = r.get("roofline") or {}
        if roof.get("decode_bound_tps") or roof.get("prefill_bound_tps"):
            t = Table("roofline", "bound tokens/s", "measured", "fraction", title=f"roofline of target {roof['target']}: "
                      f"{roof['label']}")
            for kind, peak in (("decode", f"{roof.get('bandwidth_gbs') or 0:.1f} GB/s"),
                               ("prefill", roof.get("prefill_peak", ""))):
                bound = roof.get(f"{kind}_bound_tps")
                if bound:
                    got, frac = roof.get(f"{kind}_tps"), roof.get(f"{kind}_fraction")
                    t.add_row(f"{kind} ({peak})", f"{bound:.1f}", "-" if got is None else f"{got:.1f}",
                              "-" if frac is None else f"{frac:.0%}")
            console.print(t)
    for note in res.get("notes", []):
        console.print(f"note: {note}")


@bounded(seqlen="eval_seqlen", stride="stride", ppl_windows="ppl_windows_or_all", limit="limit", pp="pp", tg="tg",
         repeats="repeats", context="context", threads="threads")
def evaluate_command(
    source: Optional[str] = typer.Argument(None, help="Artifact, model source, .gguf file or ONNX export (default: smollm2-135m)."),
    metrics: Optional[str] = typer.Option(None, "--metrics", help="Comma list of perplexity,fidelity,tasks,memory,latency (default: all)."),
    runtime: Optional[str] = typer.Option(None, "--runtime", help="torch, onnxruntime, onnxruntime-genai, llama.cpp or executorch (default: follows from the file)."),
    langs: str = typer.Option("en,ar,hi,zh,th,de,es", "--langs", help="NTREX-128 languages for perplexity (and XCOPA tasks)."),
    no_wikitext: bool = typer.Option(False, "--no-wikitext", help="Skip WikiText-2 in perplexity."),
    corpus: Optional[list[str]] = typer.Option(None, "--corpus", help="A plain text file to score (repeatable)."),
    seqlen: int = typer.Option(512, "--seqlen", help="Perplexity window length in tokens."),
    stride: Optional[int] = typer.Option(None, "--stride", help="Tokens between window starts (default: the window length)."),
    ppl_windows: Optional[int] = typer.Option(4, "--ppl-windows", help="Windows per corpus (0: all)."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="Comma list of tasks, .jsonl files, or the groups english, xcopa (11 languages), all (default: the eight English tasks + XCOPA in --langs)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Items per task (default: all)."),
    reference: Optional[str] = typer.Option(None, "--reference", help="Fidelity reference (default: the artifact's base model)."),
    reference_runtime: Optional[str] = typer.Option(None, "--reference-runtime", help="Runtime of the reference (default: follows from it)."),
    pp: int = typer.Option(512, "--pp", help="Latency: prompt tokens."),
    tg: int = typer.Option(128, "--tg", help="Latency: generated tokens."),
    repeats: int = typer.Option(3, "--repeats", help="Latency: timed runs after one warm-up."),
    context: Optional[int] = typer.Option(None, "--context", help="Context length for the KV-cache size, the tasks' "
                                          "longest input and llama.cpp's n_ctx (default: 2048, or the model's "
                                          "positions where it has fewer)."),
    beyond_positions: bool = typer.Option(False, "--beyond-positions", help="Let --seqlen, --context and --pp + --tg "
                                          "go past the positions the model was trained for (its config's "
                                          "max_position_embeddings, a GGUF's context_length); refused otherwise."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Threads (default: all cores)."),
    target: str = typer.Option("cpu", "--target", help="Target profile (slmedge targets list): cpu, arm64 (emulated), cuda, an ssh device, or a .toml file."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write every number to this JSON file."),
    results_db: Optional[Path] = typer.Option(None, "--results-db", envvar="SLMEDGE_RESULTS_DB", help="SQLite results store (default: user data dir)."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", envvar="SLMEDGE_DATA_DIR", help=DATA_DIR_HELP),
):
    """Measure a model in its runtime: perplexity, fidelity, zero-shot tasks, memory, latency.

    \b
    Examples:
      slmedge evaluate out/awq --metrics perplexity,fidelity --langs en,th
      slmedge evaluate m.gguf --metrics perplexity --corpus my.txt --json r.json
      slmedge evaluate onnx_dir --tasks arc_easy,xcopa_th --limit 200
      slmedge evaluate out/gptq --runtime llama.cpp --metrics latency
      slmedge evaluate model.gguf --target arm64 --metrics perplexity,latency
    """
    from ..evaluate.api import METRICS, EvalSettings

    supervised("evaluate")  # a crash in a runtime: one line naming it and the file (common.supervised)
    with errors_to_exit():
        settings = EvalSettings(
            metrics=_split(metrics) or tuple(METRICS), langs=_split(langs) or (), wikitext=not no_wikitext,
            corpora=tuple(corpus or ()), seqlen=seqlen, stride=stride, ppl_windows=ppl_windows or None,
            tasks=_split(tasks), limit=limit, reference=reference, reference_runtime=reference_runtime, pp=pp, tg=tg,
            repeats=repeats, context=context, threads=threads, runtime=runtime, target=target,
            data_dir=str(data_dir) if data_dir else None, beyond_positions=beyond_positions)
        check_evaluation(source, settings, json_out)
        # One evaluation writes a --json file at a time: a second one naming the same file is refused now,
        # naming the first (fsutil.output_lock), not left to replace its results at the end.
        json_lock = output_lock(json_out, what=f"--json {json_out}") if json_out else contextlib.nullcontext()
        with json_lock:
            _evaluate(source, settings, results_db, json_out)


def _evaluate(source, settings, results_db, json_out) -> None:
    """The evaluation, recorded in the results store (a new store is created only once the model
    opened and every input was read); its results printed."""
    from ..evaluate.api import Evaluation
    from ..evaluate.store import ResultsStore

    store = ResultsStore(results_db) if check_store_location(results_db) else None  # a foreign file: refused now
    try:
        with progress_bar() as progress:
            ev = Evaluation(source, settings, store, json_out, progress)
            try:
                if store is None:
                    ev.check_inputs()
                    store = ev.store = ResultsStore(results_db)
                res = ev.run()
            finally:
                ev.close()
    finally:
        if store is not None:
            store.close()
    print_results(res)
    console.print(f"results: run {res.get('run_id')} in {store.path}" + (f", JSON {json_out}" if json_out else ""))


def check_source(spec) -> None:
    """A model to evaluate that is not on disk must resolve (a missing path, an unreachable Hub id
    fail here, before anything is opened or recorded); what is on disk is read by its runtime."""
    if spec is None:
        return
    path = Path(str(spec)).expanduser()
    if path.exists():
        from ..models.artifact_format import is_artifact, read_manifest

        if is_artifact(path):
            read_manifest(path)  # a manifest that does not parse is refused now, naming it
        return
    check_model(str(spec))


def check_evaluation(source, settings, json_out=None) -> None:
    """Everything an evaluation can be refused for before a model is opened: the settings (ranges,
    names of metrics, languages, tasks, runtimes, the target), the source and reference, the JSON
    output's location."""
    from ..evaluate.bounds import check_evaluation_bounds
    from ..runtimes.registry import check_runtime_name
    from ..targets.profiles import get_profile

    settings.validate()
    for name in (settings.runtime, settings.reference_runtime):
        if name:
            check_runtime_name(name)
    profile = get_profile(settings.target, detect=False)
    check_source(source)
    if settings.reference and "fidelity" in settings.metrics:
        check_source(settings.reference)
    # the lengths against the model's positions, the threads against the target's cores, the memory
    # the settings need against what the target has: read from the model's config, not its weights
    check_evaluation_bounds(source, settings, profile, cli=True)
    _read_inputs(settings)
    if json_out is not None:
        check_output_file(Path(json_out), option="--json", overwrite=None, inputs=[source] if source else [],
                          what="the JSON output", example="results.json")


def _read_inputs(settings) -> None:
    """Read the files a user names (task files, --corpus files) as the evaluation will: a missing,
    empty or malformed one fails before the model is opened or the target measured."""
    from ..evaluate.corpora import load_corpus
    from ..errors import DataError
    from ..evaluate.tasks import load_task

    if "tasks" in settings.metrics and settings.tasks:
        for task in settings.task_list():
            load_task(task, settings.data_dir, settings.limit)
    if "perplexity" in settings.metrics:
        for f in settings.corpora:
            if not load_corpus(f, settings.data_dir).strip():
                raise DataError(f"the corpus {f} is empty: no text to score")


def check_store_location(path) -> bool:
    """Whether the results store (--results-db, $SLMEDGE_RESULTS_DB, or the default) is already a
    file; a folder in its place, or a place no file can be created, is refused (nothing created)."""
    from ..errors import OutputError
    from ..evaluate.store import default_path

    p = Path(path).expanduser() if path else default_path()
    option = "--results-db" if path else "the results store"
    if p.exists() and not p.is_file():
        raise OutputError(f"{option} {p} is a folder; give a file path for the results store")
    if not p.exists():
        check_writable_place(p, option)
    return p.exists()


def lm_eval_command(ctx: typer.Context):
    """lm-evaluation-harness's command line with slmedge's runtimes registered as --model slmedge.

    \b
    Examples:
      slmedge lm-eval --model slmedge --model_args model=m.gguf --tasks arc_easy
      slmedge lm-eval --model slmedge --model_args model=onnx_dir,threads=2 \\
          --tasks hellaswag --limit 100
    """
    import sys

    with errors_to_exit():
        if not {"-h", "--help"} & set(ctx.args):  # lm-eval's own help needs no model class (nor torch)
            from .. import lm_eval_model  # noqa: F401 - registers the model class (or says how to install lm_eval)
        try:
            from lm_eval.__main__ import cli_evaluate
        except ImportError:
            from .. import lm_eval_model  # noqa: F401 - raises the error that says how to install lm_eval
            raise

        sys.argv = ["lm_eval", *ctx.args]
        cli_evaluate()

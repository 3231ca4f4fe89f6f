"""`slmedge report`: the results store as tables, plots and caveats — one self-contained HTML
file (plots inline as PNG) or Markdown (plots beside it).

Rows are evaluations: a study's finished evaluate jobs (named by model, method, export and
target), or, in a store without studies, every evaluation run that finished. Runs that failed or
never finished (and runs with no results, which older stores hold for failed evaluations) are
left out of the tables and plots; the report says how many.

A report carries a marker (``<!-- slmedge-report VERSION -->``, first in the file): ``--overwrite``
replaces only a file that starts with it, so a file slmedge did not write is never replaced.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import sqlite3
import textwrap
from collections import defaultdict
from pathlib import Path

from .. import __version__
from ..errors import OutputExistsError, SlmedgeError
from ..evaluate.store import ResultsStoreError
from ..models.artifact_format import read_manifest
from .levels import family

MARKER = "slmedge-report"
_HTML_START = "<!doctype html>"

FIDELITY = [("kl_mean", "mean KL", "{:.4f}"), ("kl_p99", "KL p99", "{:.3f}"), ("top1_agreement", "top-1", "{:.1%}"),
            ("rms_delta_p", "RMS Δp", "{:.2%}"), ("hidden_snr_db", "SNR dB", "{:.1f}"), ("task_flips", "task flips",
                                                                                       "{:.1%}")]
SYSTEM = [("file_bytes", "size MB", lambda v: f"{v / 1e6:.1f}"), ("bits_per_weight", "bits/w", lambda v: f"{v:.2f}"),
          ("peak_rss_bytes", "peak RSS MB", lambda v: f"{v / 1e6:.0f}"), ("prefill_tps", "prefill tok/s",
                                                                          lambda v: f"{v:.1f}"),
          ("decode_tps", "decode tok/s", lambda v: f"{v:.1f}"), ("decode_bound_tps", "decode bound",
                                                                 lambda v: f"{v:.1f}"),
          ("decode_fraction", "of bound", lambda v: f"{v:.0%}")]


# A run that is an evaluation to show: finished, with results.
_FINISHED = "r.status = 'done' AND EXISTS (SELECT 1 FROM results x WHERE x.run_id = r.id)"


def left_out(store, study: str | None = None) -> int:
    """How many evaluations ``load_rows`` leaves out: a study's evaluate jobs of the current grid
    that failed; in a store of plain evaluations, the runs that failed, never finished or hold no
    results."""
    db = store.db
    if study or db.execute("SELECT 1 FROM study_jobs j JOIN runs r ON r.id = j.run_id WHERE j.kind = 'evaluate' "
                           "AND j.status = 'done' AND j.in_grid = 1 AND r.status = 'done' LIMIT 1").fetchone():
        q = "SELECT COUNT(*) FROM study_jobs WHERE kind = 'evaluate' AND status = 'failed' AND in_grid = 1"
        return db.execute(q + (" AND study = ?" if study else ""), (study,) if study else ()).fetchone()[0]
    return db.execute(f"SELECT COUNT(*) FROM runs r WHERE NOT ({_FINISHED})").fetchone()[0]


def load_rows(store, study: str | None = None) -> list[dict]:
    """One dict per evaluation: ``label`` fields, ``metrics[metric][subset] = value``, run info."""
    db = store.db
    q = ("SELECT j.study, j.labels, j.run_id, j.spec FROM study_jobs j JOIN runs r ON r.id = j.run_id "
         "WHERE j.kind = 'evaluate' AND j.status = 'done' AND j.in_grid = 1 AND r.status = 'done'")
    args: tuple = ()
    if study:
        q += " AND j.study = ?"
        args = (study,)
    jobs = db.execute(q + " ORDER BY j.rowid", args).fetchall()
    if study and not jobs:
        known = [r[0] for r in db.execute("SELECT DISTINCT study FROM study_jobs")]
        raise ResultsStoreError(f"no finished evaluations of study '{study}' in {store.path} "
                                f"(studies: {', '.join(known) or 'none'})")
    if not jobs:  # a store of plain evaluations
        jobs = [(None, json.dumps({"model": m, "export": rt, "target": t}), rid, "{}")
                for rid, m, rt, t in db.execute(f"SELECT id, model, runtime, target FROM runs r WHERE {_FINISHED} "
                                                "ORDER BY id")]
    facts: dict = {}
    for st in {j[0] for j in jobs} - {None}:
        facts.update({(st, k): v for k, v in _job_facts(db, st).items()})
    out = []
    for st, labels, run_id, spec in jobs:
        run = db.execute("SELECT model, runtime, threads, target, emulated, settings FROM runs WHERE id = ? "
                         "AND status = 'done'", (run_id,)).fetchone()
        if run is None:
            continue
        metrics: dict = defaultdict(dict)
        for metric, subset, value, extra in db.execute(
                "SELECT metric, subset, value, extra FROM results WHERE run_id = ? ORDER BY id", (run_id,)):
            metrics[metric][subset] = value
            if extra and metric in ("acc", "acc_norm"):
                metrics.setdefault("_n", {})[subset] = json.loads(extra).get("n")
        lab = json.loads(labels)
        subject = json.loads(spec).get("subject")
        mine = facts.get((st, _job_id(db, st, run_id)), {})
        export = facts.get((st, subject), {}) if lab.get("format") not in (None, "none") else {}
        level = mine.get("bits_per_weight")
        if level is None:  # a store written before the facts: from the artifact, while it is there
            level = _compression_bits(db, st, subject, lab, _value({"metrics": metrics}, "bits_per_weight"))
        out.append({"study": st, "labels": lab, "run_id": run_id, "runtime": run[1], "threads": run[2],
                    "compression_bits": level, "level": mine.get("level"), "export": export, "facts": mine,
                    "family": family(lab) if st is not None else None,
                    "target": run[3], "emulated": bool(run[4]), "settings": json.loads(run[5]), "metrics": metrics,
                    "name": " · ".join(str(x) for x in (shown_model(lab.get("model")), lab.get("method"),
                                                         lab.get("export"), lab.get("target"))
                                       if x not in (None, "", "none"))})
    return out


def _job_facts(db, study) -> dict:
    """job id -> facts (levels.py) of a study's finished jobs; {} for a store older than them."""
    try:
        rows = db.execute("SELECT job_id, facts FROM study_jobs WHERE study = ? AND status = 'done' AND facts IS NOT NULL",
                          (study,)).fetchall()
    except sqlite3.OperationalError:  # a store opened read-only before the facts column
        return {}
    return {r[0]: json.loads(r[1]) for r in rows}


def _job_id(db, study, run_id):
    row = db.execute("SELECT job_id FROM study_jobs WHERE study = ? AND run_id = ?", (study, run_id)).fetchone()
    return row[0] if row else None


def _compression_bits(db, study, subject, labels, file_bits):
    """Bits per weight as the compression level of what was evaluated: an export's file; a
    quantized artifact's codes and scales (its manifest; the artifact file itself holds fp32);
    a pruned one's 16 x density (the fp16 values kept, sparse indices not counted); the base 16."""
    if labels.get("format") not in (None, "none"):
        return file_bits
    if labels.get("method_name") in (None, "none", "-"):
        if labels.get("method_name") != "none":
            return file_bits
        from .levels import source_level  # what the base is stored as (a GGUF base: its file's level)

        return source_level(str(labels.get("model"))).get("bits_per_weight", 16.0)
    row = db.execute("SELECT output FROM study_jobs WHERE study = ? AND job_id = ?", (study, subject)).fetchone()
    try:
        summary = read_manifest(row[0])["summary"]
    except (TypeError, OSError, ValueError, KeyError):
        return None  # the artifact is gone: no level to plot it at
    if summary.get("bits_per_weight"):
        return float(summary["bits_per_weight"])
    return 16.0 * (1.0 - float(summary.get("sparsity") or 0.0))


def _value(row, metric, subset=None):
    vals = row["metrics"].get(metric, {})
    if subset is None:
        return next(iter(vals.values()), None) if vals else None
    return vals.get(subset)


def _subsets(rows, metric) -> list[str]:
    seen: list[str] = []
    for r in rows:
        for s in r["metrics"].get(metric, {}):
            if s not in seen:
                seen.append(s)
    return seen


def tables(rows: list[dict], budgets_mb=None, min_tps=None) -> list[dict]:
    """[{title, columns, rows}] — the study's tables."""
    out = [t for t in (level_table(rows),) if t]
    langs = _subsets(rows, "perplexity")
    if langs:
        out.append({"title": "Perplexity per language (token perplexity; lower is better)",
                    "columns": ["evaluation", *langs],
                    "rows": [[r["name"], *[_fmt(_value(r, "perplexity", s), "{:.2f}") for s in langs]] for r in rows]})
        out.append({"title": "Bits per UTF-8 byte per language (comparable across tokenizers)",
                    "columns": ["evaluation", *langs],
                    "rows": [[r["name"], *[_fmt(_value(r, "bits_per_byte", s), "{:.3f}") for s in langs]] for r in rows]})
    tasks = _subsets(rows, "acc")
    if tasks:
        out.append({"title": "Zero-shot task accuracy (acc_norm where the task has it, else acc)",
                    "columns": ["evaluation", *tasks, "mean"],
                    "rows": [[r["name"], *[_fmt(_task_acc(r, t), "{:.3f}") for t in tasks],
                              _fmt(_mean([_task_acc(r, t) for t in tasks]), "{:.3f}")] for r in rows]})
    fid = [f for f in FIDELITY if any(r["metrics"].get(f[0]) for r in rows)]
    if fid:
        out.append({"title": "Fidelity to the base model", "columns": ["evaluation", *[f[1] for f in fid]],
                    "rows": [[r["name"], *[_fmt(_mean(list(r["metrics"].get(k, {}).values())), f) for k, _, f in fid]]
                             for r in rows]})
    sysm = [m for m in SYSTEM if any(r["metrics"].get(m[0]) for r in rows)]
    if sysm:
        out.append({"title": "Memory and latency per target", "columns": ["evaluation", "target", *[m[1] for m in sysm]],
                    "rows": [[r["name"], r["target"] + (" (emulated)" if r["emulated"] else ""),
                              *[_fmtf(_value(r, k), f) for k, _, f in sysm]] for r in rows]})
    out += best_under(rows, budgets_mb, min_tps)
    out += [t for t in (snr_table(rows), projection_table(rows)) if t]
    return out


def _task_acc(row, task):
    v = _value(row, "acc_norm", task)
    return v if v is not None else _value(row, "acc", task)


def _mean(values):
    v = [x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(v) / len(v) if v else None


def shown_model(model):
    """A model as a report (a file for others) names it: an embedded name or a Hub id as it is, a local
    path as typed when relative, else by its name (``paths.given_path``): never an absolute local path."""
    if model is None:
        return None
    text = str(model)
    if text.startswith("~") or Path(text).is_absolute():
        from ..paths import given_path

        return given_path(text)
    return text


def _source_kind(model: str) -> str | None:
    """What kind of model source a study's (or run's) model is (``slmedge.models.source.resolve``);
    None when it names nothing here any more."""
    from ..models.source import resolve

    try:
        return resolve(model).kind
    except SlmedgeError:
        return None


def _fmt(v, f):
    return "–" if v is None else f.format(v)


def _fmtf(v, f):
    return "–" if v is None else f(v)


def caveats(rows: list[dict]) -> list[str]:
    out = []
    models = {r["labels"].get("model") for r in rows}
    if any(m in (None, "smollm2-135m", "smollm2") for m in models):
        out.append("The embedded SmolLM2-135M baseline is a Q4_1 GGUF dequantized to fp32: its own quantization noise "
                   "is part of the 'full-precision' base, and a method that re-finds that grid is favoured.")
    if "gemma3-270m" in models:
        out.append("The embedded Gemma 3 270M baseline is a Q4_K_M GGUF dequantized to fp32, with the same caveat.")
    # A study's model is the base its grid starts from (a plain run's is what was evaluated, as is).
    bases = {r["labels"].get("model") for r in rows if r.get("study") is not None} - {None}
    gguf_bases = sorted(shown_model(m) for m in bases if _source_kind(str(m)) == "gguf")
    if gguf_bases:
        out.append(f"The base model{'s' if len(gguf_bases) > 1 else ''} {', '.join(gguf_bases)} "
                   f"{'are GGUF files' if len(gguf_bases) > 1 else 'is a GGUF file'} dequantized to fp32: "
                   "its own quantization noise is part of the 'full-precision' base.")
    if any(r["emulated"] for r in rows):
        out.append("Rows marked emulated ran under qemu: their timings are not device latency (the roofline there is a "
                   "projection).")
    out.extend(_same_as_caveats(rows))
    limits = {r["settings"].get("limit") for r in rows} - {None}
    if limits:
        out.append(f"Task accuracy is on the first {', '.join(map(str, sorted(limits)))} items per task: standard errors "
                   "of a few points; small differences are not significant.")
    windows = {(r["settings"].get("ppl_windows"), r["settings"].get("seqlen")) for r in rows if "perplexity" in r["metrics"]}
    if windows:
        out.append("Perplexity over " + ", ".join(f"{w or 'all'} window(s) of {s} tokens" for w, s in sorted(windows, key=str))
                   + " per language: a sample, not the whole corpus.")
    out.append("A single metric misleads: read fidelity, multilingual perplexity and task accuracy together.")
    return out


def _same_as_caveats(rows: list[dict]) -> list[str]:
    """Per target that takes another's numbers (same_as): how many files did, and what the probes saw."""
    out = []
    by_target: dict = defaultdict(list)
    for r in rows:
        probe = (r.get("facts") or {}).get("same_as")
        if probe:
            by_target[(r["target"], probe["target"])].append(probe)
    for (target, other), probes in sorted(by_target.items()):
        same = [p for p in probes if p.get("same")]
        worst = max((p["max_abs_dlogp"] for p in same), default=None)
        line = (f"On {target}, {len(same)} of {len(probes)} files' perplexity, fidelity and task numbers are {other}'s: "
                f"a probe of {probes[0]['tokens']} tokens scored each of them within "
                f"{probes[0]['tolerance']:g} nats of {other} per token")
        line += f" (largest difference {worst:.2g} nats)." if worst is not None else "."
        if len(same) < len(probes):
            line += f" The other {len(probes) - len(same)} differed more and were measured on {target} itself."
        out.append(line)
    return out


# --- plots --------------------------------------------------------------------------------------


def _fig_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def plots(rows: list[dict]) -> list[tuple[str, bytes]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    langs = _subsets(rows, "perplexity")
    pts = [r for r in rows if r.get("compression_bits") is not None]
    if langs and pts:
        # Colour: the method's family; marker: the language. Both legends sit outside the axes.
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        families = list(dict.fromkeys(r.get("family") for r in pts))
        for lang, marker in zip(langs, _MARKERS * (len(langs) // len(_MARKERS) + 1)):
            for fam in families:
                xy = [(r["compression_bits"], _value(r, "perplexity", lang)) for r in pts
                      if r.get("family") == fam and _value(r, "perplexity", lang) is not None]
                if xy:
                    ax.scatter([p[0] for p in xy], [p[1] for p in xy], marker=marker, color=_colour(fam),
                               alpha=0.8, s=28)
        ax.set_xlabel("bits per weight (quantized: codes + scales; pruned: 16 x density; exports: file)")
        ax.set_ylabel("perplexity (log scale)")
        _log_y(ax, [_value(r, "perplexity", lang) for r in pts for lang in langs])
        ax.set_title("Perplexity against compression level: colour = family, marker = language", fontsize=9)
        from matplotlib.lines import Line2D

        fam_handles = [Line2D([], [], linestyle="", marker="o", color=_colour(f), label=_family_label(f))
                       for f in families]
        lang_handles = [Line2D([], [], linestyle="", marker=m, color="dimgray", label=lang)
                        for lang, m in zip(langs, _MARKERS * (len(langs) // len(_MARKERS) + 1))]
        first = ax.legend(handles=fam_handles, title="family", fontsize=7, title_fontsize=7,
                          loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        ax.add_artist(first)
        ax.legend(handles=lang_handles, title="language", fontsize=7, title_fontsize=7, ncol=1 + len(langs) // 9,
                  loc="lower left", bbox_to_anchor=(1.01, 0.0), borderaxespad=0)
        out.append(("Perplexity against compression level, by method family and language", _fig_png(fig)))
    tasks = _subsets(rows, "acc")
    if tasks:
        fig, ax = plt.subplots(figsize=(max(6, len(tasks) * 0.9), 4))
        width = 0.8 / max(len(rows), 1)
        for i, r in enumerate(rows):
            ax.bar([t + i * width for t in range(len(tasks))], [_task_acc(r, t) or 0 for t in tasks], width,
                   label=r["name"], color=_row_colour(i % 20))
        ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tasks))], tasks, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("accuracy")
        ax.set_title("Accuracy per task")
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                  ncol=1 + len(rows) // 24)
        out.append(("Accuracy per task", _fig_png(fig)))
    out += pareto_plots(rows)
    return out


def _row_colour(i: int):
    """One colour per row of the task chart (20 distinct ones, then again)."""
    import matplotlib

    return matplotlib.colormaps["tab20"](i)


# One marker per language (cycled when there are more languages than markers).
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h", "p", "d", "8"]


def _log_y(ax, values) -> None:
    """A log-scale y axis whose ticks read as plain numbers (20, 30, not 2 x 10^1); within a span
    of less than 20x the in-between ticks are labelled too."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    v = [x for x in values if x is not None and x > 0]
    ax.yaxis.set_minor_formatter(plain if v and max(v) / min(v) < 20 else NullFormatter())
    ax.tick_params(axis="y", which="minor", labelsize=7)


def _family_label(fam) -> str:
    return {"base": "base", "quantize": "quantized", "prune": "pruned", "both": "pruned + quantized"}.get(
        fam, "evaluation")


def _colour(fam) -> str:
    return COLOURS.get(fam, COLOURS[None])


# --- the practitioner's view: quality against size and speed, per target ---------------------------

def _gmean(values):
    v = [x for x in values if x is not None and x > 0 and not math.isinf(x)]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else None


# Each quality measure: key, label, lower is better, its value for a row.
QUALITY = (
    ("kl", "mean KL to the base", True, lambda r: _mean(list(r["metrics"].get("kl_mean", {}).values()))),
    ("ppl", "perplexity (geometric mean over the languages)", True,
     lambda r: _gmean(r["metrics"].get("perplexity", {}).values())),
    ("acc", "mean task accuracy", False,
     lambda r: _mean([_task_acc(r, t) for t in r["metrics"].get("acc", {})])),
)
COLOURS = {"base": "black", "quantize": "tab:blue", "prune": "tab:orange", "both": "tab:green", None: "tab:gray"}


def file_size(row):
    """Bytes of the file a row evaluated: measured with the memory metric, else the export's own count."""
    v = _value(row, "file_bytes")
    return v if v is not None else (row.get("export") or {}).get("bytes")


def _deployed(rows):
    """The rows that are files a device runs (exports); a study of torch rows alone: all of them."""
    files = [r for r in rows if r["labels"].get("format") not in (None, "none")]
    return files or rows


def _axes(rows, target):
    """(key, label, lower is better, value of a row, the rows it applies to) for the x axes on a target."""
    mine = [r for r in _deployed(rows) if r["target"] == target]
    return [("file_bytes", "file size (MB)", True, lambda r: (file_size(r) or 0) / 1e6 or None, mine),
            ("decode_tps", "decode tokens/s", False, lambda r: _value(r, "decode_tps"),
             [r for r in mine if not r["emulated"]])]


def _point_name(r) -> str:
    """A row's short name in a plot or a winner's cell: its method and export in a study; what was
    evaluated and in which runtime for a plain evaluation (a store without studies)."""
    if "method" not in r["labels"]:
        return f"{r['labels'].get('model')} ({r['runtime']})"
    fmt = r["labels"].get("format")
    name = str(r["labels"]["method"])
    if fmt not in (None, "none"):
        name += f" ({r['labels'].get('export') or fmt})"
    if (r.get("export") or {}).get("codes") == "requantized":
        name += " requantized"
    return name


def pareto_plots(rows) -> list[tuple[str, bytes]]:
    """Per target, each quality measure against file size and against decode speed, coloured by
    family, with the Pareto front."""
    import matplotlib.pyplot as plt

    out = []
    for target in dict.fromkeys(r["target"] for r in rows):
        emulated = any(r["emulated"] for r in rows if r["target"] == target)
        for xkey, xlabel, x_low, xval, subset in _axes(rows, target):
            for qkey, qlabel, q_low, qval in QUALITY:
                data = [(r, xval(r), qval(r)) for r in subset if xval(r) and qval(r) is not None]
                if not data:
                    continue
                fig, ax = plt.subplots(figsize=(7.5, 4))
                for fam in dict.fromkeys(r.get("family") for r, _, _ in data):
                    pts = [(x, y) for r, x, y in data if r.get("family") == fam]
                    ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=_colour(fam),
                               label=_family_label(fam))
                xs = [x for _, x, _ in data]
                for r, x, y in data:  # a name to the left of points in the right third: it stays inside
                    right = len(data) > 1 and x > min(xs) + 2 * (max(xs) - min(xs)) / 3
                    ax.annotate(_point_name(r), (x, y), fontsize=6, xytext=(-4 if right else 4, 3),
                                textcoords="offset points", ha="right" if right else "left")
                # A front needs points to trade off: none from one point; one point that beats all the
                # others is ringed, not drawn as a line.
                front = _pareto([(x, y) for _, x, y in data], x_low, q_low) if len(data) > 1 else []
                if len(front) > 1:
                    ax.plot([p[0] for p in front], [p[1] for p in front], "r--", linewidth=1, label="Pareto front")
                elif front:
                    ax.scatter([front[0][0]], [front[0][1]], s=160, facecolors="none", edgecolors="red",
                               label="beats every other point")
                ax.set_xlabel(xlabel)
                ax.set_ylabel(textwrap.fill(qlabel + (" (lower is better)" if q_low else " (higher is better)"), 36),
                              fontsize=9)
                ax.margins(x=0.08, y=0.1)
                if qkey == "ppl":
                    _log_y(ax, [y for _, _, y in data])
                ax.set_title(f"{qlabel} against {xlabel.split(' (')[0]} — {target}" + (" (EMULATED)" if emulated else ""),
                             fontsize=9)
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
                out.append((f"Pareto front on {target}: {qlabel} against {xlabel}", _fig_png(fig)))
    return out


def _pareto(points, x_low_better: bool, y_low_better: bool = True):
    """Points no other point beats on both axes."""
    def beats(a, b):  # a at least as good as b on both axes, and not the same point
        bx = a[0] <= b[0] if x_low_better else a[0] >= b[0]
        by = a[1] <= b[1] if y_low_better else a[1] >= b[1]
        return bx and by and a != b

    return sorted({p for p in points if not any(beats(q, p) for q in points)})


def _sig(x: float, up: bool) -> float:
    """``x`` to two significant digits, rounded up (a size budget the file fits in) or down (a
    speed floor it reaches)."""
    if x <= 0:
        return x
    step = 10 ** (math.floor(math.log10(x)) - 1)
    return round((math.ceil(x / step - 1e-9) if up else math.floor(x / step + 1e-9)) * step, 12)


def best_under(rows, budgets_mb=None, min_tps=None) -> list[dict]:
    """Per target, the best row by each quality measure under each size budget and above each
    speed: tables. Budgets default to a quarter, half and all of the largest file; speeds to a
    quarter, half and three quarters of the fastest decode."""
    out = []
    for target in dict.fromkeys(r["target"] for r in rows):
        for xkey, xlabel, x_low, xval, subset in _axes(rows, target):
            vals = [xval(r) for r in subset if xval(r)]
            if not vals:
                continue
            given = budgets_mb if x_low else min_tps
            ordered = sorted(vals)
            limits = list(given) if given else sorted({_sig(v, x_low) for v in
                                                       (ordered[0], ordered[len(ordered) // 2], ordered[-1])})
            head = "under (MB)" if x_low else "above (tok/s)"
            table = []
            for lim in limits:
                ok = [r for r in subset if xval(r) and (xval(r) <= lim if x_low else xval(r) >= lim)]
                cells = [f"{lim:g}", str(len(ok))]
                for _, _, q_low, qval in QUALITY:
                    scored = [(qval(r), r) for r in ok if qval(r) is not None]
                    if not scored:
                        cells.append("–")
                        continue
                    v, r = (min if q_low else max)(scored, key=lambda t: t[0])
                    cells.append(f"{_point_name(r)}: {v:.4g}")
                table.append(cells)
            emu = " (emulated: exactness only)" if any(r["emulated"] for r in subset) else ""
            out.append({"title": f"Best under a {'size budget' if x_low else 'speed floor'} on {target}{emu}",
                        "columns": [head, "files", *[q[1] for q in QUALITY]], "rows": table})
    return out


# The seed paper's activation SNR (Table 7: dB, other models than these), by (method, bits, sparsity).
PAPER_SNR = {("gptq", 8, None): 43.2, ("awq", 8, None): 48.9, ("sparsegpt", None, "0.5"): 11.9,
             ("wanda", None, "0.5"): 11.7}


def snr_table(rows) -> dict | None:
    """Table 7's view: activation SNR (dB) per method, beside the paper's published figure."""
    got = [r for r in rows if _value(r, "hidden_snr_db") is not None and r.get("family") not in (None, "base")]
    if not got:
        return None
    table = []
    for r in got:
        lab = r["labels"]
        key = (lab.get("method_name"), lab.get("bits"), str(lab["sparsity"]) if lab.get("sparsity") else None)
        paper = PAPER_SNR.get(key)
        table.append([r["name"], f"{_value(r, 'hidden_snr_db'):.1f}", "–" if paper is None else f"{paper:.1f}"])
    return {"title": "Activation SNR per method (Table 7's view; the paper's figures are the paper's, on other models)",
            "columns": ["evaluation", "SNR dB (here)", "SNR dB (paper, other models)"], "rows": table}


def projection_table(rows) -> dict | None:
    """Each exported file's roofline bounds on the device profiles: projections, not measurements."""
    seen, table, names = set(), [], []
    for r in rows:
        proj = (r.get("facts") or {}).get("projections") or {}
        if not proj:
            continue
        names = names or list(proj)
        key = (r["labels"].get("model"), r["labels"].get("method"), r["labels"].get("export"))
        if key in seen:
            continue
        seen.add(key)
        size = file_size(r)
        table.append([" · ".join(str(x) for x in (shown_model(key[0]), *key[1:]) if x),
                      _fmt(size / 1e6 if size else None, "{:.1f}"),
                      _fmt(r.get("compression_bits"), "{:.2f}"),
                      *[_fmt((proj.get(n) or {}).get("decode_bound_tps"), "{:.1f}") for n in names]])
    if not table:
        return None
    return {"title": "PROJECTED decode bound on device profiles (roofline from each file's bytes: projections, "
                     "not measurements)",
            "columns": ["file", "size MB", "bits/w", *[f"{n} (projected tok/s)" for n in names]], "rows": table}


def level_table(rows) -> dict | None:
    """What each row evaluated: family, compression level (the base's real one), codes kept."""
    if not any(r.get("family") for r in rows):
        return None
    def stored(r):  # a base: what it is stored as (the embedded ones are GGUF files, dequantized)
        src = (r.get("facts") or {}).get("source") or {}
        return f"{src['level']} ({src['bits_per_weight']:.2f} bits/w)" if src.get("level") else "–"

    return {"title": "What was evaluated: family and compression level",
            "columns": ["evaluation", "family", "bits/w", "level", "base stored as", "file MB", "codes"],
            "rows": [[r["name"], r.get("family") or "–", _fmt(r.get("compression_bits"), "{:.2f}"),
                      r.get("level") or "–", stored(r), _fmt(file_size(r) / 1e6 if file_size(r) else None, "{:.1f}"),
                      (r.get("export") or {}).get("codes") or "–"] for r in rows]}



# --- findings: the seed study's claims checked against the rows ------------------------------------

# metric, label, lower is better, how the subsets (languages, tasks) are combined
FINDING_METRICS = (("kl_mean", "fidelity (mean KL to the base)", True, _mean),
                   ("top1_agreement", "fidelity (top-1 agreement)", False, _mean),
                   ("perplexity", "multilingual perplexity (geometric mean over corpora)", True, _gmean),
                   ("acc", "task accuracy (mean over tasks)", False, _mean))


def _score(row, metric, how):
    return how(list(row["metrics"].get(metric, {}).values()))


def findings(rows: list[dict]) -> list[str]:
    """The seed study's claims against these rows (torch artifacts and exports alike), then what
    size and speed say: per target, each family's files, and what sparsity gained in each format."""
    def agg(group, metric, how):
        return _mean([_score(r, metric, how) for r in group])

    def fam(r):
        return r.get("family") or family(r["labels"])

    out = []
    quant = [r for r in rows if fam(r) == "quantize"]
    prune = [r for r in rows if fam(r) == "prune"]
    if quant and prune:
        for metric, label, lower, how in FINDING_METRICS:
            q, p = agg(quant, metric, how), agg(prune, metric, how)
            if q is None or p is None:
                continue
            holds = q < p if lower else q > p
            out.append(f"quantization ahead of pruning on {label}: quantized {q:.4g} vs pruned {p:.4g} -> "
                       f"{'holds' if holds else 'does NOT hold'}")
        q4 = [r for r in quant if r["labels"].get("bits") == 4]
        p50 = [r for r in prune if str(r["labels"].get("sparsity")) in ("0.5", "2:4")]
        if q4 and p50:
            parts = []
            for metric, label, lower, how in FINDING_METRICS:
                q, p = agg(q4, metric, how), agg(p50, metric, how)
                if q is not None and p is not None:
                    parts.append(f"{metric} {q:.4g} vs {p:.4g} ({'quant' if (q < p) == lower else 'prune'} ahead)")
            if parts:
                out.append("INT4 vs 50% / 2:4 sparsity: " + "; ".join(parts))
    for sparsity in ("0.5", "0.75", "2:4"):  # Wanda against SparseGPT, setting by setting
        w = [r for r in rows if r["labels"].get("method_name") == "wanda" and str(r["labels"].get("sparsity")) == sparsity]
        g = [r for r in rows if r["labels"].get("method_name") == "sparsegpt" and str(r["labels"].get("sparsity")) == sparsity
             and not r["labels"].get("bits")]
        if w and g:
            parts, wins = [], 0
            for metric, label, lower, how in FINDING_METRICS:
                a, b = agg(w, metric, how), agg(g, metric, how)
                if a is not None and b is not None:
                    wins += (a < b) == lower
                    parts.append(f"{metric} {a:.4g} vs {b:.4g}")
            out.append(f"Wanda vs SparseGPT at sparsity {sparsity}: " + "; ".join(parts)
                       + f" -> Wanda ahead on {wins} of {len(parts)}")
    methods = sorted({r["labels"].get("method") for r in rows if fam(r) != "base"} - {None})
    if len(methods) > 2:  # a single metric misleads: the methods ranked by each metric
        ranks = {}
        for metric, label, lower, how in FINDING_METRICS:
            vals = {m: agg([r for r in rows if r["labels"].get("method") == m], metric, how) for m in methods}
            if all(v is not None for v in vals.values()):
                ranks[metric] = sorted(methods, key=lambda m: vals[m] if lower else -vals[m])
        for metric, order in ranks.items():
            out.append(f"ranked by {metric}: " + " > ".join(order))
        if len({tuple(o) for o in ranks.values()}) > 1:
            out.append("the metrics rank the methods differently (a single metric misleads)")
    out += _size_speed_findings(rows, fam)
    return out


def _size_speed_findings(rows, fam) -> list[str]:
    out = []
    files = [r for r in rows if r["labels"].get("format") not in (None, "none")]
    for target in dict.fromkeys(r["target"] for r in files):
        mine = [r for r in files if r["target"] == target]
        parts = []
        for f in ("base", "quantize", "prune", "both"):
            group = [r for r in mine if fam(r) == f]
            sizes = [file_size(r) for r in group if file_size(r)]
            speeds = [_value(r, "decode_tps") for r in group if _value(r, "decode_tps") and not r["emulated"]]
            if sizes:
                parts.append(f"{f} {min(sizes) / 1e6:.3g}-{max(sizes) / 1e6:.3g} MB"
                             + (f", {min(speeds):.3g}-{max(speeds):.3g} decode tok/s" if speeds else ""))
        if parts:
            out.append(f"files on {target}: " + "; ".join(parts))
        # What sparsity gains in each export: a pruned file against the base in the same export.
        for label in dict.fromkeys(r["labels"].get("export") for r in mine):
            base = [r for r in mine if fam(r) == "base" and r["labels"].get("export") == label
                    and r["labels"].get("model") is not None]
            pruned = [r for r in mine if fam(r) == "prune" and r["labels"].get("export") == label]
            for b in base:
                same = [r for r in pruned if r["labels"].get("model") == b["labels"].get("model")]
                if not same or not file_size(b):
                    continue
                size = _mean([file_size(r) / file_size(b) for r in same if file_size(r)])
                bd = _value(b, "decode_tps")
                speed = _mean([_value(r, "decode_tps") / bd for r in same if _value(r, "decode_tps")]) \
                    if bd and not b["emulated"] else None
                gains = (size is not None and size < 0.95) or (speed is not None and speed > 1.05)
                out.append(f"sparsity in {label} on {target}: pruned files {size:.2f}x the base's size"
                           + (f", {speed:.2f}x its decode speed" if speed is not None else "")
                           + (" -> the runtime gains nothing from sparsity" if not gains else ""))
    return out


# --- output -------------------------------------------------------------------------------------

_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th:first-child,td:first-child{text-align:left}th{background:#f3f3f3}img{max-width:100%;margin:1em 0}
.caveat{background:#fff8e1;border-left:4px solid #f0b400;padding:.5em 1em}"""


def _marker() -> str:
    return f"<!-- {MARKER} {__version__} -->"


def _notes(left: int) -> list[str]:
    if not left:
        return []
    return [f"{left} evaluation{'s' if left > 1 else ''} that failed or did not finish "
            f"{'are' if left > 1 else 'is'} left out of this report."]


def render_html(rows, title: str, left: int = 0, **view) -> str:
    parts = [f"{_HTML_START}{_marker()}<html><head><meta charset='utf-8'>"
             f"<meta name='generator' content='{MARKER} {html.escape(__version__)}'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>",
             f"<p>{len(rows)} evaluations.</p>" + "".join(f"<p>{html.escape(n)}</p>" for n in _notes(left))
             + "<h2>Caveats</h2><div class='caveat'><ul>"
             + "".join(f"<li>{html.escape(c)}</li>" for c in caveats(rows)) + "</ul></div>"]
    found = findings(rows)
    if found:
        parts.append("<h2>Findings</h2><ul>" + "".join(f"<li>{html.escape(f)}</li>" for f in found) + "</ul>")
    for t in tables(rows, **view):
        parts.append(f"<h2>{html.escape(t['title'])}</h2><table><tr>"
                     + "".join(f"<th>{html.escape(c)}</th>" for c in t["columns"]) + "</tr>"
                     + "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>"
                               for row in t["rows"]) + "</table>")
    for caption, png in plots(rows):
        parts.append(f"<h2>{html.escape(caption)}</h2><img class='plot' alt='{html.escape(caption)}' "
                     f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>")
    # Marks how many plots the browser decoded (the report's test reads it back).
    parts.append("<script>window.addEventListener('load',function(){var i=[].slice.call(document.images);"
                 "document.body.setAttribute('data-plots-rendered',i.filter(function(x){return x.complete&&"
                 "x.naturalWidth>0}).length+'/'+i.length);});</script></body></html>")
    return "".join(parts)


def _md_parts(rows, title: str, left: int = 0, **view) -> list[str]:
    parts = [_marker(), f"# {title}\n", f"{len(rows)} evaluations.\n", *[f"{n}\n" for n in _notes(left)],
             "## Caveats\n", *[f"- {c}" for c in caveats(rows)], ""]
    found = findings(rows)
    if found:
        parts += ["## Findings\n", *[f"- {f}" for f in found], ""]
    for t in tables(rows, **view):
        parts += [f"## {t['title']}\n", "| " + " | ".join(t["columns"]) + " |",
                  "|" + "|".join("---" for _ in t["columns"]) + "|",
                  *["| " + " | ".join(str(v) for v in row) + " |" for row in t["rows"]], ""]
    return parts


def _figdir(out_path: Path) -> Path:
    return out_path.with_name(out_path.stem + "_files")


# The Markdown report's plot folder lists what it holds here, so --overwrite replaces only it.
FIG_MANIFEST = "slmedge-report.json"


def render_md(rows, title: str, out_path: Path, left: int = 0, overwrite: bool = True, **view) -> str:
    """The Markdown text; its plots are written (atomically, as one folder) beside ``out_path``."""
    from ..fsutil import atomic_directory

    parts = _md_parts(rows, title, left, **view)
    figs = plots(rows)
    if figs:
        figdir = _figdir(Path(out_path))
        _check_figdir(figdir, overwrite)
        names = [f"plot{i + 1}.png" for i in range(len(figs))]
        try:
            with atomic_directory(figdir, overwrite=overwrite, manifest=FIG_MANIFEST) as tmp:
                for name, (_, png) in zip(names, figs):
                    (tmp / name).write_bytes(png)
                (tmp / FIG_MANIFEST).write_text(json.dumps({"files": names, "report": Path(out_path).name,
                                                            "version": __version__}) + "\n", encoding="utf-8")
        except (OSError, SlmedgeError) as exc:
            raise _write_error(figdir, exc, sum(len(png) for _, png in figs)) from exc
        for name, (caption, _) in zip(names, figs):
            parts += [f"## {caption}\n", f"![{caption}]({figdir.name}/{name})", ""]
    return "\n".join(parts)


def is_report(path: Path) -> bool:
    """Whether ``path`` is a report slmedge wrote (it starts with the marker)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(256).decode("utf-8", "replace")
    except OSError:
        return False
    mark = f"<!-- {MARKER} "
    return head.startswith(mark) or head.lower().startswith(_HTML_START + mark)


def check_output(out: Path, overwrite: bool, inputs=()) -> None:
    """Refuse, before any work, a report output that may not be written: an input of the command
    (the store), a folder, an existing file without ``overwrite``, and — even with it — a file
    slmedge did not write as a report."""
    from ..fsutil import refuse_replacing

    out = Path(out)
    if out.is_dir():
        raise OutputExistsError(f"output {out} is a directory; give a file name for the report")
    refuse_replacing(out, overwrite, None, inputs)
    if out.exists() or out.is_symlink():
        # --overwrite is advised only where it would then work: never over a file that is not a report.
        if out.is_symlink() or not out.is_file() or not is_report(out):
            raise OutputExistsError(f"output {out} is not a report slmedge wrote; --overwrite only replaces "
                                    "slmedge's own reports: choose another output")
        if not overwrite:
            raise OutputExistsError(f"output {out} exists; pass --overwrite to replace it")


def _check_figdir(figdir: Path, overwrite: bool) -> None:
    from ..fsutil import refuse_replacing

    if figdir.exists() and not figdir.is_dir():
        raise OutputExistsError(f"{figdir} (where the report's plots go) exists and is not a directory; "
                                "choose another output")
    try:
        refuse_replacing(figdir, overwrite, FIG_MANIFEST)
    except OutputExistsError as exc:
        raise OutputExistsError(f"{exc} (the report's plots go there)") from None
    if figdir.is_dir() and any(figdir.iterdir()) and not (figdir / FIG_MANIFEST).is_file():
        raise OutputExistsError(f"{figdir} (where the report's plots go) holds files slmedge did not write; "
                                "choose another output")


def _write_error(path: Path, exc: OSError, needed: int | None = None) -> SlmedgeError:
    from ..errors import DiskFullError
    from ..fsutil import disk_full, no_space

    if isinstance(exc, DiskFullError):
        return exc
    if disk_full(exc):
        return no_space(path, needed)
    return SlmedgeError(f"cannot write {path}: {exc.strerror or type(exc).__name__}")


def write_report(store, out: Path, fmt: str = "html", study: str | None = None, overwrite: bool = False,
                 budgets_mb=None, min_tps=None) -> dict:
    """Write the report to ``out`` (atomically). An existing ``out`` is replaced only with
    ``overwrite``, and only when it is a report slmedge wrote; the same holds for a Markdown
    report's plot folder."""
    from ..fsutil import write_text_atomic

    out = Path(out)
    rows = load_rows(store, study)
    if not rows:
        raise ResultsStoreError(f"{store.path} holds no finished evaluations to report")
    check_output(out, overwrite, inputs=(store.path,))
    if fmt == "md":
        _check_figdir(_figdir(out), overwrite)
    left = left_out(store, study)
    title = f"slmedge report — {study or 'all evaluations'}"
    view = {"budgets_mb": budgets_mb, "min_tps": min_tps}
    text = render_html(rows, title, left, **view) if fmt == "html" else render_md(rows, title, out, left, overwrite, **view)
    check_output(out, overwrite, inputs=(store.path,))  # again: something may have appeared meanwhile
    try:
        write_text_atomic(out, text)
    except (OSError, SlmedgeError) as exc:  # named by the output, never by the temporary file beside it
        raise _write_error(out, exc, len(text.encode("utf-8"))) from exc
    return {"rows": len(rows), "path": str(out), "left_out": left}

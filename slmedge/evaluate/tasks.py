"""Zero-shot log-likelihood tasks with lm-evaluation-harness's semantics, on any runtime.

Two schemas (the LLM Foundry in-context-learning formats of the shipped task files):

- multiple_choice ``{"query", "choices", "gold"}``: each choice is scored as the continuation of
  the query, joined by one space. ``acc`` = argmax of the summed log-likelihood; ``acc_norm`` =
  argmax of log-likelihood / the choice's length in characters (lm-eval's ``acc_norm``).
- schema ``{"context_options", "continuation", "gold"}`` (winogrande): the same continuation
  after each context option (partial scoring); ``acc`` only (acc_norm is the same).

Tokenization follows lm-eval's ``_encode_pair``: trailing spaces of the context move to the
continuation; the continuation's tokens are those of (context + continuation) after the
context's tokens; an empty context becomes the end-of-text token; a tokenizer that adds BOS by
default gets it in front of the context, as lm-eval's ``hf`` model does. Standard errors are lm-eval's
(sample standard deviation / sqrt(n)).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError, UnknownDataError
from ..fsutil import iter_jsonl
from ..data.files import data_files

ENGLISH_TASKS = ("arc_easy", "arc_challenge", "boolq", "hellaswag", "openbookqa", "piqa", "winogrande", "copa")
XCOPA_LANGS = ("et", "ht", "id", "it", "qu", "sw", "ta", "th", "tr", "vi", "zh")


@dataclass
class Request:
    contexts: list[str]  # one per choice (multiple_choice: the same query repeated)
    continuations: list[str]
    gold: int
    norm_lengths: list[int] | None  # characters per choice for acc_norm (None: schema)


def task_names(data=None) -> list[str]:
    """The shipped tasks, then any other task file a ``--data-dir`` adds (``tasks/NAME.jsonl``)."""
    shipped = list(ENGLISH_TASKS) + [f"xcopa_{lang}" for lang in XCOPA_LANGS]
    files = data_files(data)
    extra = [n for n in files.names("tasks", ".jsonl") if n not in shipped]
    extra += [f"xcopa_{n}" for n in files.names("tasks/xcopa", ".jsonl") if f"xcopa_{n}" not in shipped]
    return shipped + extra


def task_label(name: str) -> str:
    """How a task is shown: a named task by its name, a user's file by its stem."""
    return Path(name).stem if name.endswith(".jsonl") else name


def task_file(name: str, data=None) -> Path:
    path = Path(name).expanduser()
    if path.suffix == ".jsonl" and path.is_file():
        return path
    if not name or "/" in name or name.startswith("."):
        f = None
    elif name.startswith("xcopa_"):
        f = data_files(data).find(f"tasks/xcopa/{name.split('_', 1)[1]}.jsonl")
    else:
        f = data_files(data).find(f"tasks/{name}.jsonl")
    if f is None:
        if path.exists() or "/" in name or path.suffix == ".jsonl":  # a file: a missing input
            what = "is not a file" if path.exists() else "does not exist"
            raise DataError(f"task file {name} {what}; give an existing .jsonl file or a task name")
        # a name: a bad setting
        raise UnknownDataError(f"unknown task '{name}'; choose from {', '.join(task_names(data))} or give a .jsonl file")
    return f


def load_task(name: str, data=None, limit: int | None = None) -> list[Request]:
    """Read a task file in either schema; ``limit`` keeps the first N items."""
    f = task_file(name, data)
    items = []
    for line_no, doc in iter_jsonl(f):
        items.append(_request(doc, f, line_no))
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise DataError(f"{f} holds no items")
    return items


def _request(doc: dict, f: Path, line_no: int) -> Request:
    try:
        gold = doc["gold"]
        if isinstance(gold, bool) or not isinstance(gold, int):
            raise DataError(f"{f}:{line_no}: 'gold' must be an integer index, got {gold!r}")
        if "choices" in doc:
            query, choices = str(doc["query"]), [str(c) for c in doc["choices"]]
            if not 0 <= gold < len(choices):
                raise DataError(f"{f}:{line_no}: gold {gold} is not one of {len(choices)} choices")
            return Request([query] * len(choices), [" " + c for c in choices], gold, [len(c) for c in choices])
        if "context_options" in doc:
            options, cont = [str(c) for c in doc["context_options"]], str(doc["continuation"])
            if not 0 <= gold < len(options):
                raise DataError(f"{f}:{line_no}: gold {gold} is not one of {len(options)} context options")
            return Request(options, [" " + cont] * len(options), gold, None)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, DataError):
            raise
        raise DataError(f"{f}:{line_no}: not a multiple_choice or schema item ({exc})") from exc
    raise DataError(f"{f}:{line_no}: needs 'query'/'choices'/'gold' (multiple_choice) or "
                    "'context_options'/'continuation'/'gold' (schema)")


def encode_pair(encoder, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's HFLM._encode_pair."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    if not context:
        prefix = encoder.eos_id if encoder.eos_id is not None else encoder.bos_id
        return [prefix], encoder.encode(continuation)
    whole = encoder.encode(context + continuation)
    ctx = encoder.encode(context)
    bos = [encoder.bos_id] if encoder.adds_bos else []  # as lm-eval's hf model encodes with the tokenizer's default
    return bos + ctx, whole[len(ctx):]


@dataclass
class ItemScore:
    loglikelihoods: list[float]
    pred: int
    pred_norm: int
    gold: int


def score_pairs(runtime, pairs: list[tuple[list[int], list[int]]], max_length: int = 2048) -> list[tuple]:
    """(log-probs, greedy) per (context ids, continuation ids) pair; continuations sharing a context
    are scored together, and over-long inputs keep their last ``max_length + 1`` tokens (lm-eval)."""
    results: list = [None] * len(pairs)
    groups: dict[tuple, list[int]] = {}
    for i, (ctx, _) in enumerate(pairs):
        groups.setdefault(tuple(ctx), []).append(i)
    batch = []
    for ctx, idx in groups.items():
        conts = [pairs[i][1] for i in idx]
        ctx_l = list(ctx)
        longest = len(ctx_l) + max(len(c) for c in conts)
        if longest > max_length + 1:
            ctx_l = ctx_l[longest - max_length - 1 :]
        batch.append((ctx_l, conts))
    for idx, scored in zip(groups.values(), runtime.score_groups(batch)):
        for i, s in zip(idx, scored):
            results[i] = s
    return results


def score_requests(runtime, encoder, reqs: list[Request], max_length: int = 2048) -> list[ItemScore]:
    pairs = [encode_pair(encoder, c, x) for req in reqs for c, x in zip(req.contexts, req.continuations)]
    lls_all = [float(lp.sum()) for lp, _ in score_pairs(runtime, pairs, max_length)]
    out, at = [], 0
    for req in reqs:
        lls = lls_all[at : at + len(req.contexts)]
        at += len(req.contexts)
        pred = int(np.argmax(lls))
        if req.norm_lengths is not None:
            pred_norm = int(np.argmax([ll / max(n, 1) for ll, n in zip(lls, req.norm_lengths)]))
        else:
            pred_norm = pred
        out.append(ItemScore(lls, pred, pred_norm, req.gold))
    return out


def mean_stderr(values) -> float:
    v = np.asarray(values, dtype=np.float64)
    return float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else 0.0


def summarize(scores: list[ItemScore], has_norm: bool) -> dict:
    acc = [float(s.pred == s.gold) for s in scores]
    out = {"acc": float(np.mean(acc)), "acc_stderr": mean_stderr(acc), "n": len(scores)}
    if has_norm:
        norm = [float(s.pred_norm == s.gold) for s in scores]
        out.update(acc_norm=float(np.mean(norm)), acc_norm_stderr=mean_stderr(norm))
    return out


def run_task(runtime, encoder, name: str, data=None, limit: int | None = None, max_length: int = 2048,
             progress=None, chunk: int = 32) -> tuple[dict, list[ItemScore]]:
    reqs = load_task(name, data, limit)
    scores = []
    # Items are scored in chunks, so runtimes that batch across contexts can, and progress moves.
    for start in range(0, len(reqs), chunk):
        scores.extend(score_requests(runtime, encoder, reqs[start : start + chunk], max_length))
        if progress:
            progress(name, len(scores), len(reqs))
    return summarize(scores, reqs[0].norm_lengths is not None), scores


# --- the same files as lm-evaluation-harness tasks ---------------------------------------------

_YAML = """task: slmedge_{name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
{fields}
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
{norm}"""
_MC_FIELDS = 'doc_to_text: "{{query}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{gold}}"\ntarget_delimiter: " "'
# schema items: lm-eval's partial scoring ("multiple input"): doc_to_text gives the gold index,
# the choices are the contexts, the target is the shared continuation.
_SCHEMA_FIELDS = ("doc_to_text: !function slmedge_schema.doc_to_text\n"
                  "doc_to_choice: !function slmedge_schema.doc_to_choice\n"
                  'doc_to_target: "{{continuation}}"\ntarget_delimiter: " "')
_NORM = "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"


def write_lm_eval_tasks(folder, names, data=None) -> list[str]:
    """Write lm-eval task YAMLs (``slmedge_<name>``) over the JSONL files slmedge reads, so that
    ``lm_eval --include_path folder --tasks slmedge_arc_easy`` scores exactly the same items."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "slmedge_schema.py").write_text(
        "def doc_to_text(doc):\n    return int(doc['gold'])\n\n\n"
        "def doc_to_choice(doc):\n    return list(doc['context_options'])\n", encoding="utf-8")
    out = []
    for name in names:
        f = task_file(name, data)
        with open(f, encoding="utf-8") as handle:
            first = json.loads(handle.readline())
        mc = "choices" in first
        key = Path(name).stem if Path(name).suffix == ".jsonl" else name
        (folder / f"slmedge_{key}.yaml").write_text(
            _YAML.format(name=key, path=f.resolve(), fields=_MC_FIELDS if mc else _SCHEMA_FIELDS,
                         norm=_NORM if mc else ""), encoding="utf-8")
        out.append(f"slmedge_{key}")
    return out

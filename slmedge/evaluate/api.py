"""`slmedge evaluate`: every metric on one runtime interface, results to JSON and the SQLite store."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .. import limits
from ..errors import ConfigError, DataError, DiskFullError, SlmedgeError, UnknownDataError
from ..fsutil import SEAL_KEY, check_seal, sealed, sha256_file, write_json_atomic
from ..data.files import data_files
from ..progress import stage as progress_stage
from ..registry import Registry
from ..procs import Stopped
from ..runtimes.registry import get_runtime
from .corpora import load_corpus, ntrex_languages

# The metrics an evaluation can run, in the order they run: name -> function of the Evaluation.
# The built-in ones are Evaluation's methods below; a plug-in registers a function of its own.
METRICS: Registry = Registry("metric")  # name -> fn(evaluation)
BUILTIN_METRICS = ("perplexity", "fidelity", "tasks", "memory", "latency")


def register_metric(name: str):
    """Decorator: register ``fn(evaluation)`` as the metric ``name`` (a duplicate name is refused).
    It records its numbers in ``evaluation.results["metrics"][name]`` and rows with ``_row``."""

    def wrap(fn):
        return METRICS.add(name, fn, fn.__qualname__)

    return wrap


def unregister_metric(name: str) -> None:
    METRICS.remove(name)
DEFAULT_LANGS = ("en", "ar", "hi", "zh", "th", "de", "es")  # the seed study's seven
# llama-bench's and most evaluation harnesses' context; a model with fewer positions gets its own.
DEFAULT_CONTEXT = 2048


@dataclass
class EvalSettings:
    metrics: tuple[str, ...] = BUILTIN_METRICS
    langs: tuple[str, ...] = DEFAULT_LANGS
    wikitext: bool = True
    corpora: tuple[str, ...] = ()  # user text files
    seqlen: int = 512
    stride: int | None = None
    ppl_windows: int | None = 4
    tasks: tuple[str, ...] | None = None  # None: the eight English tasks + XCOPA in the chosen languages
    limit: int | None = None
    reference: str | None = None  # None: the artifact's base model
    reference_runtime: str | None = None
    fidelity_windows: int = 2
    pp: int = 512
    tg: int = 128
    repeats: int = 3
    # The context (tokens): the KV cache the memory metric reports, the tasks' longest input,
    # llama.cpp's n_ctx. None: DEFAULT_CONTEXT, or the model's positions where it has fewer
    # (``resolved``, once the model's shape is known).
    context: int | None = None
    threads: int | None = None
    runtime: str | None = None
    target: str = "cpu"
    data_dir: str | None = None
    memory_child: bool = True
    # Let the lengths (seqlen, context, pp + tg) go past the positions the model was trained for:
    # rotary models extrapolate, and how badly they do is a legitimate measurement. Off: refused.
    beyond_positions: bool = False

    def validate(self) -> "EvalSettings":
        unknown = [m for m in self.metrics if m not in METRICS]
        if unknown:
            raise ConfigError(f"unknown metric '{unknown[0]}'; choose from {', '.join(METRICS)}")
        # Every count and length in its declared range (slmedge/limits.py says why each ends where it
        # does); the lengths against the model's positions once it is known (``bounds``).
        for key, name, value, optional in (
                ("eval_seqlen", "seqlen", self.seqlen, False), ("stride", "stride", self.stride, True),
                ("ppl_windows", "ppl_windows", self.ppl_windows, True), ("limit", "limit", self.limit, True),
                ("fidelity_windows", "fidelity_windows", self.fidelity_windows, False), ("pp", "pp", self.pp, False),
                ("tg", "tg", self.tg, False), ("repeats", "repeats", self.repeats, False),
                ("context", "context", self.context, True), ("threads", "threads", self.threads, True)):
            limits.check(key, value, name, none=optional)
        if self.stride is not None and self.stride > self.seqlen:
            raise ConfigError(f"stride must be at most the window length ({self.seqlen}), got {self.stride}")
        if not isinstance(self.beyond_positions, bool):
            raise ConfigError(f"beyond_positions must be true or false, got {self.beyond_positions!r}")
        data_files(self.data_dir)  # a --data-dir that is not a data folder fails here, before any work
        if "perplexity" in self.metrics or "tasks" in self.metrics:
            known = set(ntrex_languages(self.data_dir)) if self.langs else set()
            bad = [lang for lang in self.langs if lang not in known]
            if bad:
                raise UnknownDataError(f"unknown language '{bad[0]}': NTREX-128 here has {', '.join(sorted(known))}")
        if self.tasks:
            from .tasks import task_file, task_label

            seen: dict[str, str] = {}
            for t in self.task_list():
                task_file(t, self.data_dir)
                if seen.setdefault(task_label(t), t) != t:
                    raise ConfigError(f"tasks {seen[task_label(t)]} and {t} would both be shown as "
                                      f"'{task_label(t)}': rename one of the files")
        return self

    def resolved(self, positions: int | None) -> "EvalSettings":
        """These settings with the default context fixed for a model of ``positions`` (None: not known)."""
        if self.context is not None:
            return self
        return replace(self, context=min(DEFAULT_CONTEXT, positions) if positions else DEFAULT_CONTEXT)

    @property
    def n_ctx(self) -> int:
        """The context a runtime opens a file with: room for the context, a window and the latency run."""
        return max(self.context or DEFAULT_CONTEXT, self.seqlen, self.pp + self.tg + 8)

    def task_list(self) -> list[str]:
        from .tasks import ENGLISH_TASKS, XCOPA_LANGS

        if self.tasks is not None:
            groups = {"english": list(ENGLISH_TASKS), "xcopa": [f"xcopa_{lang}" for lang in XCOPA_LANGS]}
            groups["all"] = groups["english"] + groups["xcopa"]
            out: list[str] = []
            for t in self.tasks:
                out.extend(groups.get(t, [t]))
            return out

        return list(ENGLISH_TASKS) + [f"xcopa_{lang}" for lang in self.langs if lang in XCOPA_LANGS]


def _corpora(settings: EvalSettings) -> dict[str, str]:
    out = {}
    if settings.wikitext:
        out["wikitext2"] = load_corpus("wikitext2", settings.data_dir)
    for lang in settings.langs:
        out[lang] = load_corpus(f"ntrex128:{lang}", settings.data_dir)
    for f in settings.corpora:
        out[Path(f).name] = load_corpus(f, settings.data_dir)
    return out


def _model_config(sub) -> dict:
    """num_hidden_layers / num_key_value_heads / head_dim for the KV-cache size."""
    rt = sub.runtime
    if get_runtime(rt.name).export_format is None:  # a model source in process
        return rt.model.config.to_dict()
    return _file_facts(sub).get("config") or {}


def _file_facts(sub) -> dict:
    """An exported file's facts (``ExportFormat.model_facts``); {} where its format has none or they cannot be read."""
    fmt = get_runtime(sub.runtime.name).export_format
    from ..export.formats import get_format

    facts = get_format(fmt).model_facts if fmt is not None else None
    try:
        return facts(Path(sub.file)) if facts is not None else {}
    except Exception:  # noqa: BLE001 - the KV-cache size is then left out
        return {}


class Evaluation:
    """One evaluation run: results accumulate in ``self.results`` and go to the store and JSON
    as each metric finishes."""

    def __init__(self, spec: str | None, settings: EvalSettings, store=None, json_path: Path | None = None,
                 progress=None, subject=None):
        from ..compress.artifact import library_versions
        from ..targets.profiles import get_profile, profile_dict
        from .bounds import check_evaluation_bounds
        from .subject import open_on_target

        settings.validate()
        self.progress = progress
        self.json_path = Path(json_path) if json_path else None
        self._copy_error: BaseException | None = None
        self.profile = get_profile(settings.target)
        # lengths, threads and memory against the model and the target, before the model opens
        shape = check_evaluation_bounds(spec, settings, self.profile)
        self.settings = settings = settings.resolved(shape.positions) if shape is not None else settings
        if subject is not None:
            self.sub = subject
        else:
            self.sub = open_on_target(spec, settings.runtime, settings.threads, settings.n_ctx, self.profile)
        if shape is None:  # known only now that the model is open (a Hub id that was not cached)
            self._check_opened()
            settings = self.settings
        self.store = store
        rt = self.sub.runtime
        self.emulated = rt.emulated
        versions = library_versions()
        if rt.target_versions:
            versions["target"] = rt.target_versions
        self.results = {
            "model": self.sub.label, "spec": self.sub.spec, "identity": self.sub.identity, "runtime": rt.name,
            "threads": rt.threads, "target": self.profile.name, "emulated": self.emulated, "versions": versions,
            "target_profile": profile_dict(self.profile),
            "settings": asdict(settings), "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "metrics": {}, "notes": [],
            # what the runtime says of itself: e.g. where onnxruntime-genai's scores come from (logits_from)
            "runtime_info": _runtime_info(rt),
        }
        self.results["notes"].extend(self.sub.notes)
        if self.sub.streamed:
            self.results["notes"].append(
                "torch ran the model streamed, one decoder block in fp32 in memory at a time (SLMEDGE_TORCH_STREAM: "
                "auto, the default, streams a model whose whole fp32 weights would not fit comfortably; always; never): "
                "the same scores, but each forward pass reads every block again, so its latency is not that of the "
                "model held in memory")
        if self.emulated:
            self.results["notes"].append(f"target {self.profile.name} is emulated (qemu): its timings are not device "
                                         "latency; the roofline figures are projections")
        self.run_id = None
        self._task_scores: dict[str, list] = {}
        self._corpus_texts: dict[str, str] | None = None
        # A run is recorded once every input that can be wrong has been read (``run``): a bad
        # corpus or task file leaves no run behind.
        self._run_args = ((self.sub.label, self.sub.identity.get("sha256"), rt.name, rt.threads, self.profile.name,
                           versions, asdict(settings)), {"emulated": self.emulated})

    def _check_opened(self) -> None:
        """The bounds of ``bounds`` against the opened model's config (before any run is recorded)."""
        from ..models.shape import config_shape
        from .bounds import check_lengths, check_memory_fits

        try:
            shape = config_shape(_model_config(self.sub), self.sub.label)
            self.settings = self.settings.resolved(shape.positions)
            check_lengths(self.settings, shape)
            check_memory_fits(shape, self.settings, self.sub.runtime.name, self.profile)
        except BaseException:
            self.sub.close()
            raise

    # --- bookkeeping --------------------------------------------------------------------------

    def check_inputs(self) -> None:
        """Read every input file the chosen metrics need (corpora, task files), so that one that is
        missing, empty or malformed fails before a run is recorded."""
        if getattr(self, "_inputs_checked", False):
            return
        s = self.settings
        if "perplexity" in s.metrics:
            for f in s.corpora:
                if not load_corpus(f, s.data_dir).strip():
                    raise DataError(f"the corpus {f} is empty: no text to score")
            self._corpus_texts = _corpora(s)
            from .perplexity import check_corpus_length

            named = {**{n: n for n in self._corpus_texts}, **{Path(f).name: f for f in s.corpora}}
            for name, text in self._corpus_texts.items():  # one window at least, in this tokenizer
                check_corpus_length(self.sub.encoder, text, s.seqlen, named[name])
        if "tasks" in s.metrics:
            from .tasks import load_task

            for task in s.task_list():
                load_task(task, s.data_dir, s.limit)
        if "latency" in s.metrics:  # the prompt is WikiText-2's first tokens: enough of them for --pp
            self._prompt = self.sub.encoder.encode(load_corpus("wikitext2", s.data_dir)[:20000])
            if len(self._prompt) < s.pp:
                raise ConfigError(f"WikiText-2 gave {len(self._prompt)} tokens in this tokenizer, fewer than the "
                                  f"{s.pp}-token prompt: use --pp {len(self._prompt)} or less")
        self._inputs_checked = True

    def _record_run(self, settings: dict | None = None) -> None:
        """Record the run in the store once; ``settings``: those its numbers were measured with, when
        not this evaluation's own (a study target that takes another's rows, study/engine.py)."""
        if self.store is None or self.run_id is not None:
            return
        args, kwargs = self._run_args
        if settings is not None:
            args = (*args[:-1], settings)
        # A store that knows run statuses records the run as running until it ends; the study's
        # row recorder (and any store without them) takes the one-shot start_run.
        begin = getattr(self.store, "begin_run", None)
        self.run_id = (begin or self.store.start_run)(*args, **kwargs)
        self._ends_run = begin is not None
        self.results["run_id"] = self.run_id

    def _end_run(self, error: str | None) -> None:
        if self.run_id is not None and getattr(self, "_ends_run", False):
            self.store.end_run(self.run_id, error)

    def _row(self, metric, value, subset="", stderr=None, unit=None, extra=None):
        if self.store is not None:
            self.store.add(self.run_id, metric, value, subset, stderr, unit, extra)

    def _save(self):
        """Write the JSON copy of the results so far. A copy that cannot be written (a full disk) is
        not the evaluation's failure: it is kept for the end (``run``), and not tried again until then."""
        if self.json_path is None or self._copy_error is not None:
            return
        try:
            write_json_atomic(self.json_path, self._shareable())
        except (OSError, SlmedgeError) as exc:
            self._copy_error = exc

    def _shareable(self) -> dict:
        """The results as the ``--json`` file, which is meant for others, records them: local paths (the
        model's, the reference's, corpora, notes naming files) relative to the file's folder or by name;
        the results store, which stays on this machine, keeps them as they are."""
        from ..paths import shareable_record

        ident = self.results.get("identity") or {}
        known = [ident.get("path"), self.results.get("spec"), self.sub.spec]
        return shareable_record(self.results, self.json_path.parent, known)

    # --- metrics ------------------------------------------------------------------------------

    def run(self) -> dict:
        order = [m for m in METRICS if m in self.settings.metrics]
        self.check_inputs()
        self._record_run()
        try:
            for metric in order:
                # perplexity, fidelity and tasks count their windows and items (self.progress); the
                # others show as one stage each, with its time
                with progress_stage(metric) if metric in ("memory", "latency") else contextlib.nullcontext():
                    METRICS[metric](self)
                self._save()
        except BaseException as exc:  # the run is marked failed (an interrupt included); what finished is kept
            reason = (str(exc) if isinstance(exc, Stopped) else "interrupted") if isinstance(exc, KeyboardInterrupt) else \
                (f"{type(exc).__name__}: {exc}".splitlines() or [type(exc).__name__])[0]
            # The JSON copy says so too: what it holds is what finished before the failure, not a result.
            self.results.update(status="failed", error=reason)
            self._end_run(reason)
            raise
        else:
            self.results["status"] = "done"
            self._end_run(None)  # every metric finished: the run is done, whatever befalls its JSON copy
        finally:
            self.results["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            if self.json_path is not None:  # one more try at the end (space may have been freed meanwhile)
                self._copy_error = None
                self._save()
        if self._copy_error is not None:
            exc = self._copy_error
            if isinstance(exc, DiskFullError) and self.run_id is not None and self.store is not None:
                # the copy is lost, not the results: say where they are
                where = f"the evaluation finished and is recorded as run {self.run_id} in {self.store.path}"
                raise DiskFullError(str(exc).replace("nothing was written there", f"no JSON written; {where}"),
                                    exc.path, exc.needed) from exc
            raise exc
        return self.results

    @register_metric("perplexity")
    def _perplexity(self):
        from .perplexity import runtime_perplexity

        s = self.settings
        out = self.results["metrics"].setdefault("perplexity", {})
        for name, text in (self._corpus_texts or _corpora(s)).items():
            res, _ = runtime_perplexity(self.sub.runtime, self.sub.encoder, text, s.seqlen, s.stride, s.ppl_windows,
                                        self.progress, f"perplexity {name}")
            out[name] = res.to_dict()
            self._row("perplexity", res.perplexity, name, res.perplexity_stderr, "ppl",
                      {"tokens": res.tokens, "windows": res.windows, "seqlen": res.seqlen})
            self._row("bits_per_byte", res.bits_per_byte, name, None, "bits/byte", {"bytes": res.bytes})
            self._save()

    def _reference(self):
        from .subject import open_subject

        spec = self.settings.reference or self.sub.base_spec
        if spec is None:
            return None
        if getattr(self, "_ref", None) is None:
            self._ref = open_subject(spec, self.settings.reference_runtime, self.settings.threads,
                                     n_ctx=self.settings.n_ctx)
        return self._ref

    @register_metric("fidelity")
    def _fidelity(self):
        from .fidelity import fidelity, identity_key

        ref = self._reference()
        if ref is None:
            self.results["notes"].append("fidelity skipped: no reference (the model is not an artifact; pass --reference)")
            return
        text = load_corpus("wikitext2", self.settings.data_dir)
        stats = fidelity((self.sub.runtime, self.sub.encoder), (ref.runtime, ref.encoder), text, self.settings.seqlen,
                         self.settings.fidelity_windows, identity_key(ref.identity, ref.runtime.name), self.progress)
        stats["reference"] = ref.label
        stats["reference_runtime"] = ref.runtime.name
        self.results["metrics"]["fidelity"] = stats
        for key, unit in (("kl_mean", "nats"), ("kl_median", "nats"), ("kl_p99", "nats"), ("top1_agreement", "ratio"),
                          ("rms_delta_p", "prob"), ("hidden_snr_db", "dB")):
            if key in stats:
                self._row(key, stats[key], "wikitext2", stats.get("kl_mean_stderr") if key == "kl_mean" else None, unit,
                          {"reference": ref.label})

    @register_metric("tasks")
    def _tasks(self):
        from .fidelity import task_flips
        from .tasks import run_task, task_label

        out = self.results["metrics"].setdefault("tasks", {})
        ref = self._reference() if "fidelity" in self.settings.metrics else None
        max_len = self.settings.context
        for task in self.settings.task_list():
            name = task_label(task)
            summary, scores = run_task(self.sub.runtime, self.sub.encoder, task, self.settings.data_dir,
                                       self.settings.limit, max_len, self.progress)
            if ref is not None:
                ref_scores = self._reference_task_scores(ref, task, max_len)
                summary["flips_vs_reference"] = task_flips(scores, ref_scores)
                if "acc_norm" in summary:
                    summary["flips_norm_vs_reference"] = task_flips(scores, ref_scores, norm=True)
            out[name] = summary
            self._row("acc", summary["acc"], name, summary["acc_stderr"], "ratio", {"n": summary["n"]})
            if "acc_norm" in summary:
                self._row("acc_norm", summary["acc_norm"], name, summary["acc_norm_stderr"], "ratio", {"n": summary["n"]})
            if "flips_vs_reference" in summary:
                self._row("task_flips", summary["flips_vs_reference"], name, None, "ratio", {"reference": ref.label})
            if "flips_norm_vs_reference" in summary:
                self._row("task_flips_norm", summary["flips_norm_vs_reference"], name, None, "ratio",
                          {"reference": ref.label})
            self._save()

    def _reference_task_scores(self, ref, name, max_len):
        """The reference's predictions, cached on disk (per reference identity, task and limit)."""
        import hashlib

        from ..compress.artifact import library_versions
        from ..paths import cache_dir
        from .tasks import ItemScore, run_task, task_file

        # Keyed by the task file's content too: an edited task file is scored again.
        content = sha256_file(task_file(name, self.settings.data_dir))
        key = hashlib.sha256(json.dumps([ref.identity.get("sha256"), ref.runtime.name, name, content,
                                         self.settings.limit, max_len, library_versions()],
                                        default=str).encode()).hexdigest()[:24]
        path = cache_dir() / "reference" / f"task-{key}.json"
        if path.is_file():
            try:
                cached = json.loads(path.read_text())
                # Used only as written: sealed, and its content still matching the seal.
                if isinstance(cached, dict) and SEAL_KEY in cached:
                    check_seal(cached, path, ValueError)
                    return [ItemScore(**d) for d in cached["scores"]]
            except (OSError, ValueError, TypeError, KeyError):
                pass
        counted = self.progress and (lambda task, done, total: self.progress(f"{task} (reference)", done, total))
        _, scores = run_task(ref.runtime, ref.encoder, name, self.settings.data_dir, self.settings.limit, max_len,
                             counted)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, sealed({"scores": [asdict(s) for s in scores]}))
        return scores

    @register_metric("memory")
    def _memory(self):
        from .system import kv_cache_bytes, path_bytes, peak_rss_child

        sub, s = self.sub, self.settings
        size = path_bytes(sub.file)
        config = _model_config(sub)
        # A program that holds its KV cache whole (ExecuTorch's static cache) has it at its own positions,
        # whatever the context; the others' grows to the context.
        static = sub.runtime.static_kv_cache()
        kv_bytes_per_value = get_runtime(sub.runtime.name).kv_bytes_per_value
        out = {"file_bytes": size, "params": sub.params,
               "bits_per_weight": (8 * size / sub.params) if size and sub.params else None,
               "kv_cache_bytes": static["bytes"] if static else kv_cache_bytes(config, s.context, kv_bytes_per_value),
               "kv_cache_tokens": static["tokens"] if static else s.context, "kv_cache_static": bool(static),
               "context": s.context}
        if s.memory_child:
            transport = sub.runtime.transport
            if transport is not None:  # measured on the target, in a fresh runner
                probe = transport.memprobe(sub.runtime.name, sub.runtime.remote_path, sub.runtime.threads)
            else:
                spec = str(sub.file) if get_runtime(sub.runtime.name).runs_files else sub.spec
                probe = peak_rss_child(spec, sub.runtime.name, sub.runtime.threads, streamed=sub.streamed)
            out["peak_rss_bytes"] = probe["peak_rss_bytes"]
        self.results["metrics"]["memory"] = out
        self._row("file_bytes", size, "", None, "bytes")
        self._row("bits_per_weight", out["bits_per_weight"], "", None, "bits")
        self._row("kv_cache_bytes", out["kv_cache_bytes"], f"ctx{out['kv_cache_tokens']}", None, "bytes")
        if "peak_rss_bytes" in out:
            self._row("peak_rss_bytes", out["peak_rss_bytes"], "", None, "bytes")

    @register_metric("latency")
    def _latency(self):
        from .system import latency

        s = self.settings
        ids = getattr(self, "_prompt", None) or self.sub.encoder.encode(load_corpus("wikitext2", s.data_dir)[:20000])
        if len(ids) < s.pp:
            raise DataError(f"WikiText-2 gave {len(ids)} tokens, fewer than the {s.pp}-token prompt")
        lat = latency(self.sub.runtime, ids[: s.pp], s.tg, s.repeats)
        lat["emulated"] = self.emulated
        lat["roofline"] = self._roofline(lat)
        self.results["metrics"]["latency"] = lat
        subset = f"pp{s.pp}-tg{s.tg}"
        tag = {"emulated": True} if self.emulated else {}
        self._row("ttft_s", lat["ttft_s"]["median"], subset, None, "s", {**lat["ttft_s"], **tag})
        self._row("prefill_tps", lat["prefill_tps"]["median"], subset, None, "tokens/s", {**lat["prefill_tps"], **tag})
        self._row("decode_tps", lat["decode_tps"]["median"], subset, None, "tokens/s", {**lat["decode_tps"], **tag})
        roof = lat["roofline"]
        for key in ("decode_bound_tps", "prefill_bound_tps", "decode_fraction", "prefill_fraction"):
            if roof.get(key) is not None:
                self._row(key, roof[key], subset, None, "ratio" if key.endswith("fraction") else "tokens/s",
                          {"label": roof["label"], "target": self.profile.name})

    def _roofline(self, lat: dict) -> dict:
        from ..targets.roofline import roofline, set_against
        from .system import kv_cache_bytes, path_bytes

        sub, s = self.sub, self.settings
        config = _model_config(sub)
        runtime = get_runtime(sub.runtime.name)
        kv_token = kv_cache_bytes(config, 1, runtime.kv_bytes_per_value)
        qtype = str(sub.identity.get("qtype") or "")
        integer = runtime.runs_files and qtype not in ("", "f32", "f16", "fp32", "fp16", "bf16")
        # a static KV cache (an ExecuTorch program's) is read whole at every decode step
        positions = _file_facts(sub).get("kv_positions") or s.pp + s.tg // 2
        bounds = roofline(self.profile, path_bytes(sub.file), kv_token, sub.params, positions, integer)
        measured = not self.emulated and bool(self.profile.memory_bandwidth_gbs)
        return set_against(bounds, lat["decode_tps"]["median"], lat["prefill_tps"]["median"], measured)

    def close(self):
        self.sub.close()
        if getattr(self, "_ref", None) is not None:
            self._ref.close()


def evaluate(spec: str | None, settings: EvalSettings | None = None, store=None, json_path=None, progress=None) -> dict:
    ev = Evaluation(spec, settings or EvalSettings(), store, json_path, progress)
    try:
        return ev.run()
    finally:
        ev.close()


def _runtime_info(rt) -> dict:
    """The runtime's own facts (``Runtime.info``), JSON-safe; {} when it gives none."""
    try:
        info = rt.info()
    except Exception:  # noqa: BLE001 - a runtime that cannot describe itself still evaluates
        return {}
    return {k: v for k, v in (info or {}).items() if isinstance(v, (str, int, float, bool, type(None)))}

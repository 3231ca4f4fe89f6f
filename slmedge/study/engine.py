"""Running a study: jobs whose inputs are ready go to a pool (local processes, or Ray tasks with
resource requests); each finished job is recorded in the results store at once, so a run
killed at any point (``kill -9`` included) resumes with what finished kept and nothing redone.

Workers return what they made (an artifact path, an export path, an evaluation's results and
store rows); only this process writes the store, so Ray workers on other machines need no
access to it (their outputs need a filesystem the cluster shares).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from ..errors import ConfigError, SlmedgeError
from ..fsutil import disk_full, output_lock
from ..models.artifact_format import is_artifact
from .jobs import Job, build_jobs, study_workdir
from .spec import Study


class StudyRunError(SlmedgeError):
    """Some jobs of the study failed (the others finished and are kept)."""


class WorkerDiedError(SlmedgeError):
    """A job's worker process ended without raising: killed by a signal."""


# --- the store's study tables -----------------------------------------------------------------


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class StudyStore:
    def __init__(self, store):
        self.store = store
        self.db = store.db

    def register(self, study: str, jobs: list[Job]) -> None:
        """Record the study's grid. Jobs of an earlier version of the file that this one no longer
        asks for keep their results but leave the grid (the report shows the file as it is now);
        a job that comes back into the file finds its finished result again."""
        with self.store.writing(sum(len(json.dumps(j.spec)) + len(json.dumps(j.labels)) for j in jobs)):
            self.db.execute("UPDATE study_jobs SET in_grid = 0 WHERE study = ?", (study,))
            for j in jobs:
                self.db.execute(
                    "INSERT INTO study_jobs (study, job_id, kind, spec, labels, deps) VALUES (?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (study, job_id) DO UPDATE SET in_grid = 1, labels = excluded.labels",
                    (study, j.id, j.kind, json.dumps(j.spec, sort_keys=True), json.dumps(j.labels, sort_keys=True),
                     json.dumps(j.deps)))

    def changed_inputs(self, study: str, jobs: list[Job]) -> dict[str, int]:
        """Per kind, the finished jobs of the grid as last registered that ``jobs`` asks for again
        (the same kind and labels: the same cell of the grid) under another id: their inputs (a
        model, a data file, a profile, a version) changed since. Call before ``register``."""
        ids = {j.id for j in jobs}
        cells = {(j.kind, json.dumps(j.labels, sort_keys=True)) for j in jobs}
        out: dict[str, int] = {}
        for job_id, kind, labels in self.db.execute(
                "SELECT job_id, kind, labels FROM study_jobs WHERE study = ? AND in_grid = 1 AND status = 'done'",
                (study,)):
            if job_id not in ids and (kind, labels) in cells:
                out[kind] = out.get(kind, 0) + 1
        return {k: out[k] for k in ("compress", "export", "evaluate") if k in out}

    def facts(self, study: str) -> dict[str, dict]:
        """job id -> the facts its worker recorded (levels.py), for the finished jobs that have them."""
        rows = self.db.execute("SELECT job_id, facts FROM study_jobs WHERE study = ? AND status = 'done' "
                               "AND facts IS NOT NULL", (study,))
        return {r[0]: json.loads(r[1]) for r in rows}

    def finished(self, study: str) -> dict[str, dict]:
        rows = self.db.execute("SELECT job_id, output, run_id FROM study_jobs WHERE study = ? AND status = 'done'",
                               (study,))
        return {r[0]: {"output": r[1], "run_id": r[2]} for r in rows}

    def event(self, study: str, job_id: str, event: str, detail: str | None = None) -> None:
        with self.store.writing(len(detail or "") + 128):
            self.db.execute("INSERT INTO study_events (study, job_id, event, detail, at) VALUES (?, ?, ?, ?, ?)",
                            (study, job_id, event, detail, _now()))

    def finish(self, study: str, job: Job, result: dict) -> int | None:
        """Record a finished job (an evaluation's rows as a run of the store); returns that run's id."""
        run_id = None
        if job.kind == "evaluate":
            calls = result["rows"]
            start = calls[0]
            run_id = self.store.start_run(*start["args"], **start["kwargs"])
            for call in calls[1:]:
                self.store.add(run_id, *call["args"][1:], **call["kwargs"])
        facts = json.dumps(result["facts"], sort_keys=True) if result.get("facts") else None
        with self.store.writing(len(facts or "") + 256):  # the job's row and its event in one transaction
            self.db.execute("UPDATE study_jobs SET status = 'done', output = ?, run_id = ?, seconds = ?, finished_at = ?, "
                            "facts = ? WHERE study = ? AND job_id = ?",
                            (result.get("output"), run_id, result.get("seconds"), _now(), facts, study, job.id))
            self.db.execute("INSERT INTO study_events (study, job_id, event, detail, at) VALUES (?, ?, 'finished', ?, ?)",
                            (study, job.id, "reused" if result.get("reused") else None, _now()))
        return run_id

    def fail(self, study: str, job: Job, error: str) -> None:
        with self.store.writing(min(len(error), 2000) + 128):
            self.db.execute("UPDATE study_jobs SET status = 'failed' WHERE study = ? AND job_id = ?", (study, job.id))
            self.db.execute("INSERT INTO study_events (study, job_id, event, detail, at) VALUES (?, ?, 'failed', ?, ?)",
                            (study, job.id, error[:2000], _now()))


# --- one job (runs in a worker) ---------------------------------------------------------------


class _RowRecorder:
    """Stands in for the results store inside a worker: records the rows an evaluation writes."""

    def __init__(self):
        self.calls: list[dict] = []

    def start_run(self, *args, **kwargs):
        self.calls.append({"args": list(args), "kwargs": kwargs})
        return 0

    def add(self, *args, **kwargs):
        self.calls.append({"args": list(args), "kwargs": kwargs})


def _made(kind: str, spec: dict, out) -> bool:
    """Whether a compress or export job's output is on disk, whole (its last file is written last)
    and its files unchanged since they were written (against the checksums its manifest records): a
    corrupt one (a damaged or missing file) is made again, by this run, rather than failing every job
    that reads it. A manifest whose seal was removed or no longer matches is not replaced: it counts
    as made, and every job that reads it refuses it with the seal's message (an edit is the user's to
    undo, never silently overwritten)."""
    out = Path(out)
    if kind == "compress":
        if not is_artifact(out):
            return False
        from ..compress.artifact import Artifact
        from ..models.artifact_format import check_manifest_seal, manifest_path

        try:
            check_manifest_seal(out, json.loads(manifest_path(out).read_text(encoding="utf-8")))
        except (SlmedgeError, OSError, ValueError):
            return True  # refused, with the seal's message, by the jobs that read it
        try:
            Artifact.open(out, verify=True)
        except (SlmedgeError, OSError, ValueError):
            return False
        return True
    from ..export.formats import get_format

    return get_format(spec["format"]).reusable(out)  # whole, and unchanged since it was written


def _missing_outputs(jobs: list[Job], done: dict[str, dict]) -> list[Job]:
    """Finished compress/export jobs whose output is gone (deleted to free disk, or discarded by
    ``discard_artifacts``) and that an unfinished job still needs: they must run again. Outputs
    nothing needs any more may stay gone. ``jobs`` lists dependencies first, so one pass from the
    end sees every job that needs a given one before that one."""
    needed: set[str] = set()
    rebuild = []
    for j in reversed(jobs):
        if j.id in done:
            if j.kind == "evaluate" or j.id not in needed or _made(j.kind, j.spec, done[j.id]["output"] or j.output):
                continue
            rebuild.append(j)
        needed.update(j.deps)
    return rebuild[::-1]


def _discard(path: str) -> int:
    """Delete an artifact folder or export file; returns the bytes freed."""
    import shutil

    p = Path(path)
    if p.is_dir():
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        shutil.rmtree(p, ignore_errors=True)
        return size
    if p.is_file():
        size = p.stat().st_size
        p.unlink()
        return size
    return 0


def run_job(job: dict, threads: int | None = None, data_dir: str | None = None) -> dict:
    """Do one job; returns what it made. Module-level, so process pools and Ray can call it."""
    from ..quiet import quiet_libraries

    quiet_libraries(own_warnings=False)  # a worker's notes go into its results (everything under --debug)
    from . import levels

    t0 = time.perf_counter()
    spec, out = job["spec"], Path(job["output"]) if job["output"] else None
    if job["kind"] == "compress":
        from ..models.artifact_format import read_manifest

        if _made(job["kind"], spec, out):  # finished before a kill, not yet recorded: used once checked
            from ..models.artifact_format import open_manifest

            return {"output": str(out), "reused": True, "seconds": 0.0,
                    "facts": levels.artifact_level(open_manifest(out).get("summary") or {})}
        from ..compress.api import compress
        from ..compress.recipe import Recipe

        if threads:
            import torch

            torch.set_num_threads(threads)
        compress(spec["model"], Recipe(method=spec["method"], **spec["recipe"]), out, data_dir=data_dir,
                 device="cpu", overwrite=True)
        return {"output": str(out), "seconds": time.perf_counter() - t0,
                "facts": levels.artifact_level(read_manifest(out).get("summary") or {})}
    if job["kind"] == "export":
        from ..export.formats import get_format

        fmt = get_format(spec["format"])
        if _made(job["kind"], spec, out):
            return {"output": str(out), "reused": True, "seconds": 0.0,
                    "facts": levels.export_facts(fmt, {**(fmt.read_manifest(out) or {}), "bytes": _bytes(fmt, out)},
                                                 _quantized(job["labels"]))}
        from ..export.api import export

        source = job["source_path"]
        if not spec.get("imatrix"):
            report = export(source, spec["format"], spec["type"], out, overwrite=True, n_threads=threads)
        else:  # the row's model's importance on the study's calibration, a temporary beside the output
            from ..export.imatrix import make_imatrix
            from ..fsutil import temp_name

            im = spec["imatrix"]
            if threads:
                import torch

                torch.set_num_threads(threads)
            with output_lock(out):  # held for both steps: a killed run's matrix is the next writer's to remove
                imatrix = temp_name(out, "stage")
                try:
                    make_imatrix(source, imatrix, calibration=im["calibration"], nsamples=im["nsamples"],
                                 seqlen=im["seqlen"], seed=im["seed"], batch_size=im["batch_size"], data_dir=data_dir,
                                 device="cpu", overwrite=True)
                    report = export(source, spec["format"], spec["type"], out, overwrite=True, n_threads=threads,
                                    imatrix=imatrix)
                finally:
                    imatrix.unlink(missing_ok=True)
        return {"output": str(out), "seconds": time.perf_counter() - t0,
                "facts": levels.export_facts(fmt, report, _quantized(job["labels"]))}
    from ..evaluate.api import EvalSettings, evaluate

    ev = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["settings"].items()}
    ev.setdefault("threads", threads)
    ev["data_dir"] = data_dir
    if ev.get("reference") is None and spec["subject"] != job["labels"].get("model", spec["subject"]):
        # Fidelity's default reference is the model the row was made from. An export found it through
        # its source artifact, which --discard-artifacts may have deleted by now (fidelity was then
        # skipped without a word); the study knows that model: the same reference, named directly.
        ev["reference"] = job["labels"]["model"]
    rec = _RowRecorder()
    if "same_as" in spec:
        results, carried = _evaluate_same_as(job, EvalSettings(**ev, target=spec["target"]), rec)
    else:
        results, carried = evaluate(job["output"], EvalSettings(**ev, target=spec["target"]), store=rec), None
    facts = levels.evaluated_level(job["output"], job["labels"], results)
    if carried is not None:
        facts["same_as"] = carried
    if job["labels"].get("format") not in (None, "none"):
        settings = EvalSettings(**ev)
        facts["projections"] = levels.projections(job["labels"]["format"], Path(job["output"]),
                                                  settings.pp + settings.tg // 2)
    return {"rows": rec.calls, "results": results, "seconds": time.perf_counter() - t0, "facts": facts}


def _evaluate_same_as(job: dict, settings, rec) -> tuple[dict, dict]:
    """An evaluation that takes another target's exactness numbers when a probe shows this target
    computes them alike (study/carry.py); otherwise it measures everything here, as without same_as.
    Returns (results, what the probe found)."""
    from ..evaluate.api import Evaluation
    from ..evaluate.subject import open_on_target
    from ..targets.profiles import get_profile
    from . import carry

    spec, same = job["spec"], job["spec"]["same_as"]
    from ..models.shape import model_shape

    shape = model_shape(job["output"])
    settings = settings.resolved(shape.positions if shape is not None else None)
    n_ctx = max(settings.context, settings.seqlen, same["probe_tokens"] + 8)
    sub = open_on_target(job["output"], settings.runtime, settings.threads, n_ctx, get_profile(settings.target))
    ev = Evaluation(job["output"], settings, store=rec, subject=sub)
    try:
        ids = carry.probe_ids(sub.encoder, same["probe_tokens"], settings.data_dir)
        here = carry.token_logprobs(sub.runtime, ids)
        there = carry.reference_logprobs(job["output"], same["target"], sub.runtime.name, settings.threads, ids, n_ctx)
        verdict = {"target": same["target"], "job": same["job"], **carry.compare(here, there, same["probe_tolerance"])}
        extra = {"against": same["target"], "tokens": verdict["tokens"]}
        if verdict["same"]:
            source = job.get("same_as_run") or {}
            rows = carry.carried_rows(source.get("rows") or [], settings.metrics)
            # The run carries the settings its numbers were measured with: the other target's.
            ev._record_run({**(source.get("settings") or {}), "target": settings.target, "same_as": verdict})
            for r in rows:
                ev._row(r["metric"], r["value"], r["subset"], r["stderr"], r["unit"],
                        {**(r["extra"] or {}), "carried_from": same["target"]})
            ev.results["carried_from"] = same["target"]
            ev.results["notes"].append(
                f"perplexity, fidelity and tasks are {same['target']}'s numbers for this file: a probe of "
                f"{verdict['tokens']} tokens scored every token within {verdict['max_abs_dlogp']:.2g} nats of it "
                f"(tolerance {same['probe_tolerance']:g})")
        else:
            ev.results["notes"].append(
                f"measured here: a probe of {verdict['tokens']} tokens differed from {same['target']} by up to "
                f"{verdict['max_abs_dlogp']:.3g} nats, past the tolerance of {same['probe_tolerance']:g}")
            ev.run()
        for name in ("max_abs_dlogp", "mean_abs_dlogp"):  # the probe's own rows, either way
            value = verdict[name]
            ev._row(f"probe_{name}", value if math.isfinite(value) else None, "wikitext2", None, "nats", extra)
        if verdict["same"]:
            ev._end_run(None)  # (ev.run ends its own run)
        ev.results["same_as"] = verdict
        return ev.results, {k: v for k, v in verdict.items() if k != "job"}
    finally:
        ev.close()


def _bytes(fmt, out: Path) -> int | None:
    """The bytes of an export's model files (what a device loads)."""
    from ..evaluate.system import path_bytes

    try:
        return path_bytes(fmt.model_file(out))
    except (OSError, ValueError):
        return None


# --- engines ----------------------------------------------------------------------------------


class _LocalPool:
    """A process pool. A worker that dies (a crash in native code, the out-of-memory killer) breaks
    a ``ProcessPoolExecutor`` for good: its jobs in flight fail, and the next job gets a new pool."""

    def __init__(self, workers: int):
        self.workers = workers
        self.pool = self._new()
        self.broken = False

    def _new(self):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        from ..procs import die_with_parent

        # Each worker dies with this process, however it ends (kill -9, the OOM killer, a CI timeout):
        # a worker left behind holds a model's memory (and multiprocessing's resource tracker, which
        # ends once no worker is left) for as long as its job takes.
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=mp.get_context("spawn"),
                                   initializer=die_with_parent, initargs=(os.getpid(),))

    def submit(self, job: dict, threads, data_dir, needs_gpu: bool):
        if self.broken:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool, self.broken = self._new(), False
        return self.pool.submit(run_job, job, threads, data_dir)

    def wait_any(self, handles):
        from concurrent.futures import FIRST_COMPLETED, wait

        done, _ = wait(handles, return_when=FIRST_COMPLETED)
        return list(done)

    def result(self, handle):
        from concurrent.futures.process import BrokenProcessPool

        try:
            return handle.result()
        except BrokenProcessPool as exc:
            self.broken = True
            alone = "" if self.workers == 1 else " (a pool's workers end together: the other jobs in flight fail the same way)"
            raise WorkerDiedError(
                "its worker process was killed (a crash in native code, such as a runtime's, or the "
                f"out-of-memory killer){alone}; run the study again to retry it") from exc

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)


class _RayPool:
    def __init__(self, address: str | None, threads: int):
        try:
            import ray
        except ImportError as exc:
            from ..errors import RuntimeNotInstalledError

            raise RuntimeNotInstalledError("the ray engine needs Ray: pip install 'ray>=2.9' "
                                           "(or pip install -e .[ray])") from exc
        self.ray = ray
        if not ray.is_initialized():
            kwargs = {"address": address} if address else {"num_cpus": os.cpu_count() or 1}
            # Workers see this process's slmedge settings (cache, data, targets, offline mode).
            env = {k: v for k, v in os.environ.items() if k.startswith(("SLMEDGE_", "HF_", "TRANSFORMERS_"))}
            ray.init(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                     runtime_env={"env_vars": env}, **kwargs)
        self.task = ray.remote(run_job)
        self.threads = threads

    def submit(self, job: dict, threads, data_dir, needs_gpu: bool):
        opts = {"num_cpus": max(1, threads or 1), "max_retries": 0}
        if needs_gpu:
            opts["num_gpus"] = 1
        return self.task.options(**opts).remote(job, threads, data_dir)

    def wait_any(self, handles):
        done, _ = self.ray.wait(list(handles), num_returns=1)
        return done

    def result(self, handle):
        return self.ray.get(handle)

    def close(self):
        pass


def _on_gpu(target: str) -> bool:
    """Whether an evaluation on ``target`` runs on this machine's GPU (a Ray GPU request)."""
    from ..targets.profiles import get_profile
    from ..targets.registry import transport_class

    return transport_class(get_profile(target, detect=False).transport).torch_device == "cuda"


ENGINES = ("local", "ray")


def check_engine(engine: str, workers: int | None) -> None:
    """The engine and the number of workers, before anything is listed or run (ConfigError, exit 2)."""
    if engine not in ENGINES:
        raise ConfigError(f"unknown engine '{engine}' (--engine): choose {' or '.join(ENGINES)}")
    from ..limits import check

    check("workers", workers, "--workers", none=True)


def run_study(study: Study, store, engine: str = "local", workers: int | None = None, address: str | None = None,
              workdir=None, data_dir: str | None = None, progress=None, discard_artifacts: bool = False) -> dict:
    """Run every job of ``study`` not yet finished in ``store``; returns counts (``ran_by_kind``: the
    jobs run, per kind). A job is identified by its settings and its inputs' content: one whose
    model, data, target profile or versions changed since it finished is a new job and runs; its
    old result stays in the store, out of the grid (``inputs_changed``: how many, per kind).

    ``discard_artifacts``: delete each compressed model and export once every job of the grid
    that needs it has finished (results stay in the store; a job added later that needs one
    rebuilds it), so a large grid needs the disk of the jobs in flight, not of the whole grid."""
    check_engine(engine, workers)
    wd = study_workdir(study, workdir)
    jobs = build_jobs(study, wd, data_dir)  # each identified by its settings and its inputs' content
    # One run of a study's workdir at a time: a second is refused, naming the first (two runs would
    # start the same jobs and record each other's failures over finished results).
    with output_lock(wd, what=f"the study {study.name!r} (its workdir {wd})",
                     advice="wait for that run to finish (a study runs once at a time in one workdir)"):
        wd.mkdir(parents=True, exist_ok=True)  # (after: a missing input leaves nothing behind)
        return _run_locked(study, store, engine, workers, address, wd, jobs, data_dir, progress, discard_artifacts)


def _run_locked(study: Study, store, engine, workers, address, wd: Path, jobs: list[Job], data_dir, progress,
                discard_artifacts: bool) -> dict:
    ss = StudyStore(store)
    changed = ss.changed_inputs(study.name, jobs)
    ss.register(study.name, jobs)
    done = ss.finished(study.name)
    by_id = {j.id: j for j in jobs}
    rebuild = _missing_outputs(jobs, done)
    for j in rebuild:
        ss.event(study.name, j.id, "rebuilding", f"its output {done[j.id]['output']} is gone, incomplete or "
                 "changed since it was written, and a job needs it")
        del done[j.id]
    remaining = [j for j in jobs if j.id not in done]
    counts = {"jobs": len(jobs), "already_done": sum(1 for j in jobs if j.id in done), "ran": 0, "reused": 0,
              "failed": 0, "blocked": 0, "rebuilt": len(rebuild), "discarded_bytes": 0,
              "ran_by_kind": {"compress": 0, "export": 0, "evaluate": 0},
              "seconds_by_kind": {"compress": 0.0, "export": 0.0, "evaluate": 0.0}, "inputs_changed": changed}
    dependents: dict[str, set[str]] = {}
    for j in jobs:
        for d in j.deps:
            dependents.setdefault(d, set()).add(j.id)

    def discard_if_unneeded(job_id: str) -> None:
        if discard_artifacts and job_id in done and by_id[job_id].kind != "evaluate" \
                and all(u in done for u in dependents.get(job_id, ())):
            counts["discarded_bytes"] += _discard(done[job_id]["output"] or by_id[job_id].output)

    for j in jobs:  # what earlier runs left that nothing needs any more
        discard_if_unneeded(j.id)
    cores = os.cpu_count() or 1
    threads = study.evaluate.get("threads")
    if engine == "local":
        workers = workers or max(1, cores // (threads or cores))
        threads = threads or max(1, cores // workers)
        pool = _LocalPool(workers)
    else:
        threads = threads or 1
        pool = _RayPool(address, threads)
        workers = workers or max(1, cores // threads)
    failed: set[str] = set()
    running: dict = {}
    disk_is_full = False  # then no job starts: each would fail the same way
    started = time.perf_counter()
    try:
        while remaining or running:
            for j in list(remaining):
                if len(running) >= workers or disk_is_full:
                    break
                if any(d in failed for d in j.deps):
                    remaining.remove(j)
                    failed.add(j.id)
                    counts["blocked"] += 1
                    continue
                if all(d in done for d in j.deps):
                    payload = j.to_dict()
                    if j.kind == "export":
                        dep = j.spec["source"]
                        payload["source_path"] = done[dep]["output"] if dep in done else dep
                    if j.kind == "evaluate" and "same_as" in j.spec:  # the rows it may carry over
                        from .carry import run_rows

                        payload["same_as_run"] = run_rows(store, done[j.spec["same_as"]["job"]]["run_id"])
                    needs_gpu = j.kind == "evaluate" and _on_gpu(j.spec["target"])
                    ss.event(study.name, j.id, "started")
                    running[pool.submit(payload, threads, data_dir, needs_gpu)] = j
                    remaining.remove(j)
            if not running:
                break
            for h in pool.wait_any(list(running)):
                j = running.pop(h)
                try:
                    res = pool.result(h)
                except Exception as exc:  # noqa: BLE001 - a job's failure is recorded, the grid goes on
                    ss.fail(study.name, j, f"{type(exc).__name__}: {exc}")
                    failed.add(j.id)
                    counts["failed"] += 1
                    disk_is_full = disk_is_full or disk_full(exc)
                else:
                    done[j.id] = {"output": res.get("output"), "run_id": ss.finish(study.name, j, res)}
                    counts["reused" if res.get("reused") else "ran"] += 1
                    if not res.get("reused"):
                        counts["ran_by_kind"][j.kind] += 1
                        counts["seconds_by_kind"][j.kind] += float(res.get("seconds") or 0.0)
                    for d in j.deps:
                        discard_if_unneeded(d)
                if progress:
                    progress(j, counts, len(remaining) + len(running))
    finally:
        pool.close()
    counts["seconds"] = time.perf_counter() - started
    counts["pending"] = len(remaining)
    if disk_is_full:
        raise StudyRunError(f"no space left on the device under {wd}: {counts['failed']} job(s) failed and "
                            f"{counts['pending']} were not started; finished jobs are kept. Free some space (or run "
                            "with --discard-artifacts) and run the study again")
    if counts["failed"]:
        errs = store.db.execute("SELECT job_id, detail FROM study_events WHERE study = ? AND event = 'failed' "
                                "ORDER BY id DESC LIMIT 3", (study.name,)).fetchall()
        raise StudyRunError(f"{counts['failed']} job(s) failed ({counts['blocked']} blocked behind them); finished "
                            f"jobs are kept, run the study again to retry. Last: "
                            + "; ".join(f"{by_id[i].kind} {i}: {d}" for i, d in errs))
    return counts


def _quantized(labels: dict) -> bool:
    """Whether a row's method quantizes: a bit width, a llama.cpp grid or a bits-per-weight budget."""
    return bool(labels.get("bits") or labels.get("grid") or labels.get("bpw"))

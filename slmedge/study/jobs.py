"""The study's jobs: compress -> export -> evaluate, each identified by what it computes: a hash of
its settings and of the content of every input it reads (``inputs``: the model source, the
calibration files, the corpora and task files, the target profile, the versions of the packages
that compute its numbers and slmedge's own source). A job several evaluations need is built once,
a job a killed run finished is never run again, and a changed input gives the jobs that read it,
and the jobs downstream of them (whose specs hold their dependencies' ids), new ids: they run
again while every other job's result is reused."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from .spec import Study, deployable_exports


@dataclass
class Job:
    id: str
    kind: str  # compress | export | evaluate
    spec: dict  # what the job computes (its id is a hash of this)
    labels: dict  # how the report names it (model, method, seed, export, target...)
    deps: list[str] = field(default_factory=list)
    output: str = ""  # artifact folder / export path; evaluate: none

    def to_dict(self) -> dict:
        return {"id": self.id, "kind": self.kind, "spec": self.spec, "labels": self.labels, "deps": self.deps,
                "output": self.output}


def _id(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def study_workdir(study: Study, override=None) -> Path:
    if override:
        return Path(override)
    if study.workdir:
        return (study.path.parent / study.workdir).resolve()
    from ..paths import cache_dir

    return cache_dir() / "studies" / study.name


def build_jobs(study: Study, workdir: Path, data_dir=None) -> list[Job]:
    """Every job of the grid, dependencies first, each once. Reads (and hashes, remembering the
    hashes) every input the jobs read: a missing one is an error naming it, before anything runs.
    ``data_dir``: the ``--data-dir`` overlay the jobs will read their data files through."""
    from ..compress.methods import METHODS
    from ..compress.recipe import Recipe
    from ..export.formats import get_format
    from . import inputs as ins

    jobs: dict[str, Job] = {}

    def add(job: Job) -> Job:
        jobs.setdefault(job.id, job)
        return jobs[job.id]

    code = ins.slmedge_digest()  # slmedge's source: the code every job runs
    ev_settings = {t: study.evaluate_for(t) for t in study.targets}
    ev_data = {t: ins.evaluate_inputs(ev_settings[t], data_dir) for t in study.targets}
    profiles = {t: ins.profile_sha256(t) for t in study.targets}
    def calibrates(m) -> bool:  # rtn and magnitude read no calibration data
        return not m.is_base and METHODS[m.method].cls(Recipe(method=m.method, **m.settings)).needs_calibration

    calibration: dict[str, dict] = {}  # calibration spec -> the files it reads
    for m in study.methods:
        if calibrates(m) and m.settings["calibration"] not in calibration:
            calibration[m.settings["calibration"]] = ins.calibration_inputs(m.settings["calibration"], data_dir)
    for model in study.models:
        model_id = ins.model_identity(model)
        model_pkgs = ins.model_packages(model_id)
        for method in study.methods:
            for seed in ([None] if method.is_base else study.seeds):
                bits = method.settings.get("bits")
                base_labels = {"model": model, "method": method.label, "method_name": method.method, "bits": bits,
                               "group_size": method.settings.get("group_size", Recipe.group_size) if bits else None,
                               "sparsity": method.settings.get("sparsity"), "seed": seed}
                # llama.cpp grids and budgets (labels of their own only where set: other rows' labels unchanged)
                base_labels.update({k: method.settings[k] for k in ("grid", "bpw") if method.settings.get(k) is not None})
                if method.is_base:
                    source, source_dep = model, []
                else:
                    calib = calibration[method.settings["calibration"]] if calibrates(method) else None
                    spec = {"kind": "compress", "model": model, "method": method.method,
                            "recipe": {**method.settings, "seed": seed},
                            "inputs": {"model": model_id, "calibration": calib,
                                       "versions": ins.versions(ins.TORCH_STACK + model_pkgs, code)}}
                    cid = _id(spec)
                    comp = add(Job(cid, "compress", spec, base_labels, [], str(workdir / "artifacts" / cid)))
                    source, source_dep = comp.output, [comp.id]
                # What the next job reads of the model itself: nothing when it reads a compress job's
                # artifact (that job's id stands for it).
                direct, direct_pkgs = ({}, ()) if source_dep else ({"model": model_id}, model_pkgs)
                # (an export listed twice, once by "deployable", is one job: jobs are identified by their specs)
                exports = [x for e in study.exports
                           for x in (deployable_exports(method) if e.format == "deployable" else [e])]
                for exp in exports:
                    labels = {**base_labels, "export": exp.label, "format": exp.format, "type": exp.type}
                    if exp.format == "none":
                        subject, deps, reads, pkgs = source, source_dep, direct, ins.TORCH_STACK + direct_pkgs
                    else:
                        pkgs = ins.TORCH_STACK + ins.format_packages(exp.format)
                        spec = {"kind": "export", "source": source_dep[0] if source_dep else model,
                                "format": exp.format, "type": exp.type,
                                "inputs": {**direct, "versions": ins.versions(pkgs + direct_pkgs, code)}}
                        if exp.imatrix:  # computed on the study's calibration windows, from the row's model
                            dataset = study.calibration.get("dataset", Recipe.calibration)
                            if dataset not in calibration:
                                calibration[dataset] = ins.calibration_inputs(dataset, data_dir)
                            spec["imatrix"] = {"calibration": dataset,
                                               "nsamples": study.calibration.get("nsamples", Recipe.nsamples),
                                               "seqlen": study.calibration.get("seqlen", Recipe.seqlen),
                                               "batch_size": study.calibration.get("batch_size", Recipe.batch_size),
                                               "seed": seed or 0, "inputs": calibration[dataset]}
                        eid = _id(spec)
                        out = workdir / "exports" / get_format(exp.format).output_name(eid)
                        ex = add(Job(eid, "export", spec, labels, list(source_dep), str(out)))
                        subject, deps, reads = ex.output, [ex.id], {}
                    ids: dict[str, str] = {}
                    # a target that takes another's numbers (same_as) after it: its job names that one's
                    for target in sorted(study.targets, key=lambda t: t in study.same_as):
                        spec = {"kind": "evaluate", "subject": deps[0] if deps else model, "target": target,
                                "settings": ev_settings[target],
                                "inputs": {**reads, "data": ev_data[target], "target_profile": profiles[target],
                                           "versions": ins.versions(pkgs, code)}}
                        after = []
                        carry = study.same_as.get(target)
                        if carry is not None and exp.format != "none":  # a torch artifact runs here only
                            spec["same_as"] = {**carry, "job": ids[carry["target"]]}
                            after = [ids[carry["target"]]]
                        ids[target] = add(Job(_id(spec), "evaluate", spec, {**labels, "target": target},
                                              [*deps, *after], subject)).id
    ins.save_hashes()  # the next run finds unchanged files' hashes without reading them
    return list(jobs.values())

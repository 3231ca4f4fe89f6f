"""The study's jobs: compress -> export -> evaluate, each identified by what it computes (a
hash of its inputs), so a job several evaluations need is built once, and a job a killed run
finished is never run again."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from .spec import Study


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


def build_jobs(study: Study, workdir: Path) -> list[Job]:
    """Every job of the grid, dependencies first, each once."""
    from ..export.formats import get_format

    jobs: dict[str, Job] = {}

    def add(job: Job) -> Job:
        jobs.setdefault(job.id, job)
        return jobs[job.id]

    ev_settings = dict(study.evaluate)
    for model in study.models:
        for method in study.methods:
            for seed in ([None] if method.is_base else study.seeds):
                base_labels = {"model": model, "method": method.label, "method_name": method.method,
                               "bits": method.settings.get("bits"), "group_size": method.settings.get("group_size"),
                               "sparsity": method.settings.get("sparsity"), "seed": seed}
                if method.is_base:
                    source, source_dep = model, []
                else:
                    spec = {"kind": "compress", "model": model, "method": method.method,
                            "recipe": {**method.settings, "seed": seed}}
                    cid = _id(spec)
                    comp = add(Job(cid, "compress", spec, base_labels, [], str(workdir / "artifacts" / cid)))
                    source, source_dep = comp.output, [comp.id]
                for exp in study.exports:
                    labels = {**base_labels, "export": exp.label, "format": exp.format, "type": exp.type}
                    if exp.format == "none":
                        subject, deps = source, source_dep
                    else:
                        spec = {"kind": "export", "source": source_dep[0] if source_dep else model,
                                "format": exp.format, "type": exp.type}
                        eid = _id(spec)
                        out = workdir / "exports" / get_format(exp.format).output_name(eid)
                        ex = add(Job(eid, "export", spec, labels, list(source_dep), str(out)))
                        subject, deps = ex.output, [ex.id]
                    for target in study.targets:
                        spec = {"kind": "evaluate", "subject": deps[0] if deps else model, "target": target,
                                "settings": ev_settings}
                        add(Job(_id(spec), "evaluate", spec, {**labels, "target": target}, list(deps), subject))
    return list(jobs.values())

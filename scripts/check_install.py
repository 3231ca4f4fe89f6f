#!/usr/bin/env python
"""Does slmedge install beside the tools its users run next to it? pip's own resolver answers.

For each peer (default: vLLM 0.33.0 and GPTQModel 7.7.0, which slmedge must install beside, and
llm-compressor 0.14.0.1, reported only), and for slmedge alone as the baseline, this runs

    python -m pip install --dry-run --ignore-installed --isolated --use-feature=fast-deps --report FILE CHECKOUT[EXTRAS] PEER

which resolves the whole dependency tree for this platform and Python and installs nothing. pip reads
each wheel's metadata with HTTP range requests (``--use-feature=fast-deps``) instead of downloading the
wheels a dry run otherwise fetches in full (torch and the CUDA libraries vLLM pulls in: about 3 GB per
resolution, in the temporary folder); ``--full-downloads`` turns that off, for an index that does not
serve range requests (pip falls back to a full download for such a wheel anyway). llama-cpp-python has
no wheel: pip prepares its metadata from the sdist, or takes it from the wheel it cached when it built it.
slmedge's requirements are the checkout's own pyproject.toml (pip builds the project's metadata), with
the extras users install.

It prints one table: per resolution, the version chosen for every package slmedge and the peers share
(torch, transformers, tokenizers, huggingface_hub, compressed-tensors, onnx, onnxruntime, numpy,
safetensors, ...), and every other package a peer moved from slmedge's own resolution; then each
conflict as pip states it (its "The conflict is caused by" lines).

pip's configuration is left out (``--isolated``: no pip.conf, no PIP_* variables), so that a machine's
own settings do not decide the answer: this machine's /etc/xdg/pip/pip.conf names a constraint file
capping torch at 2.14.1 (the releases on its disk), which a user's machine does not have, and local
wheel folders. ``--pip-config`` keeps the configuration (an index mirror, say) but still replaces any
constraint file with an empty one (PIP_CONSTRAINT=/dev/null: an empty PIP_CONSTRAINT does not
override a pip.conf entry). ``--index-url`` passes an index to pip in either mode.

Exit status: 0 when every required peer resolves together with slmedge; 1 when one does not (a
conflict, or pip could not resolve at all: no network, a broken sdist), with an ``error:`` line per
peer; 2 for a bad option or an unusable interpreter (this must run on a Python slmedge supports: the
resolution is for the Python that runs it); 130 when interrupted.

    python scripts/check_install.py
    python scripts/check_install.py --json out/install.json --extras compressed-tensors
    python scripts/check_install.py --peer vllm==0.33.0 --optional llmcompressor==0.14.0.1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

REQUIRED = ("vllm==0.33.0", "gptqmodel==7.7.0")  # a conflict with these fails the check
OPTIONAL = ("llmcompressor==0.14.0.1",)  # reported: its ranges may not allow slmedge's
# The extras users install beside the tools (pytest's are not among them).
EXTRAS = ("compressed-tensors", "genai", "bench", "ray", "executorch")
# Always shown when resolved: what slmedge and the peers share and a conflict is usually about.
SHARED = ("torch", "transformers", "tokenizers", "huggingface-hub", "compressed-tensors", "accelerate",
          "safetensors", "onnx", "onnxruntime", "onnxruntime-genai", "numpy", "protobuf", "sentencepiece",
          "gguf", "optimum", "pydantic", "triton")
BASELINE = "slmedge alone"


def canonical(name: str) -> str:
    """PEP 503's normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    if not m:
        raise ValueError(f"not a requirement: {spec!r}")
    return canonical(m.group(1))


def project(root: Path) -> dict:
    """The checkout's pyproject.toml [project] table."""
    return tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def pip_command(target: str, peer: str | None, report: Path, pip_config: bool, index_url: str | None,
                full_downloads: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--disable-pip-version-check",
           "--progress-bar", "off", "--report", str(report)]
    if not full_downloads:
        cmd.append("--use-feature=fast-deps")
    if not pip_config:
        cmd.append("--isolated")
    if index_url:
        cmd += ["--index-url", index_url]
    return cmd + [target] + ([peer] if peer else [])


def pip_env(pip_config: bool) -> dict:
    """The environment pip runs in: with the machine's configuration kept, its constraint files emptied
    (/dev/null: an empty PIP_CONSTRAINT is ignored and pip.conf's entry would apply)."""
    env = dict(os.environ)
    if pip_config:
        env["PIP_CONSTRAINT"] = os.devnull
        env["PIP_BUILD_CONSTRAINT"] = os.devnull
    return env


def conflict_lines(output: str) -> list[str]:
    """pip's own statement of why a resolution failed, condensed to its informative lines: the
    "The conflict is caused by:" block (and the packages it found no distribution of), or the last
    ERROR lines when there was no conflict to state (no such version, no network, a failed build)."""
    lines = output.splitlines()
    out: list[str] = []
    for i, line in enumerate(lines):
        if line.strip() in ("The conflict is caused by:",
                            "Additionally, some packages in these conflicts have no matching distributions "
                            "available for your environment:"):
            prefix = "" if line.strip().startswith("The conflict") else "no distribution for: "
            for follow in lines[i + 1:]:
                if not follow.startswith("    "):
                    break
                out.append(prefix + follow.strip())
    if out:
        return out
    errors = [ln.strip() for ln in lines if ln.startswith("ERROR:") and "ResolutionImpossible" not in ln]
    return errors[-3:] or [ln.strip() for ln in lines if ln.strip()][-3:]


def summary(lines: list[str]) -> str:
    """One line for the error message: the package pip could not satisfy and who asks for what, from
    its "X depends on PACKAGE SPEC" lines (the first line as it is when there are none)."""
    wants: dict[str, list[str]] = {}
    for line in lines:
        m = re.match(r"(.+?) depends on ([A-Za-z0-9][A-Za-z0-9._-]*)(.*)$", line)
        if m:
            spec = m.group(3).split(";")[0].strip().replace(" and ", ",")
            wants.setdefault(canonical(m.group(2)), []).append(f"{m.group(1)} wants {spec or 'any'}")
    blocked = [canonical(ln.split(": ", 1)[1]) for ln in lines if ln.startswith("no distribution for: ")]
    name = next((n for n in blocked if n in wants), None) or next((n for n, w in wants.items() if len(w) > 1), None)
    if name is None:
        return lines[0] if lines else "pip failed"
    return f"no {name} satisfies all ({'; '.join(wants[name])})"


def read_report(report: Path) -> dict[str, str]:
    """canonical name -> version of every package pip would install (its --report JSON)."""
    data = json.loads(report.read_text(encoding="utf-8"))
    return {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in data.get("install", [])}


def resolve(label: str, target: str, peer: str | None, pip_config: bool, index_url: str | None,
            full_downloads: bool = False) -> dict:
    """One resolution: {"label", "peer", "ok", "versions", "conflict", "seconds"}."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="slmedge-check-install-") as tmp:
        report = Path(tmp) / "report.json"
        proc = subprocess.run(pip_command(target, peer, report, pip_config, index_url, full_downloads),
                              capture_output=True, text=True, env=pip_env(pip_config), cwd=tmp)
        ok = proc.returncode == 0 and report.is_file()
        versions = read_report(report) if ok else {}
    output = proc.stdout + "\n" + proc.stderr
    return {"label": label, "peer": peer, "ok": ok, "versions": versions,
            "conflict": [] if ok else conflict_lines(output),
            "pip_output": [] if ok else output.strip().splitlines()[-40:],  # the whole story, in the JSON
            "seconds": round(time.perf_counter() - started, 1)}


def rows(results: list[dict], shown: tuple[str, ...] = SHARED) -> list[str]:
    """The packages the table shows: the shared ones any resolution chose, then every other package
    whose version differs between two resolutions that include it (what a peer moved)."""
    chosen = [r["versions"] for r in results if r["ok"]]
    names = [n for n in shown if any(n in v for v in chosen)]
    moved = sorted({n for v in chosen for n in v
                    if n not in names and len({w[n] for w in chosen if n in w}) > 1})
    return names + moved


def table(results: list[dict], names: list[str]) -> str:
    heads = ["package"] + [r["label"] for r in results]
    body = [[n] + [(r["versions"].get(n, "-") if r["ok"] else "conflict") for r in results] for n in names]
    body.append(["(resolved in)"] + [f"{r['seconds']:.0f} s" for r in results])
    widths = [max(len(row[i]) for row in [heads] + body) for i in range(len(heads))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*heads), fmt.format(*("-" * w for w in widths))]
    return "\n".join(lines + [fmt.format(*row) for row in body])


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--peer", action="append", metavar="SPEC",
                    help=f"a tool slmedge must install beside (repeatable; default: {', '.join(REQUIRED)})")
    ap.add_argument("--optional", action="append", metavar="SPEC",
                    help=f"a tool reported on without failing the check (repeatable; '' for none; default: "
                         f"{', '.join(OPTIONAL)})")
    ap.add_argument("--extras", default=",".join(EXTRAS),
                    help="slmedge's extras to include, comma-separated ('' for none; default: %(default)s)")
    ap.add_argument("--json", metavar="FILE", help="also write every resolution (versions, conflicts) as JSON")
    ap.add_argument("--pip-config", action="store_true",
                    help="keep this machine's pip configuration (index, find-links), minus its constraint files")
    ap.add_argument("--index-url", metavar="URL", help="the package index pip reads (default: pip's, PyPI)")
    ap.add_argument("--full-downloads", action="store_true",
                    help="let pip download every wheel in full to read its metadata (no HTTP range requests)")
    ap.add_argument("--jobs", type=int, default=2, metavar="N", help="resolutions run at once (default: %(default)s)")
    ap.add_argument("--project", type=Path, default=ROOT, metavar="DIR", help="the checkout (default: this one)")
    return ap.parse_args(argv)


def fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    required = [p for p in args.peer if p.strip()] if args.peer is not None else list(REQUIRED)
    optional = [p for p in args.optional if p.strip()] if args.optional is not None else list(OPTIONAL)
    try:
        meta = project(args.project)
        peers = [(spec, True) for spec in required] + [(spec, False) for spec in optional]
        for spec, _ in peers:
            requirement_name(spec)
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
        return fail(f"cannot read {args.project / 'pyproject.toml'}: {exc}", 2)
    except ValueError as exc:
        return fail(str(exc), 2)
    if args.jobs < 1:
        return fail(f"--jobs must be at least 1, not {args.jobs}", 2)
    known = set(meta.get("optional-dependencies", {}))
    extras = [e.strip() for e in args.extras.split(",") if e.strip()]
    unknown = [e for e in extras if e not in known]
    if unknown:
        return fail(f"unknown extra {unknown[0]!r}; {meta['name']} has: {', '.join(sorted(known))}", 2)
    spec = meta.get("requires-python")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if spec and not _python_ok(spec, sys.version_info[:3]):
        return fail(f"this is Python {here}; {meta['name']} requires {spec} and pip resolves for the Python "
                    "that runs it: run this with a Python slmedge supports (e.g. .venv/bin/python)", 2)
    target = f"{args.project.resolve()}[{','.join(extras)}]" if extras else str(args.project.resolve())

    jobs = [(BASELINE, None)] + [(f"+ {spec}", spec) for spec, _ in peers]
    print(f"Resolving {meta['name']} ({args.project.resolve().name}/pyproject.toml"
          f"{', extras ' + ','.join(extras) if extras else ''}) with pip's resolver, nothing installed, for "
          f"Python {here} on {sys.platform} ({'this machine' if args.pip_config else 'no local pip config'}):",
          flush=True)
    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(lambda job: resolve(job[0], target, job[1], args.pip_config, args.index_url,
                                                          args.full_downloads),
                                    jobs))
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    print()
    print(table(results, rows(results)))
    for r in results:
        if not r["ok"]:
            print(f"\n{r['label']}: no resolution. pip says:")
            for line in r["conflict"]:
                print(f"    {line}")
    total = round(time.perf_counter() - started, 1)
    print(f"\n{len(results)} resolutions in {total:.0f} s ({args.jobs} at a time)")
    if args.json:
        out = {"project": str(args.project.resolve()), "extras": extras, "python": here, "platform": sys.platform,
               "pip_config": args.pip_config, "seconds": total,
               "resolutions": [dict(r, required=dict(peers).get(r["peer"])) for r in results]}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    code = 0
    for r in results:
        if not r["ok"] and (r["peer"] is None or dict(peers)[r["peer"]]):
            what = f"{meta['name']} does not resolve on its own" if r["peer"] is None else \
                f"{meta['name']} does not install beside {r['peer']}"
            code = fail(f"{what}: {summary(r['conflict'])}", 1)
    return code


def _python_ok(spec: str, version: tuple[int, int, int]) -> bool:
    """Whether ``version`` satisfies a requires-python of comma-separated >=, <, <=, >, ==, != clauses
    (pip's own check uses the packaging library, which this script does not assume is importable)."""
    ops = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
           "<": lambda a, b: a < b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}
    for clause in spec.split(","):
        m = re.fullmatch(r"\s*(>=|<=|==|!=|>|<)\s*([0-9]+(?:\.[0-9]+)*)\s*", clause)
        if not m:
            return True  # a form this does not read: pip decides
        want = tuple(int(p) for p in m.group(2).split("."))
        if not ops[m.group(1)](version[:len(want)], want):
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())

"""scripts/check_install.py: slmedge resolved by pip beside vLLM 0.33, GPTQModel 7.7 and llm-compressor 0.14.

The tests marked ``install`` run pip's real resolver against PyPI (network; ~1.5 min for the whole
check on 2 cores with pip's cache warm). The others check the script's own parts offline: how it
states pip's conflicts, and that a bad setting stops it before pip runs.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version  # pytest's own dependency

from conftest import missing_prerequisite

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_install.py"


def script():
    spec = importlib.util.spec_from_file_location("check_install", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(*args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def require_pypi():
    """pip can read PyPI's index (as the check does: no local pip configuration)."""
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "pip", "--isolated",
                               "--disable-pip-version-check"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        proc = None
    if proc is None or proc.returncode != 0:
        missing_prerequisite("PyPI cannot be reached by pip: the install check resolves against it")


def probe_project(tmp_path: Path, requires_python: str = ">=3.11", deps=("transformers>=5.3,<6",)) -> Path:
    """A one-requirement project standing in for slmedge (its metadata builds in a second)."""
    d = tmp_path / "probe"
    d.mkdir()
    (d / "pyproject.toml").write_text(f"""[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "probe"
version = "0.0.1"
requires-python = "{requires_python}"
dependencies = {json.dumps(list(deps))}

[project.optional-dependencies]
extra = []

[tool.setuptools]
py-modules = []
""")
    return d


# pip 26.3's words, verbatim (the tail of its output), on slmedge at main (compressed-tensors <0.15)
# beside vLLM 0.33
PIP_CONFLICT = """\
Collecting einops (from vllm==0.33.0)
  Downloading einops-0.8.2-py3-none-any.whl (65 kB)
INFO: pip is looking at multiple versions of vllm to determine which version is compatible with other requirements. This could take a while.

The conflict is caused by:
    slmedge[compressed-tensors] 0.1.0 depends on compressed-tensors<0.15 and >=0.14.0.1; extra == "compressed-tensors"
    vllm 0.33.0 depends on compressed-tensors==0.17.0

Additionally, some packages in these conflicts have no matching distributions available for your environment:
    compressed-tensors

To fix this you could try to:
1. loosen the range of package versions you've specified
2. remove package versions to allow pip to attempt to solve the dependency conflict


ERROR: Cannot install slmedge[compressed-tensors]==0.1.0 and vllm==0.33.0 because these package versions have conflicting dependencies.
ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/#dealing-with-dependency-conflicts
"""

PIP_NOT_FOUND = """\
ERROR: Could not find a version that satisfies the requirement vllm==9.9.9 (from versions: 0.0.1, 0.33.0)
ERROR: No matching distribution found for vllm==9.9.9
"""


def test_a_conflict_is_stated_in_pips_own_words():
    m = script()
    lines = m.conflict_lines(PIP_CONFLICT)
    assert lines == ['slmedge[compressed-tensors] 0.1.0 depends on compressed-tensors<0.15 and >=0.14.0.1; extra == '
                     '"compressed-tensors"', "vllm 0.33.0 depends on compressed-tensors==0.17.0",
                     "no distribution for: compressed-tensors"]
    assert m.summary(lines) == ("no compressed-tensors satisfies all (slmedge[compressed-tensors] 0.1.0 wants "
                                "<0.15,>=0.14.0.1; vllm 0.33.0 wants ==0.17.0)")


def test_a_failure_without_a_conflict_keeps_pips_error_lines():
    m = script()
    lines = m.conflict_lines(PIP_NOT_FOUND)
    assert lines == ["ERROR: Could not find a version that satisfies the requirement vllm==9.9.9 (from versions: "
                     "0.0.1, 0.33.0)", "ERROR: No matching distribution found for vllm==9.9.9"]
    assert m.summary(lines) == lines[0]


def test_the_table_shows_shared_packages_and_what_a_peer_moved():
    m = script()
    results = [
        {"label": "slmedge alone", "peer": None, "ok": True, "seconds": 30.0,
         "versions": {"torch": "2.14.1", "transformers": "5.25.0", "rich": "15.0.0", "cuda-bindings": "13.5.0"}},
        {"label": "+ vllm==0.33.0", "peer": "vllm==0.33.0", "ok": True, "seconds": 50.0,
         "versions": {"torch": "2.14.0", "transformers": "5.20.2", "rich": "15.0.0", "cuda-bindings": "13.4.4",
                      "vllm": "0.33.0"}},
        {"label": "+ x==1", "peer": "x==1", "ok": False, "seconds": 5.0, "versions": {}, "conflict": ["..."]},
    ]
    names = m.rows(results)
    assert names == ["torch", "transformers", "cuda-bindings"]  # rich agrees everywhere; vllm is in one only
    text = m.table(results, names)
    lines = text.splitlines()
    assert lines[0].split() == ["package", "slmedge", "alone", "+", "vllm==0.33.0", "+", "x==1"]
    assert lines[2].split() == ["torch", "2.14.1", "2.14.0", "conflict"]
    assert lines[-1].split() == ["(resolved", "in)", "30", "s", "50", "s", "5", "s"]


def test_requires_python_is_read_as_pip_reads_it():
    ok = script()._python_ok
    assert ok(">=3.11,<3.12", (3, 11, 7)) and not ok(">=3.11,<3.12", (3, 12, 0))
    assert not ok(">=3.11", (3, 10, 14)) and ok("!=3.11.7", (3, 11, 8)) and not ok("!=3.11.7", (3, 11, 7))


@pytest.mark.parametrize("args,words", [
    (["--extras", "compressed-tensors,nope"], ["unknown extra 'nope'", "compressed-tensors"]),
    (["--jobs", "0"], ["--jobs must be at least 1"]),
    (["--peer", "==1.0"], ["not a requirement"]),
    (["--project", "/nonexistent/slmedge"], ["cannot read", "pyproject.toml"]),
])
def test_a_bad_setting_stops_before_pip_runs(args, words):
    proc = run(*args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err
    assert "Resolving" not in proc.stdout  # nothing was resolved


def test_a_python_the_project_does_not_support_is_refused(tmp_path):
    proc = run("--project", str(probe_project(tmp_path, requires_python=">=3.99")), "--extras", "", timeout=60)
    assert proc.returncode == 2 and "requires >=3.99" in proc.stderr and "resolves for the Python" in proc.stderr


@pytest.mark.install
def test_a_real_conflict_fails_with_pips_reason(tmp_path):
    """pip's real resolver on a project that needs transformers 5 beside a peer that pins 4.57."""
    require_pypi()
    proc = run("--project", str(probe_project(tmp_path)), "--extras", "", "--peer", "transformers==4.57.6",
               "--optional", "", "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "error: probe does not install beside transformers==4.57.6: no transformers satisfies all (" in proc.stderr
    assert "probe 0.0.1 wants <6,>=5.3" in proc.stderr, proc.stderr
    assert "probe 0.0.1 depends on transformers<6 and >=5.3" in proc.stdout, proc.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    alone, peer = report["resolutions"]
    assert alone["ok"] and alone["versions"]["transformers"].startswith("5.")
    assert not peer["ok"] and peer["required"] is True and peer["versions"] == {}


@pytest.mark.install
def test_slmedge_installs_beside_vllm_and_gptqmodel(tmp_path):
    """The check itself, on this checkout's pyproject.toml: vLLM 0.33 and GPTQModel 7.7 resolve with
    slmedge and its extras; llm-compressor 0.14 is reported either way."""
    require_pypi()
    proc = run("--json", str(tmp_path / "r.json"))
    print(proc.stdout)  # the table, in the test log
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by_peer = {r["peer"]: r for r in json.loads((tmp_path / "r.json").read_text())["resolutions"]}
    assert set(by_peer) == {None, "vllm==0.33.0", "gptqmodel==7.7.0", "llmcompressor==0.14.0.1"}
    vllm = by_peer["vllm==0.33.0"]["versions"]
    assert vllm["vllm"] == "0.33.0" and vllm["torch"] == "2.14.0" and vllm["compressed-tensors"] == "0.17.0"
    assert Version("5.16.1") <= Version(vllm["transformers"]) < Version("5.21") and vllm["slmedge"]
    gptq = by_peer["gptqmodel==7.7.0"]["versions"]
    assert gptq["gptqmodel"] == "7.7.0" and Version(gptq["transformers"]) >= Version("5.20.2")
    assert "package" in proc.stdout and "+ gptqmodel==7.7.0" in proc.stdout

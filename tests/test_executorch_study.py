"""ExecuTorch beyond one file: a study grid that lists it (a row becomes a ``.pte`` program, its numbers
in the report; what cannot work refused at ``--dry-run``), the targets (the emulated arm64 target has
no ExecuTorch build; over ssh it runs where the device has ExecuTorch's Python bindings) and the
roofline projection of a program. One tiny fp32 program, made by the study, serves every test that
runs one."""

import json
import sys
from pathlib import Path

import pytest
from conftest import one_line_error, require_import, tiny_study_file

from test_targets import _ssh_profile, sshd  # noqa: F401  (sshd: the fixture, a real sshd on 127.0.0.1)
from typer.testing import CliRunner

from slmedge.cli import app
from slmedge.study.spec import StudyError, load_study

runner = CliRunner()


def _executorch():
    require_import("torchao", "torchao is not installed (pip install 'slmedge[executorch]')")
    require_import("executorch.extension.pybindings.portable_lib",
                   "ExecuTorch is not installed (pip install 'slmedge[executorch]')")


def _study(folder: Path, model, name="et", exports=('"executorch"\ntype = "fp32"',)) -> Path:
    return tiny_study_file(folder, model, name, ['method = "none"'], exports=exports)


ROW = '\n[[methods]]\nlabel = "{label}"\nmethod = "rtn"\nbits = {bits}\ngroup_size = {group}\n'


# --- the study file --------------------------------------------------------------------------------


def test_a_study_file_refuses_what_executorch_cannot_do_with_the_line(tmp_path, tiny_models):
    good = _study(tmp_path, tiny_models("llama"))
    text = good.read_text()
    cases = [  # (bad text, words of the error, the start of the line it must name)
        (text.replace('type = "fp32"', 'type = "q4_0"'), ["unknown ExecuTorch type 'q4_0'", "8da4w"], 'type = "q4_0"'),
        (text.replace('type = "fp32"', 'type = "fp32"\nimatrix = true'), ["imatrix = true", 'format = "gguf"'],
         "imatrix = true"),
        (text.replace('targets = ["cpu"]', 'targets = ["cpu", "arm64"]'),
         ["target 'arm64' cannot run executorch", "no aarch64 Linux build of executorch"], 'format = "executorch"'),
        # rows whose codes XNNPACK has no kernel for, and codes asked of the base (which has none)
        (text.replace('type = "fp32"', 'type = "auto"') + ROW.format(label="rtn-w4g16", bits=4, group=16),
         ['[[methods]] rtn-w4g16 as format = "executorch"', "XNNPACK has no kernel for groups of 16"],
         'format = "executorch"'),
        (text.replace('type = "fp32"', 'type = "auto"') + ROW.format(label="rtn-w8g32", bits=8, group=32),
         ["XNNPACK has no kernel for 8-bit codes in groups of 32", "group_size = -1"], 'format = "executorch"'),
        (text.replace('type = "fp32"', 'type = "codes"'),
         ['[[methods]] base as format = "executorch"', "type codes keeps an artifact's codes"], 'format = "executorch"'),
    ]
    for i, (bad, words, needle) in enumerate(cases):
        f = tmp_path / f"bad{i}.toml"
        f.write_text(bad)
        line = next(n for n, x in enumerate(bad.splitlines(), 1) if x.startswith(needle))
        with pytest.raises(StudyError) as err:
            load_study(f)
        for w in [*words, f"{f.name}, line {line}:"]:
            assert w in str(err.value), (i, str(err.value))
        res = runner.invoke(app, ["study", str(f), "--dry-run"])
        one_line_error(res, *words)
        assert res.exit_code == 2, res.output


def test_a_study_listing_executorch_without_the_extra_is_one_line_exit_2(tmp_path, tiny_models, monkeypatch):
    f = _study(tmp_path, tiny_models("llama"))
    monkeypatch.setitem(sys.modules, "executorch.extension.pybindings.portable_lib", None)
    monkeypatch.setitem(sys.modules, "executorch.extension.pybindings", None)
    res = runner.invoke(app, ["study", str(f), "--dry-run"])
    one_line_error(res, f"{f.name}, line", 'format = "executorch"', "ExecuTorch is not installed",
                   "pip install 'slmedge[executorch]'")
    assert res.exit_code == 2
    assert not (tmp_path / "work-et").exists()


def test_rows_whose_codes_xnnpack_keeps_are_listed(tmp_path, tiny_models):
    _executorch()
    f = _study(tmp_path, tiny_models("llama"), exports=('"executorch"',))
    f.write_text(f.read_text() + ROW.format(label="rtn-w4g32", bits=4, group=32)
                 + ROW.format(label="rtn-w8", bits=8, group=-1))
    res = runner.invoke(app, ["study", str(f), "--dry-run"])
    assert res.exit_code == 0 and "8 jobs (2 compress, 3 export, 3 evaluate)" in res.output, res.output


# --- a row that is a .pte --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def et_study(tiny_models, tmp_path_factory):
    """The tiny llama's base row as an fp32 .pte, run as a study (perplexity, tasks, latency):
    (store path, study file, the row)."""
    _executorch()
    from slmedge.evaluate.store import ResultsStore
    from slmedge.study.report import load_rows

    folder = tmp_path_factory.mktemp("et-study")
    f = _study(folder, tiny_models("llama"))
    f.write_text(f.read_text().replace('metrics = ["perplexity"]', 'metrics = ["perplexity", "latency"]\npp = 16\n'
                                       'tg = 4\nrepeats = 1'))
    res = runner.invoke(app, ["study", str(f), "--dry-run"])
    assert res.exit_code == 0 and "2 jobs (0 compress, 1 export, 1 evaluate)" in res.output, res.output
    path = folder / "results.sqlite"
    res = runner.invoke(app, ["study", str(f), "--results-db", str(path), "--workers", "1"])
    assert res.exit_code == 0, res.output
    store = ResultsStore(path)
    (row,) = load_rows(store, "et")
    store.close()
    return path, f, row


def test_a_study_row_is_a_pte_measured_as_torch_measures_its_source(et_study, tiny_models, tmp_path):
    from slmedge.evaluate.api import EvalSettings, evaluate

    store, f, row = et_study
    assert row["labels"]["format"] == "executorch" and row["labels"]["export"] == "executorch-fp32"
    assert row["runtime"] == "executorch"
    pte = next((f.parent / "work-et" / "exports").glob("*/model.pte"))
    assert {p.name for p in pte.parent.iterdir()} >= {"model.pte", "tokenizer.json", "slmedge-export.json"}
    assert row["export"]["format"] == "executorch" and row["export"]["type"] == "fp32"
    assert row["export"]["codes"] == "none" and row["export"]["bytes"] == pte.stat().st_size
    settings = json.loads(json.dumps(load_study(f).evaluate))
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}
    ref = evaluate(str(tiny_models("llama")), EvalSettings(**{**settings, "metrics": ("perplexity",)}, runtime="torch"))
    (name,) = ref["metrics"]["perplexity"]
    assert row["metrics"]["perplexity"][name] == pytest.approx(ref["metrics"]["perplexity"][name]["perplexity"],
                                                               rel=1e-4)
    assert next(iter(row["metrics"]["decode_tps"].values())) > 0
    assert next(iter(row["metrics"]["prefill_tps"].values())) > 0
    assert row["compression_bits"] == pytest.approx(32, rel=0.2) and "fp32 executorch file" in row["level"]
    # the study's projection of the program on each device profile (its real bytes and parameters)
    proj = row["facts"]["projections"]
    assert proj and all(p["runtime"] == "executorch" and p["decode_bound_tps"] > 0 and p["prefill_bound_tps"] > 0
                        for p in proj.values())
    md = tmp_path / "r.md"
    res = runner.invoke(app, ["report", str(store), "--study", "et", "--format", "md", "-o", str(md)])
    assert res.exit_code == 0, res.output
    assert "executorch-fp32" in md.read_text()


# --- targets ---------------------------------------------------------------------------------------


def _program(et_study) -> Path:
    return next((et_study[1].parent / "work-et" / "exports").glob("*/model.pte")).parent


def test_the_emulated_arm64_target_refuses_a_pte_in_one_line(et_study, tmp_path):
    folder = _program(et_study)
    res = runner.invoke(app, ["evaluate", str(folder), "--target", "arm64", "--metrics", "perplexity",
                              "--results-db", str(tmp_path / "db")])
    one_line_error(res, "target 'arm64' cannot run executorch", "no aarch64 Linux build of executorch")
    assert res.exit_code == 2


def test_an_emulated_profile_offering_executorch_is_refused(tmp_path, monkeypatch):
    from slmedge.targets.profiles import get_profile

    monkeypatch.setenv("SLMEDGE_TARGETS", str(tmp_path))
    shipped = Path(get_profile("arm64").file).read_text()
    (tmp_path / "arm-et.toml").write_text(shipped.replace('name = "arm64"', 'name = "arm-et"').replace(
        'runtimes = ["llama.cpp"', 'runtimes = ["executorch", "llama.cpp"'))
    res = runner.invoke(app, ["targets", "check", "arm-et"])
    one_line_error(res, "arm-et.toml", "no aarch64 Linux build of executorch")
    assert res.exit_code == 2
    # without a runtimes list, an emulated profile offers what its environment can hold
    (tmp_path / "arm-default.toml").write_text("\n".join(x for x in shipped.replace('name = "arm64"', 'name = '
                                                                                    '"arm-default"').splitlines()
                                                         if not x.startswith(("runtimes", "default_runtime"))))
    assert "executorch" not in get_profile("arm-default").runtimes
    assert "onnxruntime" in get_profile("arm-default").runtimes


def test_ssh_runs_a_pte_where_the_device_has_executorch_like_local(et_study, sshd, tmp_path, monkeypatch):
    from test_executorch import _settings

    from slmedge.evaluate.api import evaluate

    monkeypatch.setenv("SLMEDGE_TARGETS", str(tmp_path / "profiles"))
    work = _ssh_profile(tmp_path / "profiles", sshd)
    prof = tmp_path / "profiles" / "ssh-localhost.toml"
    prof.write_text(prof.read_text().replace('runtimes = ["llama.cpp", "onnxruntime"]', 'runtimes = ["executorch"]'))
    folder = _program(et_study)
    settings = dict(metrics=("perplexity", "tasks", "latency", "memory"))
    local = evaluate(str(folder), _settings(tmp_path, **settings))
    remote = evaluate(str(folder), _settings(tmp_path, target="ssh-localhost", **settings))
    assert remote["runtime"] == "executorch" and remote["target"] == "ssh-localhost" and not remote["emulated"]
    lp, rp = local["metrics"]["perplexity"]["c.txt"], remote["metrics"]["perplexity"]["c.txt"]
    assert rp["tokens"] == lp["tokens"] and rp["perplexity"] == pytest.approx(lp["perplexity"], rel=1e-6)
    assert [t["acc"] for t in remote["metrics"]["tasks"].values()] == \
        [t["acc"] for t in local["metrics"]["tasks"].values()]
    assert remote["metrics"]["latency"]["decode_tps"]["median"] > 0
    # the program's static KV cache, as here (only the program travelled; the config stays here)
    lm, rm = local["metrics"]["memory"], remote["metrics"]["memory"]
    assert lm.get("kv_cache_static") and rm.get("kv_cache_static") and rm["kv_cache_bytes"] == lm["kv_cache_bytes"]
    assert remote["versions"]["target"]["executorch"]  # what the runner found there (`targets check` shows it)
    assert [p.name for p in work.rglob("*.pte")] == ["model.pte"]  # the program travelled; the tokenizer stays here


def test_a_device_without_executorch_is_one_line(et_study, sshd, tmp_path, monkeypatch):
    """The device's Python sees numpy but not ExecuTorch: refused with how to install it, nothing copied."""
    import subprocess

    env = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(env)], check=True)
    site = next((env / "lib").glob("python3*/site-packages"))
    (site / "executorch.py").write_text("raise ImportError('not here')\n")
    monkeypatch.setenv("SLMEDGE_TARGETS", str(tmp_path / "profiles"))
    work = _ssh_profile(tmp_path / "profiles", sshd)
    prof = tmp_path / "profiles" / "ssh-localhost.toml"
    prof.write_text(prof.read_text().replace('runtimes = ["llama.cpp", "onnxruntime"]', 'runtimes = ["executorch"]')
                    .replace(f'python = "{sys.executable}"', f'python = "{env / "bin" / "python"}"'))
    res = runner.invoke(app, ["evaluate", str(_program(et_study)), "--target", "ssh-localhost", "--metrics",
                              "perplexity", "--results-db", str(tmp_path / "db")])
    one_line_error(res, "target 'ssh-localhost'", "has no executorch", "pip install executorch")
    assert not any(work.rglob("*.pte"))


def test_the_roofline_projection_covers_a_program(et_study):
    from slmedge.evaluate.system import kv_cache_bytes
    from slmedge.export.executorch import executorch_model_facts

    from slmedge.targets.profiles import get_profile

    pi = get_profile("raspberry-pi-5")
    folder = _program(et_study)
    facts = executorch_model_facts(folder / "model.pte")
    manifest = json.loads((folder / "slmedge-export.json").read_text())
    assert facts["params"] > 0 and facts["quantized"] is False and facts["config"]["num_hidden_layers"] >= 1
    assert facts["kv_positions"] == manifest["context"] + 1
    for given in (folder, folder / "model.pte"):
        res = runner.invoke(app, ["targets", "show", "raspberry-pi-5", "--model", str(given), "--json"])
        assert res.exit_code == 0, res.output
        p = json.loads(res.output[res.output.index("{"):])["projection"]
        size = (folder / "model.pte").stat().st_size
        assert "projection" in p["label"] and p["model"] == "model.pte"
        # decode moves the weights and the whole static KV cache, whatever --context asks
        kv = kv_cache_bytes(facts["config"], facts["kv_positions"], 4)
        assert p["decode_bytes_per_token"] == size + kv and kv > 0
        assert p["decode_bound_tps"] == pytest.approx(pi.memory_bandwidth_gbs * 1e9 / (size + kv))
        assert p["prefill_bound_tps"] == pytest.approx(pi.peak_fp32_gflops * 1e9 / (2 * facts["params"]))

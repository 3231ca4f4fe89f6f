"""Model files that carry code are refused before any library reads them (issue 39, CVE-2026-4372).

A fake ``kernels`` package on the path records its import: transformers reaches it for a config whose
attention names a Hub kernel (the control below), slmedge never does.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slmedge.cli import app
from slmedge.errors import RemoteCodeError
from slmedge.models.remote_code import code_fields, refuse_code
from test_study import _study
from tiny import save_tiny

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]
FAKE_KERNELS = '''import os, pathlib
pathlib.Path(os.environ["KERNELS_MARKER"]).write_text("imported")
def get_kernel(*args, **kwargs):
    raise RuntimeError("the fake kernels package fetches nothing")
'''


def _edit(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


# (name, file, edit, the field the message names)
CASES = [
    ("auto-map", "config.json", lambda c: c.update(auto_map={"AutoModelForCausalLM": "modeling_evil.EvilModel"}),
     "auto_map"),
    ("nested-auto-map", "config.json",
     lambda c: c.update(text_config={"model_type": "llama", "auto_map": {"AutoConfig": "evil.Config"}}),
     "text_config.auto_map"),
    ("attn-internal", "config.json", lambda c: c.update(_attn_implementation_internal="kernels-community/evil-attn"),
     "_attn_implementation_internal"),
    ("nested-attn-internal", "config.json",
     lambda c: c.update(text_config={"model_type": "llama", "_attn_implementation_internal": "evil/kernel"}),
     "text_config._attn_implementation_internal"),
    ("attn-implementation", "config.json", lambda c: c.update(attn_implementation="kernels-community/flash-evil"),
     "attn_implementation"),
    ("trust-remote-code-key", "config.json", lambda c: c.update(trust_remote_code=True), "trust_remote_code"),
    ("tokenizer-auto-map", "tokenizer_config.json",
     lambda c: c.update(auto_map={"AutoTokenizer": ["tok_evil.EvilTokenizer", None]}), "auto_map"),
    ("experts-kernel", "config.json", lambda c: c.update(experts_implementation="org/moe-kernel"),
     "experts_implementation"),
    ("per-config-attn", "config.json", lambda c: c.update(_attn_implementation={"": "sdpa", "text_config": "x/y"}),
     "_attn_implementation.text_config"),
]


@pytest.fixture(scope="module")
def carriers(tmp_path_factory):
    root = tmp_path_factory.mktemp("carriers")
    out = {}
    for name, file, edit, field in CASES:
        folder = save_tiny("llama", root / name)
        _edit(folder / file, edit)
        out[name] = (folder, file, field)
    return out


@pytest.fixture()
def fake_kernels(tmp_path, monkeypatch):
    """A ``kernels`` package first on the path that leaves a marker file when imported."""
    pkg = tmp_path / "fake" / "kernels"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_KERNELS)
    marker = tmp_path / "kernels-imported"
    monkeypatch.setenv("KERNELS_MARKER", str(marker))
    monkeypatch.syspath_prepend(str(pkg.parent))
    monkeypatch.delitem(sys.modules, "kernels", raising=False)
    return marker


def _commands(folder: Path, tmp_path: Path) -> dict[str, list[str]]:
    return {
        "compress": ["compress", str(folder), "--method", "rtn", "--bits", "4", "--group-size", "32",
                     "-o", str(tmp_path / "out")],
        "evaluate": ["evaluate", str(folder), "--metrics", "perplexity", "--results-db", str(tmp_path / "r.db")],
        "export": ["export", str(folder), "--format", "gguf", "--type", "f32", "-o", str(tmp_path / "m.gguf")],
        "inspect": ["inspect", str(folder)],
        "study": ["study", str(_study(tmp_path, folder, name="carrier"))],
        "imatrix": ["imatrix", str(folder), "-o", str(tmp_path / "m.imatrix.gguf")],
    }


def test_the_fields_that_name_code_are_found_at_any_depth():
    assert code_fields({"model_type": "llama", "attn_implementation": "sdpa", "_attn_implementation": "eager"}) == []
    assert [f for f, _ in code_fields({"a": [{"b": {"auto_map": {}}}]})] == ["a[0].b.auto_map"]
    assert [f for f, _ in code_fields({"vision_config": {"experts_implementation": "eager"},
                                       "x": {"_experts_implementation_internal": "a:b"}})] == \
        ["x._experts_implementation_internal"]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
@pytest.mark.parametrize("command", ["compress", "evaluate", "export", "inspect", "study", "imatrix"])
def test_a_folder_that_carries_code_is_refused_by_every_command(case, command, carriers, fake_kernels, tmp_path):
    folder, file, field = carriers[case]
    args = _commands(folder, tmp_path)[command]
    before = sorted(p.name for p in tmp_path.iterdir())
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert file in result.output and field in result.output and "--trust-remote-code" in result.output
    assert "pip install" not in result.output
    assert not fake_kernels.exists()  # nothing reached a kernel loader
    after = sorted(p.name for p in tmp_path.iterdir())
    assert after == before, "the refusal wrote something"  # no output, no store


def test_the_control_transformers_alone_reaches_the_kernel_loader(carriers, tmp_path):
    """Without slmedge's check the same folder makes transformers import ``kernels`` (so the test above can fail)."""
    folder, _, _ = carriers["attn-internal"]
    fake = tmp_path / "fake" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_KERNELS)
    marker = tmp_path / "kernels-imported"
    env = {**os.environ, "KERNELS_MARKER": str(marker), "PYTHONPATH": str(fake.parent)}
    code = ("from transformers import AutoModelForCausalLM\n"
            f"try:\n    AutoModelForCausalLM.from_pretrained({str(folder)!r})\nexcept Exception:\n    pass\n")
    subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert marker.exists()


def test_a_cli_process_with_kernels_installed_never_imports_it(carriers, tmp_path):
    """The same in a process of its own, as a user runs it, with ``kernels`` importable."""
    folder, _, _ = carriers["attn-internal"]
    fake = tmp_path / "fake" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_KERNELS)
    marker = tmp_path / "kernels-imported"
    env = {**os.environ, "KERNELS_MARKER": str(marker), "PYTHONPATH": f"{fake.parent}{os.pathsep}{REPO}"}
    done = subprocess.run([sys.executable, "-m", "slmedge", "compress", str(folder), "--method", "rtn", "--bits", "4",
                           "--group-size", "32", "-o", str(tmp_path / "out")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1 and "_attn_implementation_internal" in done.stderr, done.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_cached_hub_snapshot_that_carries_code_is_refused(carriers, tmp_path, monkeypatch):
    """A Hub id read from the local Hugging Face cache (offline) is checked like a folder."""
    folder, _, _ = carriers["auto-map"]
    hub = tmp_path / "hf" / "hub"
    repo = hub / "models--someone--evil-model"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = runner.invoke(app, ["compress", "someone/evil-model", "--method", "rtn", "--bits", "4",
                                 "--group-size", "32", "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and "auto_map" in result.output and "config.json" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_auto_map_on_a_built_in_architecture_says_how_to_use_transformers_own_code(carriers):
    folder, _, _ = carriers["auto-map"]
    with pytest.raises(RemoteCodeError, match="built into transformers: delete auto_map"):
        refuse_code(folder)


def test_trust_remote_code_is_the_only_thing_in_the_way(tmp_path):
    """With --trust-remote-code a folder whose auto_map names a module beside the weights loads (the module
    here subclasses transformers' own llama: a local file, no hub)."""
    folder = save_tiny("llama", tmp_path / "custom")
    (folder / "modeling_custom.py").write_text(
        "from transformers import LlamaForCausalLM\n\n\nclass CustomForCausalLM(LlamaForCausalLM):\n    pass\n")
    _edit(folder / "config.json", lambda c: c.update(auto_map={"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}))
    args = ["compress", str(folder), "--method", "rtn", "--bits", "4", "--group-size", "32", "-o", str(tmp_path / "out")]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 1 and "auto_map" in refused.output
    trusted = runner.invoke(app, [*args, "--trust-remote-code"])
    assert trusted.exit_code == 0, trusted.output
    assert (tmp_path / "out" / "slmedge.json").is_file()

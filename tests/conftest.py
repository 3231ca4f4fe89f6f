import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import calib_text, save_tiny  # noqa: E402

# Emulated target environments are built once per machine (`slmedge targets setup arm64`, run by
# .ci/run) into the real user cache; tests use them there while everything else goes to tmp dirs.
if not os.environ.get("SLMEDGE_TARGET_ENVS"):
    from platformdirs import user_cache_dir

    os.environ["SLMEDGE_TARGET_ENVS"] = str(Path(os.environ.get("SLMEDGE_CACHE_DIR") or user_cache_dir("slmedge"))
                                            / "targets")

# Tests never reach a hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Progress lines stay out of the output the tests read (an error is one line, JSON is JSON); the tests
# of the progress display turn it on (tests/test_progress.py, the main job's in test_cli_output.py).
os.environ.setdefault("SLMEDGE_PROGRESS", "off")


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    # One cache for the session: the embedded model is converted once (about a minute).
    return tmp_path_factory.mktemp("slmedge-cache")


@pytest.fixture(autouse=True)
def user_dirs(session_cache, monkeypatch, tmp_path):
    """Every user directory slmedge writes to lives under pytest's tmp dirs."""
    monkeypatch.setenv("SLMEDGE_CACHE_DIR", str(session_cache))
    monkeypatch.setenv("HF_HOME", str(session_cache / "hf"))
    monkeypatch.chdir(tmp_path)
    # `slmedge --debug` run in this process (CliRunner) sets SLMEDGE_DEBUG for the process and its children
    # for good, as a command should; a test's --debug must not make every later test (and the commands it
    # starts) loud, so each test starts without it.
    monkeypatch.delenv("SLMEDGE_DEBUG", raising=False)
    from slmedge.quiet import quiet_torch_loggers

    quiet_torch_loggers()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """model_type -> a saved tiny HF folder (built lazily, once per session)."""
    root = tmp_path_factory.mktemp("tiny")
    built: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in built:
            built[model_type] = save_tiny(model_type, root / model_type)
        return built[model_type]

    return get


@pytest.fixture(scope="session")
def wide_models(tmp_path_factory):
    """model_type -> a saved tiny HF folder of the WIDE shape (tests/tiny.py: 256-wide attention and MLP
    inputs, a 288-wide down projection), built lazily, once per session."""
    root = tmp_path_factory.mktemp("tiny-wide")
    built: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in built:
            built[model_type] = save_tiny(model_type, root / model_type, wide=True)
        return built[model_type]

    return get


@pytest.fixture(scope="session")
def calib_file(tmp_path_factory) -> Path:
    return calib_text(tmp_path_factory.mktemp("calib") / "calib.txt")


def small_recipe(calib_file, **kw):
    from slmedge.compress.recipe import Recipe

    base = dict(group_size=32, calibration=str(calib_file), nsamples=6, seqlen=32, batch_size=4, awq_grid=4)
    if kw.get("grid") or kw.get("bpw"):  # a grid fixes the group size: one given besides is refused
        del base["group_size"]
    base.update(kw)
    return Recipe(**base)


@pytest.fixture(scope="module")
def artifacts(tiny_models, calib_file, tmp_path_factory):
    """(model_type, method, source=None, **recipe) -> a compressed tiny artifact, built once per module."""
    from slmedge.compress.api import compress

    root = tmp_path_factory.mktemp("artifacts")
    built = {}

    def get(model_type, method, source=None, **kw):
        key = (model_type, method, str(source), tuple(sorted(kw.items())))
        if key not in built:
            out = root / f"{model_type}-{method}-{len(built)}"
            compress(str(source or tiny_models(model_type)), small_recipe(calib_file, method=method, **kw), out,
                     device="cpu")
            built[key] = out
        return built[key]

    return get


@pytest.fixture(scope="session")
def exports(tiny_models, tmp_path_factory):
    """The tiny llama in all three runtimes' forms (same weights, f32): runtime -> path string."""
    from slmedge.export.gguf import export_gguf
    from slmedge.export.onnx import export_onnx

    root = tmp_path_factory.mktemp("f32-exports")
    src = tiny_models("llama")
    export_gguf(src, root / "m.gguf", "f32")
    export_onnx(src, root / "onnx", "fp32")
    return {"torch": str(src), "llama.cpp": str(root / "m.gguf"), "onnxruntime": str(root / "onnx")}


def one_line_error(result, *words):
    """A CLI failure printed as one 'error:' line (no traceback) naming ``words``."""
    assert result.exit_code != 0
    text = result.output.strip()
    assert text.startswith("error:") and "Traceback" not in text, text
    for w in words:
        assert w in text, text


def safetensors_full_disk(*args, **kwargs):
    """Stands in for ``save_file`` on a full disk: safetensors' Rust writer raises its own error
    (this message, as seen in CI), not an OSError."""
    import safetensors

    raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


# --- prerequisites: a skip locally, a failure in CI ------------------------------------------------


def missing_prerequisite(reason: str):
    """A test cannot run because something scripts/setup.sh (or scripts/test.sh) installs is
    missing: it skips with ``reason`` on a developer's machine, and fails under ``CI=true``, where
    a skip would hide a broken install."""
    __tracebackhide__ = True  # reported at the test's line, not here
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: scripts/setup.sh should have provided it)", pytrace=False)
    pytest.skip(reason)


def require(ok: bool, reason: str) -> None:
    """``missing_prerequisite(reason)`` unless ``ok``."""
    __tracebackhide__ = True
    if not ok:
        missing_prerequisite(reason)


def require_import(module: str, reason: str | None = None):
    """``pytest.importorskip`` that fails under ``CI=true``: the module, imported."""
    import importlib

    __tracebackhide__ = True
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing_prerequisite(reason or f"{module} is not importable ({exc})")


def require_arm64_env() -> dict:
    """The built arm64 environment's record (env.json, written only after its runner passed the
    check); a test that needs it skips without it, and fails under CI=true."""
    import json

    from slmedge.targets.emulation import env_root

    f = env_root() / "env.json"
    if not f.is_file():
        missing_prerequisite(f"no arm64 environment in {f.parent}: slmedge targets setup arm64 "
                             "(scripts/test.sh builds it)")
    return json.loads(f.read_text())


@pytest.fixture
def arm64_env() -> dict:
    return require_arm64_env()


def study_data_files(folder: Path) -> tuple[Path, Path]:
    """A tiny corpus and a two-item task file for the study tests' short evaluations."""
    import json

    corpus = folder / "c.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 12,
                      encoding="utf-8")
    tasks = folder / "mini.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in [
        {"query": "The sky is", "choices": ["blue", "green grass", "a"], "gold": 0},
        {"query": "Two and two make", "choices": ["four", "seven", "many fish"], "gold": 0}]), encoding="utf-8")
    return corpus, tasks


def tiny_study_file(folder: Path, model, name: str, methods: list[str], exports=('"none"',), *,
                    workdir: str | None = None, corpus: Path | None = None, calibration: bool = False,
                    ppl_windows: int = 1) -> Path:
    """A study file for the tests' short studies: one model, seed 0 on the cpu target, perplexity on a
    tiny corpus (study_data_files' unless given) in ``ppl_windows`` 32-token windows; ``methods`` are the bodies of
    its [[methods]] tables, ``exports`` the formats of its [[exports]]; ``calibration``: 64 x 128
    tokens of the shipped c4 text (what GPTQ needs). Written to ``folder/<name>.toml``."""
    if corpus is None:
        corpus, _ = study_data_files(folder)
    text = f'''name = "{name}"
models = ["{model}"]
seeds = [0]
targets = ["cpu"]
workdir = "{workdir or f"work-{name}"}"

[evaluate]
metrics = ["perplexity"]
langs = []
wikitext = false
corpora = ["{corpus}"]
seqlen = 32
ppl_windows = {ppl_windows}
threads = 1
'''
    if calibration:
        text += '\n[calibration]\ndataset = "c4"\nnsamples = 64\nseqlen = 128\n'
    text += "".join(f"\n[[methods]]\n{m}\n" for m in methods)
    text += "".join(f"\n[[exports]]\nformat = {e}\n" for e in exports)
    f = folder / f"{name}.toml"
    f.write_text(text)
    return f


def single_scheme_transformers() -> bool:
    """transformers 5.21+ decodes every dense layer of a compressed-tensors checkpoint with one config
    group's scheme (``get_dense_scheme``); 5.17-5.20 give each layer its own group's."""
    from transformers.integrations import compressed_tensors as integration

    return hasattr(integration, "get_dense_scheme")

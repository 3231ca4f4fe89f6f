import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import calib_text, save_tiny  # noqa: E402

# Tests never reach a hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
def calib_file(tmp_path_factory) -> Path:
    return calib_text(tmp_path_factory.mktemp("calib") / "calib.txt")


def shared_data() -> Path | None:
    root = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
    return root if root.is_dir() else None


needs_shared_data = pytest.mark.skipif(shared_data() is None, reason="../shared/data is not beside the checkout")


def small_recipe(calib_file, **kw):
    from slmedge.compress.recipe import Recipe

    base = dict(group_size=32, calibration=str(calib_file), nsamples=6, seqlen=32, batch_size=4, awq_grid=4)
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


def one_line_error(result, *words):
    """A CLI failure printed as one 'error:' line (no traceback) naming ``words``."""
    assert result.exit_code != 0
    text = result.output.strip()
    assert text.startswith("error:") and "Traceback" not in text, text
    for w in words:
        assert w in text, text

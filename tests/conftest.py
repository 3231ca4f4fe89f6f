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

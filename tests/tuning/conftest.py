"""Fixtures of the tuning tests: the toy op module, and isolated config/cache folders."""

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture
def toy():
    spec = importlib.util.spec_from_file_location("pdlab_tuning_toy", HERE / "toy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.register()
    return mod


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """PDLAB_CONFIG_DIR and PDLAB_CACHE_DIR in tmp; tuned lookup caches cleared before and after."""
    from pdlab.kernels import tuned

    monkeypatch.setenv("PDLAB_CONFIG_DIR", str(tmp_path / "configs"))
    monkeypatch.setenv("PDLAB_CACHE_DIR", str(tmp_path / "cache"))
    tuned.clear_cache()
    yield tmp_path
    tuned.clear_cache()

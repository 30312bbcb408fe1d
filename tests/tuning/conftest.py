"""Fixtures of the tuning tests: the toy op module, and isolated config/cache folders."""

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture
def toy():
    """The toy op module, registered; its ops are removed from the registry afterwards so other
    tests in the same process see the registry as the package builds it."""
    from pdlab.kernels import registry
    from pdlab.tuning import target

    spec = importlib.util.spec_from_file_location("pdlab_tuning_toy", HERE / "toy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.register()
    yield mod
    for op in (mod.OP, mod.COLLECTIVE):
        registry._REGISTRY.pop(op, None)
        target._TARGETS.pop(op, None)
    registry._PROBE_CACHE.clear()


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """PDLAB_CONFIG_DIR and PDLAB_CACHE_DIR in tmp; tuned lookup caches cleared before and after."""
    from pdlab.kernels import tuned

    monkeypatch.setenv("PDLAB_CONFIG_DIR", str(tmp_path / "configs"))
    monkeypatch.setenv("PDLAB_CACHE_DIR", str(tmp_path / "cache"))
    tuned.clear_cache()
    yield tmp_path
    tuned.clear_cache()

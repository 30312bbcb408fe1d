"""`--config FILE` edge cases: a key that is not a string, the same setting spelt twice (kebab and snake), a
directory instead of a file. Each is a ConfigError naming the file and what to fix, never an AttributeError
or a silent choice between two values."""

from __future__ import annotations

import pytest

from pdlab.runtime.config import ConfigError, ServerConfig, build_config


def test_non_string_key_is_named(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("page_size: 16\n1: 2\n")
    with pytest.raises(ConfigError, match=r"s\.yaml.*1.*not a setting name"):
        build_config(ServerConfig, str(f))


def test_same_setting_twice_is_refused(tmp_path):
    f = tmp_path / "s.json"
    f.write_text('{"page-size": 16, "page_size": 32}')
    with pytest.raises(ConfigError, match=r"s\.json.*page-size.*page_size.*once"):
        build_config(ServerConfig, str(f))


def test_directory_is_not_called_missing(tmp_path):
    with pytest.raises(ConfigError, match=r"is a directory"):
        build_config(ServerConfig, str(tmp_path))


def test_flags_still_override_the_file(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("page-size: 3\nmax_running_requests: 8\n")
    cfg = build_config(ServerConfig, str(f), page_size=16)
    assert cfg.page_size == 16 and cfg.max_running_requests == 8

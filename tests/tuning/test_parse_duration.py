"""`tune --budget` / `--bucket-budget` durations: units, the no-limit spellings, bad text."""

import pytest

from pdlab.tuning.command import parse_duration


@pytest.mark.parametrize("text, seconds", [("90s", 90.0), ("10m", 600.0), ("1.5h", 5400.0), ("300", 300.0),
                                           (" 2m ", 120.0), (".5s", 0.5)])
def test_units(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", [None, "", "none", "NONE", "inf", "0", "0s", "0m", "0.0h"])
def test_no_limit_spellings_agree(text):
    # every spelling of zero is no limit at the parser already (the search also reads 0.0 as none)
    assert parse_duration(text) is None


@pytest.mark.parametrize("text", ["ten minutes", "10 min", "-5s", "5d"])
def test_bad_text_names_the_value(text):
    with pytest.raises(ValueError, match="write e.g. 90s, 10m, 1h"):
        parse_duration(text)

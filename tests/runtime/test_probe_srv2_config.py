"""`runtime serve --api-key` with a key no client can send."""

import pytest

from pdlab.runtime.config import ConfigError, ServerConfig, build_config
from pdlab.runtime.cli import main


@pytest.mark.parametrize("key, says", [("", "is empty"), ("   ", "is empty"), (" secret", "has whitespace")])
def test_an_api_key_no_client_can_send_is_refused(key, says):
    """`--api-key "$KEY"` with KEY unset served every request without a key, as if no --api-key was given, and said
    nothing; a key with spaces around it was never matched (the header's token is stripped), so every request got a
    401. Both are refused at start, naming the flag."""
    with pytest.raises(ConfigError, match=f"--api-key {says}"):
        build_config(ServerConfig, api_key=key)
    assert build_config(ServerConfig, api_key="secret").api_key == "secret"


def test_serve_exits_2_on_an_empty_api_key(capsys):
    assert main(["serve", "--device", "cpu", "--api-key", "", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--api-key is empty" in err and "Traceback" not in err, err

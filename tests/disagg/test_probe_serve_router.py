"""The router's own errors follow the servers' OpenAI error shape {"error": {"message", "type", "param", "code"}}:
an unknown route or a wrong method was FastAPI's bare {"detail": "Not Found"}."""

import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from test_router import Fake, _router, servers  # noqa: E402,F401


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    return err


def test_router_errors_have_the_openai_shape(servers):  # noqa: F811
    p, d = Fake("p0"), Fake("d0")
    url, router = _router(servers, *([u] for u in servers(p, d)))
    with httpx.Client(timeout=10) as c:
        err = _openai_error(c.get(f"{url}/v1/nothing"), 404)
        assert err["type"] == "not_found_error" and "/v1/nothing" in err["message"]
        err = _openai_error(c.get(f"{url}/v1/completions"), 405)
        assert "POST" in err["message"]
        d.healthy = False
        deadline = time.monotonic() + 5
        while router.decode[0].healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        err = _openai_error(c.post(f"{url}/v1/completions", json={"prompt": "x"}), 503)
        assert err["type"] == "service_unavailable"

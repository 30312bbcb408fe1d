"""Bodies that are not a JSON object get a 400 that says so: malformed JSON names the character where parsing
failed (its `param` was that offset as a string, "15"), and an empty body or a JSON array / null says the body must
be a JSON object (it was a bare "Field required" / "Input should be a valid dictionary ...")."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_api import client, server  # noqa: E402,F401  (fixtures: a toy server per module)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
@pytest.mark.parametrize("raw,needle", [
    (b'{"prompt": "x",', "malformed JSON body at character 15"),
    (b"hello", "malformed JSON body at character 0"),
    (b"", "the request body is empty; send a JSON object"),
    (b"[1, 2]", "the request body must be a JSON object, got an array"),
    (b"null", "the request body must be a JSON object, got null"),
    (b'"text"', "the request body must be a JSON object, got a string"),
])
def test_a_body_that_is_not_a_json_object_is_a_clear_400(client, path, raw, needle):
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["param"] is None and err["type"] == "invalid_request_error" and err["code"] == 400
    assert client.get("/health").status_code == 200


def test_json_without_a_json_content_type_says_which_header_to_send(client):
    r = client.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": 2}',
                    headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
@pytest.mark.parametrize("raw,needle", [
    (b'{"prompt": "\xff\xfe"}', "the request body is not valid UTF-8: byte 0xff at position 12"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "the JSON body nests arrays and objects too deeply"),
])
def test_a_body_json_cannot_read_says_why(client, path, raw, needle):
    """Bytes that are no UTF-8 and nesting past the JSON reader's depth were 'There was an error parsing the body'."""
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["type"] == "invalid_request_error" and err["code"] == 400

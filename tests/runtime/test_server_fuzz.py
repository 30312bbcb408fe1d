"""Fuzz the HTTP API from the OpenAPI schema FastAPI publishes: for every POST body schema, a bounded,
seeded set of requests with each field given wrong types, out-of-range values, missing required
fields and unknown fields (also inside nested objects), plus malformed bodies. Zero 5xx allowed, the
server keeps serving, and no KV page leaks."""

import json
import random
import time

import httpx
import pytest
import torch

from pdlab.runtime.config import ServerConfig, build_config
from pdlab.runtime.engine.testing import load_toy
from pdlab.runtime.server.serve import Server

BAD_VALUES = [None, True, False, 0, -1, 1, 2**31, 2**64, -2**63, 1e308, -1e308, 0.5, -0.5, "", "x", "\u0000\ud7ff", "\ud800",
              "a" * 5000, [], [None], [1, "a"], {}, {"k": 1}, [[[[]]]]]
MAX_REQUESTS = 2000
TIME_BUDGET_S = 40.0


def _resolve(schema, spec):
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].split("/")[-1]]
    return schema


def _valid(schema, spec, rng, depth=0):
    """A small value the schema accepts (used as the base that mutations start from)."""
    schema = _resolve(schema, spec)
    if "anyOf" in schema:
        opts = [o for o in schema["anyOf"] if o.get("type") != "null"] or schema["anyOf"]
        return _valid(rng.choice(opts), spec, rng, depth)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    t = schema.get("type")
    if t == "object":
        props = schema.get("properties", {})
        out = {k: _valid(props[k], spec, rng, depth + 1) for k in schema.get("required", [])}
        for k in ("max_tokens", "max_new_tokens"):
            if k in props:
                out[k] = 2
        if "messages" in props:
            out["messages"] = [{"role": "user", "content": "hi"}]
        return out
    if t == "array":
        return [_valid(schema.get("items", {}), spec, rng, depth + 1) for _ in range(max(1, schema.get("minItems", 1)))]
    if t == "string":
        return "hello"
    if t == "integer":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", 0) + 1 if "exclusiveMinimum" in schema else 1)
        return max(1, int(lo)) if "maximum" not in schema else int(schema["maximum"])
    if t == "number":
        return 0.0 if schema.get("minimum", 0) <= 0 <= schema.get("maximum", 1) else schema.get("minimum", 1.0)
    if t == "boolean":
        return False
    return "hello"


def _boundary(schema, spec):
    """Values just outside a number field's bounds."""
    schema = _resolve(schema, spec)
    out = []
    for opt in schema.get("anyOf", [schema]):
        opt = _resolve(opt, spec)
        for key, delta in (("minimum", -1), ("exclusiveMinimum", 0), ("maximum", 1), ("exclusiveMaximum", 0)):
            if key in opt:
                out.append(opt[key] + delta)
    return out


def _mutations(op_schema, spec, rng):
    """(description, body) pairs for one request body schema."""
    base = _valid(op_schema, spec, rng)
    schema = _resolve(op_schema, spec)
    props = schema.get("properties", {})
    yield "base", base
    yield "unknown field", {**base, "definitely_not_a_field": 1}
    for req in schema.get("required", []):
        yield f"missing {req}", {k: v for k, v in base.items() if k != req}
    for name, sub in props.items():
        for v in BAD_VALUES + _boundary(sub, spec):
            yield f"{name}={str(v)[:20]}", {**base, name: v}
        sub_r = _resolve(sub, spec)
        nested = [o for o in sub_r.get("anyOf", [sub_r]) if _resolve(o, spec).get("type") == "object"]
        for obj in nested:
            inner = _valid(obj, spec, rng)
            iprops = _resolve(obj, spec).get("properties", {})
            yield f"{name}.unknown", {**base, name: {**inner, "nope": True}}
            for iname, isub in iprops.items():
                for v in rng.sample(BAD_VALUES, 6) + _boundary(isub, spec):
                    yield f"{name}.{iname}={str(v)[:20]}", {**base, name: {**inner, iname: v}}
        items = sub_r.get("items")
        if items is not None and _resolve(items, spec).get("type") == "object":
            for iname in _resolve(items, spec).get("properties", {}):
                for v in rng.sample(BAD_VALUES, 5):
                    item = _valid(items, spec, rng)
                    yield f"{name}[].{iname}={str(v)[:20]}", {**base, name: [{**item, iname: v}]}
    for raw in (b"", b"{", b"[]", b"null", b"42", b'"s"', b"\xff\xfe", b"[" * 500 + b"]" * 500, b'{"a":' * 50):
        yield f"raw {raw[:10]!r}", raw


@pytest.fixture(scope="module")
def server():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    m, tok, cfg = load_toy(max_position_embeddings=256)
    sc = build_config(ServerConfig, device="cpu", port=0, page_size=16, max_total_tokens=1024, max_context_len=256)
    srv = Server(sc, model=m, tokenizer=tok, model_config=cfg)
    srv.start()
    yield srv
    srv.stop()
    torch.set_num_threads(n)


def test_fuzz_from_openapi_schema_gives_no_5xx(server):
    rng = random.Random(1234)
    base = f"http://127.0.0.1:{server.port}"
    with httpx.Client(base_url=base, timeout=30) as c:
        spec = c.get("/openapi.json").json()
        cases = []
        for path, ops in spec["paths"].items():
            op = ops.get("post")
            if not op or "requestBody" not in op:
                continue
            schema = op["requestBody"]["content"]["application/json"]["schema"]
            cases += [(path, d, b) for d, b in _mutations(schema, spec, rng)]
        assert {p for p, _, _ in cases} >= {"/v1/completions", "/v1/chat/completions", "/generate"}
        # every top-level field mutation runs; nested ones are sampled to stay inside the bound
        top = [c for c in cases if "." not in c[1].split("=")[0] and "[]" not in c[1]]
        nested = [c for c in cases if c not in top]
        rng.shuffle(nested)
        cases = top + nested[:max(0, MAX_REQUESTS - len(top))]
        rng.shuffle(cases)
        print("fuzz cases: top-level", len(top), "nested", len(nested), "running", len(cases))
        t0 = time.time()
        statuses, fails = {}, []
        for path, desc, body in cases:
            if time.time() - t0 > TIME_BUDGET_S:
                break
            if isinstance(body, bytes):
                r = c.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = c.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code >= 500:
                fails.append((path, desc, r.status_code, r.text[:200]))
            elif r.status_code >= 400:
                err = r.json()["error"]
                assert err["message"] and err["code"] == r.status_code, (path, desc, r.text)
        print("fuzz statuses", statuses, "cases", len(cases), "seconds", round(time.time() - t0, 1))
        assert not fails, fails[:5]
        assert sum(statuses.values()) == len(cases), statuses  # all ran inside the time budget  # enough cases ran inside the time budget
        assert statuses.get(400, 0) > 100 and statuses.get(200, 0) > 5, statuses
        assert c.get("/health").status_code == 200
        ok = c.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200
    pool = server.engine.pool
    deadline = time.time() + 10
    while pool.num_free_pages != pool.allocator.capacity and time.time() < deadline:
        time.sleep(0.05)
    assert pool.num_free_pages == pool.allocator.capacity

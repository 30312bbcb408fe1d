"""`bench serving`: metric definitions on hand-made timings, and a real run against `runtime serve`'s
app (toy model) on an ephemeral port, checking counts and the written JSON/CSV/PNG."""

import argparse
import json

import pytest
import torch

from pdlab.bench import serving
from pdlab.bench.serving import RequestResult, parse_goodput, random_requests, shared_prefix_requests, summarize


def test_definitions_on_hand_made_timings():
    a = RequestResult(prompt_len=10, output_len_requested=5, success=True, ttft=0.1, latency=0.5,
                      itl=[0.1, 0.1, 0.1, 0.1], output_tokens=5)
    b = RequestResult(prompt_len=20, output_len_requested=3, success=True, ttft=2.0, latency=2.2,
                      itl=[0.1, 0.1], output_tokens=3)
    c = RequestResult(prompt_len=5, output_len_requested=3, success=False, error="boom")
    s = summarize([a, b, c], duration=4.0, slos={"ttft": 1000, "tpot": 150})
    assert s["completed"] == 2 and s["failed"] == 1
    assert a.tpot == pytest.approx(0.1) and b.tpot == pytest.approx(0.1)
    assert s["mean_ttft_ms"] == pytest.approx(1050) and s["median_tpot_ms"] == pytest.approx(100)
    assert s["mean_e2e_ms"] == pytest.approx(1350)
    assert s["request_throughput"] == pytest.approx(0.5) and s["output_throughput"] == pytest.approx(2.0)
    assert s["total_token_throughput"] == pytest.approx((30 + 8) / 4)
    assert s["goodput"] == pytest.approx(0.25)  # only a meets ttft <= 1000 ms
    assert summarize([a], 1.0, {})["goodput"] is None


def test_random_dataset_and_goodput_parsing():
    reqs = random_requests(50, 100, 20, 0.5, 1000, seed=3)
    assert all(50 <= len(p) <= 100 and 10 <= o <= 20 for p, o in reqs)
    assert random_requests(50, 100, 20, 0.5, 1000, seed=3) == reqs
    assert all(len(p) == 100 for p, _ in random_requests(5, 100, 20, 1.0, 1000, seed=1))
    assert parse_goodput(["ttft:5000", "tpot:50"]) == {"ttft": 5000.0, "tpot": 50.0}
    with pytest.raises(ValueError, match="KEY:MS"):
        parse_goodput(["latency:5"])


def _args(**kw):
    p = argparse.ArgumentParser()
    serving.add_arguments(p)
    return p.parse_args([x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", *(
        [] if v is None else [str(v)] if not isinstance(v, list) else [str(i) for i in v]))])


def test_against_a_live_server(tmp_path):
    from pdlab.runtime.config import ServerConfig, build_config
    from pdlab.runtime.engine.testing import load_toy
    from pdlab.runtime.server.serve import Server
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    m, tok, cfg = load_toy(max_position_embeddings=256)
    srv = Server(build_config(ServerConfig, device="cpu", port=0, page_size=16, max_total_tokens=2048,
                              max_context_len=256), model=m, tokenizer=tok, model_config=cfg)
    srv.start()
    try:
        # no --vocab-size: the prompts' token ids come from the vocab_size the server publishes (the toy's is below
        # the fallback 1000, so a server that did not say would answer every request with a 400)
        args = _args(base_url=f"http://127.0.0.1:{srv.port}", num_prompts=12, random_input_len=40,
                     random_output_len=10, random_range_ratio=0.5, request_rate=50, max_concurrency=4,
                     goodput=["ttft:60000", "tpot:60000"], out=tmp_path, tag="t")
        assert serving._get_model(args)["vocab_size"] == cfg.vocab_size < 1000
        assert serving.run(args) == 0
    finally:
        srv.stop()
        torch.set_num_threads(n)
    data = json.loads((tmp_path / "t.json").read_text())
    s = data["summary"]
    assert s["completed"] == 12 and s["failed"] == 0 and s["usage_reported"]
    outs = [r["output_len_requested"] for r in data["requests"]]
    assert s["total_output_tokens"] == sum(outs)  # ignore_eos: every request produced what it asked for
    assert s["goodput"] == pytest.approx(s["request_throughput"])
    assert 0 < s["median_ttft_ms"] <= s["p99_ttft_ms"] and s["mean_tpot_ms"] > 0 and s["mean_itl_ms"] > 0
    assert (tmp_path / "t.csv").exists() and (tmp_path / "t_summary.csv").exists()
    assert (tmp_path / "t_latency.png").stat().st_size > 1000


def test_shared_prefix_dataset():
    reqs = shared_prefix_requests(7, 3, 50, 20, 5, 1.0, 1000, seed=2)
    heads = [tuple(p[:50]) for p, _ in reqs]
    assert len(set(heads)) == 3 and heads[0] == heads[3] == heads[6] and heads[1] == heads[4]
    assert [p[50:] for p, _ in reqs] == [p for p, _ in random_requests(7, 20, 5, 1.0, 1000, seed=2)]
    assert shared_prefix_requests(7, 3, 50, 20, 5, 1.0, 1000, seed=2) == reqs
    with pytest.raises(ValueError, match="must be >= 1"):
        shared_prefix_requests(2, 0, 50, 20, 5, 1.0, 1000, seed=2)


def test_shared_prefix_load_against_a_server_with_prefix_caching(tmp_path, capsys):
    """The shared-prefix dataset through a live server with --enable-prefix-caching: every request completes and
    the server serves the shared system prompts from its cache."""
    from pdlab.runtime.config import ServerConfig, build_config
    from pdlab.runtime.engine.testing import load_toy
    from pdlab.runtime.server.serve import Server
    m, tok, cfg = load_toy(max_position_embeddings=256)
    srv = Server(build_config(ServerConfig, device="cpu", port=0, page_size=16, max_total_tokens=2048,
                              max_context_len=256, enable_prefix_caching=True),
                 model=m, tokenizer=tok, model_config=cfg)
    srv.start()
    try:
        args = _args(base_url=f"http://127.0.0.1:{srv.port}", dataset="shared-prefix", shared_prefix_len=64,
                     shared_prefix_groups=2, num_prompts=8, random_input_len=20, random_output_len=4,
                     max_concurrency=2, out=tmp_path, tag="sp", no_plot=None)
        assert serving.run(args) == 0
        hits = srv.loop.scheduler.prefix_cache.hit_tokens
    finally:
        srv.stop()
    data = json.loads((tmp_path / "sp.json").read_text())
    assert data["summary"]["completed"] == 8 and data["meta"]["shared_prefix_len"] == 64
    assert hits >= 4 * 48, hits  # the later requests of each group read its system prompt's whole pages
    bad = _args(base_url="http://127.0.0.1:9", shared_prefix_len=64, out=tmp_path)
    assert serving.run(bad) == 2 and "add --dataset shared-prefix" in capsys.readouterr().err


def test_unreachable_server_is_a_clean_error(tmp_path, capsys):
    args = _args(base_url="http://127.0.0.1:9", num_prompts=1, out=tmp_path)
    assert serving.run(args) == 1
    assert "is the server up" in capsys.readouterr().err

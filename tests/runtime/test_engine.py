"""Engine: step tensors built from a batch (checked by hand), page-table sync, the start-up report,
and the real embedded model served under KV pressure (page 64, fp8) with identical greedy outputs."""

import pytest
import torch

from pdlab.runtime.config import ConfigError, SchedulerConfig, build_config
from pdlab.runtime.core import Batch, Req, SamplingParams
from pdlab.runtime.engine.engine import Engine
from pdlab.runtime.engine.loop import LLM
from pdlab.runtime.engine.testing import load_toy




def _engine(page=4, total=64):
    m, tok, cfg = load_toy(max_position_embeddings=32)
    return Engine(build_config(SchedulerConfig, device="cpu", page_size=page, max_total_tokens=total), m, tok, cfg,
                  max_running_requests=4)


def test_prefill_step_tensors():
    eng = _engine()
    a = Req(list(range(10, 16)), SamplingParams())  # 6 tokens, chunk of 4 already cached
    a.cached_len = 4
    a.pages = [3, 7]
    b = Req(list(range(20, 23)), SamplingParams())  # 3 new tokens
    b.pages = [5]
    batch = Batch([a, b], [2, 3], is_decode=False)
    eng.page_table.sync([a, b])
    ids, pos, ctx = eng.prepare(batch)
    assert ids.tolist() == [14, 15, 20, 21, 22]
    assert pos.tolist() == [4, 5, 0, 1, 2]
    assert ctx.slots.tolist() == [7 * 4 + 0, 7 * 4 + 1, 5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2]
    assert ctx.seqlens.tolist() == [6, 3] and ctx.qo_indptr.tolist() == [0, 2, 5]
    assert ctx.logits_indices.tolist() == [1, 4] and ctx.max_q_len == 3 and not ctx.is_decode
    assert ctx.block_table.tolist() == [[3, 7], [5, 0]] or ctx.block_table[:, :1].tolist() == [[3], [5]]
    assert ctx.block_table.dtype == torch.int32 and ctx.seqlens.dtype == torch.int32
    assert batch.samples(0) and batch.samples(1)


def test_decode_step_tensors_and_incremental_table():
    eng = _engine()
    r = Req([1, 2, 3, 4, 5], SamplingParams())
    r.output_ids = [9]
    r.cached_len = 5
    r.pages = [2, 6]
    eng.page_table.sync([r])
    assert r.table_len == 2
    ids, pos, ctx = eng.prepare(Batch([r], [1], is_decode=True))
    assert ids.tolist() == [9] and pos.tolist() == [5] and ctx.slots.tolist() == [6 * 4 + 1]
    assert ctx.seqlens.tolist() == [6] and ctx.is_decode and ctx.qo_indptr.tolist() == [0, 1]
    r.pages.append(11)
    eng.page_table.sync([r])
    assert eng.page_table.table[r.table_row, :3].tolist() == [2, 6, 11]
    eng.page_table.release(r)
    assert r.table_row == -1


def test_forward_refuses_a_request_without_pages():
    eng = _engine()
    r = Req([1, 2, 3, 4, 5], SamplingParams())
    r.pages = [1]
    with pytest.raises(RuntimeError, match="must allocate"):
        eng.forward(Batch([r], [5], is_decode=False))


def test_describe_names_backends_and_config_source():
    lines = _engine().describe()
    assert any("KV" in line and "pages" in line for line in lines)
    assert any(line.startswith("op mla_decode: backend") and "config" in line for line in lines)


def test_describe_reports_the_models_own_moe_runner_and_dispatcher():
    """The start-up report names what the model's MoE layers were built with, not the registry's
    generic preference (which may be a dispatcher the model does not use)."""
    from pdlab.runtime.engine.engine import Engine
    from pdlab.runtime.config import EngineConfig
    from pdlab.runtime.model import LoadOptions

    model, tok, cfg = _real_model()
    eng = Engine(EngineConfig(device="cpu", max_total_tokens=4096, page_size=16), model, tok, cfg)
    lines = eng.describe()
    assert "op moe_dispatch (model): normal: local" in lines
    assert any(ln.startswith("op moe_experts (model): runner normal: ") for ln in lines)
    assert not any(ln.startswith("op moe_dispatch:") for ln in lines)
    model2, _, _ = load_model_with(LoadOptions(moe_runner="torch", moe_decode_mode="low_latency"))
    lines = Engine(EngineConfig(device="cpu", max_total_tokens=4096, page_size=16), model2, tok, cfg).describe()
    assert "op moe_dispatch (model): normal: local, low_latency: local" in lines
    assert "runner normal: torch, low_latency: torch" in " ".join(lines)


def load_model_with(options):
    from pdlab.runtime.model import load_model

    return load_model(None, "cpu", torch.float32, options=options)


def _real_model():
    try:
        from pdlab.runtime.model import load_model
    except ImportError as exc:
        pytest.skip(f"pdlab.runtime.model not importable: {exc}")
    return load_model(None, "cpu", torch.float32)


def test_embedded_model_greedy_identical_under_pressure(monkeypatch):
    monkeypatch.setenv("PDLAB_CHECK_INVARIANTS", "1")
    model, tok, cfg = _real_model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (50, 57, 44, 61, 30)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(device="cpu", page_size=64, kv_dtype="fp8", kv_scale=0.02, max_context_len=128,
                  chunked_prefill_size=16, max_prefill_tokens=32)
    ref = LLM(model=model, tokenizer=tok, model_config=cfg, max_total_tokens=4096, **common).generate(prompts, sp)
    llm = LLM(model=model, tokenizer=tok, model_config=cfg, max_total_tokens=192, decode_reserve_tokens=0, **common)
    got = llm.generate(prompts, sp)
    assert llm.scheduler.num_retractions >= 2
    assert [g["token_ids"] for g in got] == [r["token_ids"] for r in ref]
    assert llm.engine.pool.num_free_pages == llm.engine.pool.allocator.capacity


def test_perf_helpers_run_and_leave_no_pages(monkeypatch):
    from pdlab.runtime.engine import perf
    m, tok, cfg = load_toy(max_position_embeddings=128)
    llm = LLM(model=m, tokenizer=tok, model_config=cfg, device="cpu", page_size=16, max_total_tokens=1024,
              max_context_len=128, max_running_requests=4)
    rows = perf.decode_throughput(llm, [1, 3], context=20, steps=2, warmup=1)
    chained = llm.scheduler.num_chained
    syncs = []
    real_sync = perf._sync
    monkeypatch.setattr(perf, "_sync", lambda d: (syncs.append(d), real_sync(d)))
    rows += perf.decode_throughput(llm, [3], context=20, steps=3, warmup=1, overlap=True)
    assert len(syncs) == 2  # overlap: one sync before the measured steps, one after; none between them
    assert [r["batch"] for r in rows] == [1, 3, 3] and all(r["tok_per_s"] > 0 for r in rows)
    # overlap: each measured step launched the next one before processing its own (the time divides a pipelined
    # run by its steps, so a step that did not chain would make it look faster)
    assert llm.scheduler.num_chained - chained >= 3
    t = perf.ttft(llm, 40, repeats=1)
    assert t["ttft_ms"] > 0
    assert llm.engine.pool.num_free_pages == llm.engine.pool.allocator.capacity and not llm.scheduler.by_rid


def test_host_profile_names_the_scheduler_step(tmp_path):
    from pdlab.runtime.engine import perf
    m, tok, cfg = load_toy(max_position_embeddings=128)
    llm = LLM(model=m, tokenizer=tok, model_config=cfg, device="cpu", page_size=16, max_total_tokens=1024,
              max_context_len=128, max_running_requests=4)
    perf._profile_host(llm, 3, 20, 2, False, tmp_path / "p.txt")
    text = (tmp_path / "p.txt").read_text()
    assert text.startswith("decode steps at batch 3") and "scheduler.py" in text and "(step)" in text
    assert llm.engine.pool.num_free_pages == llm.engine.pool.allocator.capacity and not llm.scheduler.by_rid


def test_synthetic_spec_is_validated():
    from pdlab.runtime.engine.synthetic import is_synthetic, load_synthetic, r1_config
    assert is_synthetic("synthetic:deepseek-r1:4") and not is_synthetic("/models/r1")
    with pytest.raises(ValueError, match="unknown synthetic model"):
        load_synthetic("synthetic:llama", "cpu")
    try:
        cfg = r1_config(4)
    except ImportError:
        pytest.skip("model package missing")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.n_routed_experts, cfg.num_hidden_layers) == (7168, 128, 256, 4)
    assert cfg.latent_dim == 576 and cfg.first_k_dense_replace == 1


def test_graph_runner_buffers_and_padding_on_cpu(monkeypatch):
    """The graph runner's static buffers, padding rows (dummy page-table row → page 0) and slicing,
    replayed eagerly: greedy tokens equal plain eager decode, and padded rows never touch real pages."""
    from pdlab.runtime.engine.graph import GraphRunner
    monkeypatch.setenv("PDLAB_CHECK_INVARIANTS", "1")
    prompts = ["alpha", "beta gamma", "delta epsilon zeta", "eta"]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    res = []
    for use_graph in (False, True):
        m, tok, cfg = load_toy(max_position_embeddings=128)
        llm = LLM(model=m, tokenizer=tok, model_config=cfg, device="cpu", page_size=4, max_total_tokens=512,
                  max_context_len=128, max_running_requests=8)
        if use_graph:
            llm.engine.graphs = GraphRunner(llm.engine, [2, 8], capture=False)  # 3 and 4 requests pad to 8
        res.append(llm.generate(prompts, sp))
        if use_graph:
            assert llm.engine.graphs.rows.tolist()[4:] == [llm.engine.page_table.dummy_row] * 4
    assert [r["token_ids"] for r in res[0]] == [r["token_ids"] for r in res[1]]


def test_prefill_graph_runner_padding_on_cpu(monkeypatch):
    """Prefill graphs' static buffers, empty sequences and padding sequence, replayed eagerly: the same greedy tokens
    as plain eager prefill, for whole prompts, several prompts in one step and the chunks of a chunked prompt (a
    cached prefix); steps that do not fit (too many tokens, or a sequence longer than the graphs' positions) run
    eagerly. Under PDLAB_CHECK_INVARIANTS the padding never touches a real page."""
    from pdlab.runtime.engine.graph import PrefillGraphRunner
    monkeypatch.setenv("PDLAB_CHECK_INVARIANTS", "1")
    prompts = [[3 + i % 50 for i in range(n)] for n in (5, 17, 30, 2, 70)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    res, replays = [], []
    for use_graph in (False, True):
        m, tok, cfg = load_toy(max_position_embeddings=128)
        llm = LLM(model=m, tokenizer=tok, model_config=cfg, device="cpu", page_size=4, max_total_tokens=1024,
                  max_context_len=128, max_running_requests=8, chunked_prefill_size=24, max_prefill_tokens=48)
        if use_graph:
            runner = llm.engine.prefill_graphs = PrefillGraphRunner(llm.engine, [8, 16, 48], capture=False)
            assert (runner.max_seqs, runner.width, runner.positions) == (8, 12, 48)
            real = runner.replay

            def counted(batch):
                replays.append((len(batch.reqs), sum(batch.extend_lens)))
                return real(batch)

            runner.replay = counted
        res.append(llm.generate(prompts, sp))
    assert [r["token_ids"] for r in res[0]] == [r["token_ids"] for r in res[1]]
    assert replays and all(b <= 8 and t <= 48 for b, t in replays)
    # the 70-token prompt is chunked (24 a step): its chunks past 48 positions ran eagerly
    assert sum(t for _, t in replays) < sum(len(p) for p in prompts)
    with pytest.raises(ValueError, match="exceed the context"):
        PrefillGraphRunner(llm.engine, [256], capture=False)


def test_prefill_graph_logits_match_eager_on_cpu():
    """One prefill step of three prompts of the embedded DeepSeek-V3-shaped model through the padded graph path
    (12 tokens padded to 16, five empty sequences, the padding routed through the MoE layers too) gives the logits
    of the eager step. The experts run the fp32 reference: the bf16 grouped GEMM's rounding depends on how many
    rows each expert holds, which the padding changes (up to 0.016 on logits of magnitude 12)."""
    from pdlab.runtime.engine.graph import PrefillGraphRunner
    llm = LLM(device="cpu", page_size=4, max_total_tokens=512, max_context_len=64, max_running_requests=8)
    eng, vocab = llm.engine, llm.engine.vocab_size
    for layer in eng.model.model.layers:
        if layer.is_moe:
            layer.mlp.moe.runners = {"normal": "torch"}
    reqs = [Req([5 + i for i in range(n)], SamplingParams(max_tokens=1)) for n in (3, 4, 5)]
    for r in reqs:
        r.pages = eng.pool.allocate(2)
    batch = Batch(reqs, [3, 4, 5], is_decode=False)
    eng.page_table.sync(reqs)
    ids, pos, ctx = eng.prepare(batch)
    eager = eng.model.forward(ids, pos, ctx)
    runner = PrefillGraphRunner(eng, [16], capture=False)
    graph = runner.replay(batch)
    assert graph.shape == eager.shape == (3, vocab)
    torch.testing.assert_close(graph, eager, rtol=1e-4, atol=1e-4)
    assert runner.qo_indptr.tolist() == [0, 3, 7, 12, 12, 12, 12, 12, 12, 16]
    assert runner.seqlens.tolist()[-1] == 4 and runner.slots.tolist()[12:] == [-1] * 4


def test_a_failed_replan_runs_the_step_eagerly_not_a_stale_graph(monkeypatch, caplog):
    """A host-planned backend in a decode graph is re-planned before each replay with the step's host lengths
    (padding rows: one token). If that re-plan fails, the graph is not replayed (it would run a stale plan): the
    step runs eagerly, with the same greedy tokens, the failure is logged once per batch size and kept."""
    from pdlab.attention.ops import ReplayedCapture
    from pdlab.runtime.engine.graph import GraphRunner

    prompts = ["alpha", "beta gamma", "delta epsilon zeta"]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    m, tok, cfg = load_toy(max_position_embeddings=128)
    kw = dict(device="cpu", page_size=4, max_total_tokens=512, max_context_len=128, max_running_requests=8)
    eager = LLM(model=m, tokenizer=tok, model_config=cfg, **kw).generate(prompts, sp)
    llm = LLM(model=m, tokenizer=tok, model_config=cfg, **kw)
    runner = llm.engine.graphs = GraphRunner(llm.engine, [4], capture=False)
    seen = []

    def stale(lens):
        seen.append(lens.tolist())
        raise RuntimeError("plan info changed")

    class NotReplayed:
        def replay(self):
            raise AssertionError("a graph whose re-plan failed was replayed")

    runner.capture = True  # as captured: one graph of batch 4 holding a host-planned backend
    runner.replans[4] = ReplayedCapture(torch.ones(4, dtype=torch.int32))
    runner.replans[4].register("backend", stale)
    runner.graphs[4] = NotReplayed()
    with caplog.at_level("WARNING", logger="pdlab.runtime"):
        got = llm.generate(prompts, sp)
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in eager]
    assert len(seen) >= 5 and all(len(x) == 4 and x[3] == 1 and min(x[:3]) > 1 for x in seen)  # 3 rows + 1 pad
    assert "plan info changed" in runner.replan_errors[4]
    assert sum("re-planning the batch-4 decode graph failed" in r.message for r in caplog.records) == 1


def test_synthetic_loader_path_with_a_small_shape(monkeypatch):
    """The synthetic loader's calls into the model package (RandomSource, build_model, NVFP4 experts),
    checked at the tiny shape so the full-width GPU run does not discover an API mismatch."""
    from dataclasses import replace
    from pdlab.runtime.engine import synthetic
    try:
        from pdlab.runtime.model.tiny import TINY_CONFIG
    except ImportError as exc:
        pytest.skip(f"model package missing: {exc}")
    monkeypatch.setattr(synthetic, "r1_config", lambda n: replace(TINY_CONFIG, num_hidden_layers=n))
    model, tok, cfg = synthetic.load_synthetic("synthetic:deepseek-r1:2", "cpu", torch.float32)
    assert tok is None and cfg.num_hidden_layers == 2
    llm = LLM(model=model, tokenizer=None, model_config=cfg, device="cpu", page_size=16, max_total_tokens=512,
              max_context_len=256)
    out = llm.generate([list(range(3, 40))], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0]["token_ids"]) == 3 and out[0]["text"] == ""


def test_serve_rejects_a_bad_model_spec(capsys):
    from pdlab.runtime.cli import main
    assert main(["serve", "--device", "cpu", "--model-path", "synthetic:llama"]) == 2
    assert "unknown synthetic model" in capsys.readouterr().err


# ---- settings that conflict with the model or the device, refused before anything is allocated -----------------

def test_max_context_len_beyond_the_models_context_is_refused_unless_opted_in(caplog):
    """A context above max_position_embeddings was served with only a warning; it is now an error naming both numbers
    and the opt-in, and with the opt-in it serves (warning kept) past the model's positions."""
    from pdlab.runtime.config import ConfigError
    m, tok, cfg = load_toy(max_position_embeddings=32)
    settings = dict(device="cpu", page_size=4, max_total_tokens=256, max_context_len=64)
    with pytest.raises(ConfigError) as e:
        Engine(build_config(SchedulerConfig, **settings), m, tok, cfg)
    msg = str(e.value)
    assert "max_context_len 64" in msg and "32 tokens (max_position_embeddings 32)" in msg
    assert "--allow-long-context" in msg and "at most 32" in msg
    with caplog.at_level("WARNING", logger="pdlab.runtime"):
        llm = LLM(model=m, tokenizer=tok, model_config=cfg, allow_long_context=True, **settings)
    assert llm.engine.max_context_len == 64 and "allow_long_context is set" in caplog.text
    out = llm.generate([list(range(40))], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert len(out[0]["token_ids"]) == 10
    at_limit = build_config(SchedulerConfig, **{**settings, "max_context_len": 32})
    assert Engine(at_limit, m, tok, cfg).max_context_len == 32


def test_an_engine_that_loads_its_model_checks_the_context_once(caplog):
    """The engine that loads the model itself checks the context against the model's config before the load and
    not again after it: the opt-in's warning is logged once."""
    settings = dict(device="cpu", page_size=64, max_total_tokens=8192, max_context_len=8192, allow_long_context=True)
    with caplog.at_level("WARNING", logger="pdlab.runtime"):
        eng = Engine(build_config(SchedulerConfig, **settings))  # the embedded tiny model: context 4096
    assert eng.max_context_len == 8192
    assert caplog.text.count("allow_long_context is set") == 1, caplog.text


def test_yarn_scaling_sets_the_context_limit():
    """With YaRN the model's context is original_max_position_embeddings × factor where that exceeds
    max_position_embeddings (vLLM derives it the same way); one token more is refused."""
    from dataclasses import replace
    from pdlab.runtime.config import ConfigError
    from pdlab.runtime.engine.engine import context_limit
    from pdlab.runtime.engine.synthetic import r1_config
    from pdlab.runtime.model.tiny import TINY_CONFIG
    assert context_limit(TINY_CONFIG) == (4096, "max_position_embeddings 4096")
    assert context_limit(r1_config(2))[0] == 163840
    short = replace(TINY_CONFIG, max_position_embeddings=1024)  # YaRN factor 4 over 1024 original positions
    assert context_limit(short) == (4096, "YaRN original_max_position_embeddings 1024 × factor 4 = 4096")
    m, tok, _ = load_toy()
    kw = dict(device="cpu", page_size=64, max_total_tokens=8192)
    assert Engine(build_config(SchedulerConfig, max_context_len=4096, **kw), m, tok, short).max_context_len == 4096
    with pytest.raises(ConfigError, match=r"max_context_len 4097 exceeds the model's context of 4096 tokens \(YaRN"):
        Engine(build_config(SchedulerConfig, max_context_len=4097, **kw), m, tok, short)
    assert context_limit(load_toy(max_position_embeddings=77)[2]) == (77, "max_position_embeddings 77")


def test_serve_refuses_a_long_context_before_loading_the_model(monkeypatch, capsys):
    from pdlab.runtime import model as model_pkg
    from pdlab.runtime.cli import main
    from pdlab.runtime.model import tiny

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(model_pkg, "load_model", no_load)
    monkeypatch.setattr(tiny, "load_tiny", no_load)
    assert main(["serve", "--device", "cpu", "--max-context-len", "5000"]) == 2
    err = capsys.readouterr().err
    assert "max_context_len 5000 exceeds the model's context of 4096 tokens" in err and "--allow-long-context" in err
    assert err.count("\n") == 1  # one line, no traceback


def test_a_kv_pool_or_page_table_that_cannot_fit_is_refused_before_allocation(monkeypatch):
    """--max-total-tokens 10**10 tried to allocate 23 TB (a torch traceback after 18 s), --max-running-requests 10**8
    a 25 GB page table; both are refused at once with the estimate and the setting to lower."""
    from pdlab.runtime.engine import engine as engine_mod
    from pdlab.runtime.memory import budget
    from pdlab.runtime.memory.budget import MemoryBudgetError

    def no_pool(*a, **k):
        raise AssertionError("the pool was allocated before the memory check")

    fake_pool = type("P", (), {"__init__": no_pool, "bytes_per_token": engine_mod.MLAKVPool.bytes_per_token})
    monkeypatch.setattr(engine_mod, "MLAKVPool", fake_pool)
    monkeypatch.setattr(budget, "available_bytes", lambda device: 8 << 30)
    m, tok, cfg = load_toy(max_position_embeddings=128)
    with pytest.raises(MemoryBudgetError) as e:
        Engine(build_config(SchedulerConfig, device="cpu", page_size=16, max_total_tokens=10**10), m, tok, cfg)
    assert "KV pool (625000001 pages of 16 tokens over 2 layers, fp32)" in str(e.value)
    assert "need about 41.91 TiB, but cpu has 8.00 GiB available; lower --max-total-tokens 10000000000" in str(e.value)
    with pytest.raises(MemoryBudgetError, match=r"page table \(1000000001 rows of 8 pages\).*lower "
                                                r"--max-running-requests 1000000000 or --max-context-len 128"):
        Engine(build_config(SchedulerConfig, device="cpu", page_size=16, max_total_tokens=1024,
                            max_running_requests=10**9), m, tok, cfg, max_running_requests=10**9)


def test_serve_refuses_an_absurd_kv_pool_in_one_line(capsys):
    from pdlab.runtime.cli import main
    assert main(["serve", "--device", "cpu", "--max-total-tokens", "10000000000"]) == 2
    err = capsys.readouterr().err
    assert "need about" in err and "lower --max-total-tokens 10000000000" in err and err.count("\n") == 1


def test_a_synthetic_model_too_large_for_the_device_is_refused_before_drawing_weights(monkeypatch):
    """synthetic:deepseek-r1:1000 on a CPU ran for minutes, 17 GB resident, towards an OOM; the weights' size is
    now estimated from the config and compared with the device's available memory first."""
    from pdlab.runtime.engine import synthetic
    from pdlab.runtime.memory import budget
    from pdlab.runtime.memory.budget import MemoryBudgetError
    from pdlab.runtime.model import loader

    def no_weights(*a, **k):
        raise AssertionError("weights were drawn before the memory check")

    monkeypatch.setattr(loader, "RandomSource", no_weights)
    monkeypatch.setattr(budget, "available_bytes", lambda device: 80 << 30)
    with pytest.raises(MemoryBudgetError) as e:
        synthetic.load_synthetic("synthetic:deepseek-r1:1000", "cpu", torch.bfloat16)
    msg = str(e.value)
    assert "the model weights (1000 layers, hidden 7168, 256 experts of 2048, vocab 129280" in msg
    assert "TiB, but cpu has 80.00 GiB available; ask for fewer layers" in msg
    with pytest.raises(MemoryBudgetError):
        synthetic.load_synthetic("synthetic:deepseek-r1:" + "9" * 30, "cpu", torch.bfloat16)  # no loop over layers


def test_weight_estimate_matches_the_loaded_tiny_model():
    """weight_bytes counts every tensor the embedded model holds (NVFP4 experts, fp32 router, W_UK / W_UV)."""
    from pdlab.runtime.model.loader import weight_bytes
    model, _, cfg = _real_model()
    storages, walked = {}, set()
    for mod in model.modules():
        stack = list(vars(mod).values())
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            elif isinstance(x, (list, tuple)):
                stack += list(x)
            elif isinstance(x, dict):
                stack += list(x.values())
            elif hasattr(x, "__dict__") and not isinstance(x, (type, torch.nn.Module)) and id(x) not in walked:
                walked.add(id(x))  # MoE layers, expert weights: plain objects holding tensors
                stack += list(vars(x).values())
    held = sum(storages.values())
    est = weight_bytes(cfg, torch.float32, nvfp4_experts=True)
    assert 0.97 * held <= est <= 1.03 * held, (est, held)


def test_generate_checks_every_prompt_before_running_any():
    """A bad prompt in the middle of a generate() call raised after the prompts before it were queued: they then ran
    (holding pages) into the next call. A params list shorter than the prompts silently dropped the extra prompts."""
    from pdlab.runtime.core import RequestError
    m, tok, cfg = load_toy(max_position_embeddings=64)
    llm = LLM(model=m, tokenizer=tok, model_config=cfg, device="cpu", page_size=16, max_total_tokens=512)
    sp = SamplingParams(temperature=0, max_tokens=8)
    with pytest.raises(RequestError, match=r"^prompt 1: prompt \(60 tokens\) \+ max_tokens \(8\) exceeds the context"):
        llm.generate(["hello", "x" * 60], sp)
    with pytest.raises(ValueError, match="got 3 prompts but 1 SamplingParams"):
        llm.generate(["a", "b", "c"], [sp])
    with pytest.raises(ValueError, match="prompt 1 must be a str or a list of int token ids, got list holding 2.5"):
        llm.generate([[1, 2], [1, 2.5]], sp)
    with pytest.raises(ValueError, match="prompt 0 must be a str or a list of int token ids, got list holding None"):
        llm.generate([[None]], sp)
    with pytest.raises(RequestError, match=r"prompt 0: prompt token ids must be in \[0, 257\)"):
        llm.generate([[1, 999]], sp)
    assert not llm.scheduler.by_rid and llm.loop._inbox.empty()
    out = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=3))
    assert len(out) == 1 and len(out[0]["token_ids"]) == 3
    assert not llm.scheduler.by_rid and llm.engine.pool.num_free_pages == llm.engine.pool.allocator.capacity


def test_generate_stopped_early_leaves_nothing_running():
    m, tok, cfg = load_toy(max_position_embeddings=64)
    llm = LLM(model=m, tokenizer=tok, model_config=cfg, device="cpu", page_size=16, max_total_tokens=512)
    with pytest.raises(RuntimeError, match="did not finish within 3 steps"):
        llm.generate(["abc", "def"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), max_steps=3)
    assert not llm.scheduler.by_rid and llm.engine.pool.num_free_pages == llm.engine.pool.allocator.capacity
    assert len(llm.generate(["x"], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]["token_ids"]) == 2


def test_serve_refuses_a_pool_smaller_than_one_request_before_loading_the_model(monkeypatch, capsys):
    """--max-total-tokens below one request of the model's context was found only after the weights had loaded
    (minutes for a real checkpoint)."""
    from pdlab.runtime import model as model_pkg
    from pdlab.runtime.cli import main
    from pdlab.runtime.model import tiny

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(model_pkg, "load_model", no_load)
    monkeypatch.setattr(tiny, "load_tiny", no_load)
    assert main(["serve", "--device", "cpu", "--max-total-tokens", "1000"]) == 2
    err = capsys.readouterr().err
    assert "fewer than one maximal request needs (64 pages for max_context_len 4096)" in err
    assert "raise --max-total-tokens to at least 4096" in err and err.count("\n") == 1


def test_a_second_request_with_an_in_flight_id_does_not_take_over_the_first():
    """EngineLoop.submit of a request whose id is in flight replaced the running request's output sink before the
    scheduler refused it: the newcomer got the error and the running request's later tokens went nowhere (its client
    waited forever)."""
    from pdlab.runtime.engine.loop import EngineLoop
    m, tok, cfg = load_toy(max_position_embeddings=64)
    llm = LLM(model=m, tokenizer=tok, model_config=cfg, device="cpu", page_size=16, max_total_tokens=512)
    loop: EngineLoop = llm.loop
    first, second = [], []
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    loop.submit(Req([5, 6, 7], sp, rid="same"), first.append)
    loop.run_once()
    loop.run_once()
    loop.submit(Req([8, 9], sp, rid="same"), second.append)
    for _ in range(20):
        loop.run_once()
    assert len(second) == 1 and second[0].finished and "already in flight" in second[0].error
    assert sum(len(o.token_ids) for o in first) == 6 and first[-1].finished and first[-1].error is None
    assert not llm.scheduler.by_rid and not loop._sinks


def test_weight_estimate_counts_one_ranks_experts_under_expert_parallelism():
    from pdlab.runtime.engine.synthetic import r1_config
    from pdlab.runtime.model.loader import weight_bytes
    cfg = r1_config(4)
    one, eight = weight_bytes(cfg, torch.bfloat16, True), weight_bytes(cfg, torch.bfloat16, True, ep_size=8)
    experts = 3 * 256 * 3 * 2048 * 7168 * (0.5 + 1 / 16)  # 3 MoE layers of 256 NVFP4 experts
    assert one - eight == pytest.approx(experts * 7 / 8, rel=1e-9)


@pytest.mark.parametrize("servers, fraction", [(2, 0.85), (3, 0.5), (4, 0.9)])
def test_servers_sharing_a_device_get_equal_kv_pools(servers, fraction):
    """Servers of one model started one after another on one device, each sizing its pool from the free memory it
    sees: every pool is the same share of `fraction` of what is left after all the weights (simulated start-up)."""
    from pdlab.runtime.engine.engine import kv_budget

    free0, weights = 100 << 30, 7 << 30
    free, pools = free0, []
    for i in range(servers):
        free -= weights  # this server loads its model, then sizes its pool
        pools.append(kv_budget(free, fraction, servers, i, weights))
        free -= pools[-1]
    want = fraction * (free0 - servers * weights) / servers
    assert pools == pytest.approx([want] * servers, rel=1e-12)
    assert free == pytest.approx((1 - fraction) * (free0 - servers * weights))  # the headroom one server keeps
    assert kv_budget(free0, fraction) == free0 * fraction  # alone: the fraction of what it sees
    assert kv_budget(weights, fraction, 2, 0, 2 * weights) == 0  # the weights to come do not fit: no pool, not < 0


def test_a_later_server_is_left_its_load_peak_not_only_its_weights(monkeypatch):
    """On a GPU the next server of the device needs its load's peak free (expert weights pass through bf16 chunks
    before they are quantized), which this process measured loading the same model: an H100 whose first server left
    the second only its weights saw the second run out of memory while loading."""
    import torch

    from pdlab.runtime.engine.engine import load_bytes

    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 9 << 30)
    assert load_bytes(7 << 30, torch.device("cuda:0")) == 9 << 30  # the peak, above the weights
    assert load_bytes(10 << 30, torch.device("cuda:0")) == 10 << 30  # never below the weights
    assert load_bytes(7 << 30, torch.device("cpu")) == 7 << 30  # the CPU: the weights (no peak is tracked)


def test_the_first_of_two_servers_on_a_device_sizes_its_pool_for_both(monkeypatch):
    """An engine told it is the first of two servers of one device leaves the second its weights and an equal
    pool (was: both took --mem-fraction-static of what they saw; started together, both saw the same memory)."""
    import torch

    from pdlab.runtime.memory import budget
    from pdlab.runtime.model.tiny import load_tiny

    monkeypatch.setattr(budget, "available_bytes", lambda device: 256 << 20)
    m, tok, cfg = load_tiny("cpu", torch.float32)
    w = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
    engines = [Engine(build_config(SchedulerConfig, device="cpu", page_size=16, device_servers=n), m, tok, cfg,
                      max_running_requests=4) for n in (1, 2)]
    assert engines[1]._weight_bytes() == w > 1 << 20
    page_bytes = type(engines[0].pool).bytes_per_token(engines[0].num_layers, "fp32") * 16
    assert [e.pool.num_pages for e in engines] == [int(0.85 * (256 << 20) // page_bytes),
                                                   int(0.85 * ((256 << 20) - w) / 2 // page_bytes)]
    with pytest.raises(ConfigError, match="device_server_index 2 is not a place among device_servers 2"):
        build_config(SchedulerConfig, device_servers=2, device_server_index=2)

"""The MoE tuning target's weight builder: chunked quantization equals the stacked one."""

import torch

from pdlab.moe.weights import NVFP4_KEYS, ExpertWeights
from pdlab.tuning.moe import quantize_in_chunks


def test_chunked_quantization_equals_stacked():
    g = torch.Generator().manual_seed(3)
    E, I, H = 5, 32, 64
    w13 = torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16)
    w2 = torch.randn(E, H, I, generator=g).to(torch.bfloat16)
    w13[2] *= 40.0  # experts with very different ranges: per-expert scale_2 must survive chunking
    w2[4] *= 1e-3
    whole = ExpertWeights.from_bf16(w13, w2, quantize=True, keep_bf16=False)
    chunked = quantize_in_chunks(lambda e0, n: (w13[e0:e0 + n], w2[e0:e0 + n]), E, chunk=2)
    for k in NVFP4_KEYS:
        a, b = getattr(whole, k), getattr(chunked, k)
        assert a.shape == b.shape, k
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), k


def test_reference_call_drops_its_fp32_weight_copy():
    from pdlab.tuning.models import ModelShape
    from pdlab.tuning.moe import MOE_EXPERTS

    model = ModelShape(name="tiny", hidden_size=64, moe_intermediate_size=32, n_routed_experts=4,
                       num_experts_per_tok=2, num_heads=4, kv_lora_rank=512, qk_nope_head_dim=128,
                       qk_rope_head_dim=64)
    bucket = {"tokens_per_expert": 2, "experts": 4, "hidden": 64, "intermediate": 32, "layout": "contiguous",
              "payload": "bf16"}
    x = MOE_EXPERTS.build(bucket, model, torch.device("cpu"))
    out = MOE_EXPERTS.call("torch", {}, x)
    assert out.hidden.shape == (8, 64) and torch.isfinite(out.hidden).all()
    assert "torch_fp32" not in x.weights.prepared


def test_sm90_searches_only_the_fragment_gemms_knobs():
    # where the fragment-order GEMMs run (sm90, a Triton with Gluon), the in-loop kernel's knobs change nothing: the
    # triton space is theirs (and the dense path's for contiguous bf16 rows); on other archs the whole space
    from pdlab.kernels import registry
    from pdlab.moe.triton import nvfp4_frag
    from pdlab.tuning.moe import MOE_EXPERTS

    triton = registry.get_backend("moe_experts", "triton")
    b = {"tokens_per_expert": 16, "experts": 64, "hidden": 7168, "intermediate": 2048, "layout": "masked",
         "payload": "bf16"}
    for arch in ("sm100", "sm80", "cpu"):
        assert MOE_EXPERTS.search_space(triton, b, arch) == triton.config_space
    if not nvfp4_frag.HAVE_GLUON:
        assert MOE_EXPERTS.search_space(triton, b, "sm90") == triton.config_space
        return
    frag = {"FRAG_BM": [16, 32, 64], "FRAG_UNROLL": [1, 2], "FRAG_XASYNC": [0, 1], "FRAG_RING": [0, 2, 3],
            "FRAG_RING_DOWN": [0, 2, 3], "FRAG_PAIR_DOWN": [0, 1], "FRAG_XRING": [0, 1], "FRAG_PDL": [0, 1],
            "FRAG_MMA_ASYNC": [0, 1]}
    assert MOE_EXPERTS.search_space(triton, b, "sm90") == frag
    rows = MOE_EXPERTS.search_space(triton, {**b, "layout": "contiguous"}, "sm90")
    assert set(rows) == {*frag, "DENSE_MIN_M", "DENSE_CHUNK", "DENSE_OVERLAP"}
    assert MOE_EXPERTS.search_space(triton, {**b, "payload": "nvfp4", "layout": "contiguous"}, "sm90") == frag
    ref = registry.get_backend("moe_experts", "torch")
    assert MOE_EXPERTS.search_space(ref, b, "sm90") == ref.config_space


def test_sparse_buckets_fill_only_their_active_experts():
    # one token on 2 of 8 experts: rows only there (contiguous: 2 rows; masked: masked_m 1 on those, 0 elsewhere);
    # the error counts a masked slab's valid rows only (the others are unspecified), and a wrong valid row fails
    from pdlab.tuning.models import ModelShape
    from pdlab.tuning.moe import MOE_EXPERTS, active_ids, experts_buckets

    model = ModelShape(name="tiny", hidden_size=64, moe_intermediate_size=32, n_routed_experts=8,
                       num_experts_per_tok=2, num_heads=4, kv_lora_rank=512, qk_nope_head_dim=128,
                       qk_rope_head_dim=64)
    buckets = experts_buckets(model)
    # SPARSE_ACTIVE (8, 32, 128) holds none below 8 experts: tiny models get the every-expert buckets only
    assert {b["active_experts"] for b in buckets} == {8, 2}
    assert active_ids(256, 8).tolist() == list(range(0, 256, 32))
    assert MOE_EXPERTS.cuda_graph  # trials timed as decode runs them, not the host's launches of a few experts
    base = {"tokens_per_expert": 1, "experts": 8, "active_experts": 2, "hidden": 64, "intermediate": 32,
            "payload": "bf16"}
    rows = MOE_EXPERTS.build({**base, "layout": "contiguous"}, model, torch.device("cpu"))
    assert rows.layout.hidden.shape == (2, 64) and rows.layout.counts.tolist() == [1, 0, 0, 0, 1, 0, 0, 0]
    assert rows.layout.offsets.tolist() == [0, 1, 1, 1, 1, 2, 2, 2, 2]
    slab = MOE_EXPERTS.build({**base, "layout": "masked"}, model, torch.device("cpu"))
    assert slab.layout.hidden.shape == (8, 1, 64) and slab.layout.masked_m.tolist() == [1, 0, 0, 0, 1, 0, 0, 0]
    ref = MOE_EXPERTS.call("torch", {}, slab)
    out = MOE_EXPERTS.call("torch", {}, slab)
    out.hidden[1:4] = 1e4  # rows past masked_m: unspecified, not compared
    assert MOE_EXPERTS.error(out, ref) < 1e-6
    out.hidden[4] = -out.hidden[4]
    assert MOE_EXPERTS.error(out, ref) > 0.1

"""cos error of fp8 kernel versions on the hard problems of the GPU tests (debug)."""
import importlib.util, json, random, sys
import torch
sys.path.insert(0, "tests/attention")
import test_gluon_mla as T
from pdlab.attention import gluon_mla, mla_decode
from pdlab.bench.harness import cosine_error

def load(name, path):
    spec = importlib.util.spec_from_file_location("v_" + name, path); m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m); return m

real = gluon_mla.launch
vers = {a.split("=")[0]: load(*a.split("=")) for a in sys.argv[1:]}
for heads, q_len, splits in [(16, 1, 1), (16, 1, 3), (16, 2, 1), (32, 1, 2)]:
    for seed in (0, 1, 2):
        rng = random.Random(seed)
        for qd in (torch.bfloat16, torch.float16):
            p = T._growing_scores(T._fp8_problem(T._lens(12, 4000, q_len, rng), heads, q_len, 64, seed, qd), growth=6.0, q_gain=4.0)
            ref = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale, backend="torch")
            cfg = {"kernel": "gluon", "num_splits": splits, **T._U} if splits > 1 else {"kernel": "gluon", **T._BAL}
            row = {"heads": heads, "q_len": q_len, "splits": splits, "seed": seed, "q": str(qd)[6:]}
            for n, m in vers.items():
                gluon_mla.launch = m.launch
                try:
                    o, l = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale, backend="triton", config=cfg)
                    row[n] = [float(f"{cosine_error(o, ref[0]):.3g}"), float(f"{cosine_error(l, ref[1]):.3g}")]
                finally:
                    gluon_mla.launch = real
            print(json.dumps(row), flush=True)

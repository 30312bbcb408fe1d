"""Diagnostics only (bench/gpu/serve_compiles.sh puts this folder first on PYTHONPATH): with PDLAB_JIT_LOG set,
every Triton/Gluon kernel compile is logged there (time, process, kernel, warps, stages, constexprs, the pdlab
frames of the call stack) through Triton's jit_cache_hook, which runs before each compile."""
import os
import time
import traceback

_log = os.environ.get("PDLAB_JIT_LOG")
if _log:
    try:
        import triton

        def _hook(*args, **kw):
            comp = kw.get("compile", {})
            cons = comp.get("constants", {})
            cons = {k: v for k, v in (cons.items() if hasattr(cons, "items") else []) if not callable(v)}
            frames = [f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in traceback.extract_stack()
                      if any(p in f.filename for p in ("/moe/", "/runtime/", "/attention/", "/kernels/"))]
            with open(_log, "a") as fh:
                fh.write(f"{time.time():.3f} pid {os.getpid()} {kw.get('fn').name if kw.get('fn') else '?'} "
                         f"w{comp.get('num_warps')} s{comp.get('num_stages')} {cons}\n    "
                         + " < ".join(frames[::-1][:14]) + "\n")
            return False  # compile as usual

        triton.knobs.runtime.jit_cache_hook = _hook
    except Exception as exc:
        print("jit hook not installed:", exc)

# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0. Preamble: the device wheels installed and put on PYTHONPATH,
# pdlab installed editable. The runs used the first version of bench/gpu/serve_compiles.sh (the same steps, its
# output under $OUT/w); before/ without the compile hook, three runs.
# before/, before_hook/: tree at cdd7c85 (warm-up at powers of two)
# after/: tree at e567840 (warm-up also at MoELayer.warmup_token_counts' sizes)
bash bench/gpu/serve_compiles.sh
# after_disagg/: tree at 46e805d, the script as at 6b54eae (one GPU: prefill, decode and router share it)
SERVE_ARGS=--disagg OUT=$OUT/disagg bash bench/gpu/serve_compiles.sh

# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0. Tree: commit a014272. Preamble: the device wheels installed and
# put on PYTHONPATH, pdlab installed editable. The embedded tiny model, colocated, three runs of bench serving
# (256 in / 64 out, 64 prompts, 16 requests/s, concurrency 16); steps.jsonl is PDLAB_STEP_LOG's file (gzipped here),
# step_tail.txt what bench/gpu/step_tail.py makes of it.
export PDLAB_COMMIT=a014272
RUNS=3 OUT=$OUT/tail bash bench/gpu/serve_compiles.sh

#!/usr/bin/env bash
# Prefix caching on a GPU (bench/gpu/prefix_cache.py): outputs with and without it, prefill tokens and time saved.
# Usage: OUT=DIR bash bench/gpu/prefix_cache.sh
set -euo pipefail
OUT=${OUT:-bench/results/prefix_cache}
python3 bench/gpu/prefix_cache.py --out "$OUT" "$@"

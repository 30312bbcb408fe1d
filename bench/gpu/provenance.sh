#!/usr/bin/env bash
# Sourced by the GPU scripts: `record_provenance DIR` writes what a record under bench/results needs beside its
# figures — device.txt (GPU name, max SM clock, memory), commit.txt (short commit of the tree, or $PDLAB_COMMIT), tree_status.txt
# (uncommitted changes, if any) and date.txt (UTC).
record_provenance() {
  local dir=$1
  mkdir -p "$dir"
  nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > "$dir/device.txt" 2>&1
  # PDLAB_COMMIT: the tree's commit where the checkout's .git is not the tree's own (a copied working tree)
  if [[ -n ${PDLAB_COMMIT:-} ]]; then echo "$PDLAB_COMMIT" > "$dir/commit.txt"
  else git rev-parse --short HEAD > "$dir/commit.txt" 2>/dev/null || true; fi
  git status --short > "$dir/tree_status.txt" 2>/dev/null || true
  date -u +%Y-%m-%dT%H:%M:%SZ > "$dir/date.txt"
}

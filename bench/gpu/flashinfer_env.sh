#!/usr/bin/env bash
# Sourced by the GPU scripts that run flashinfer on a machine without a package index: unpacks FI_TAR (a tar.xz of
# the flashinfer package: the wheel's Python files plus the headers and MLA sources its JIT needs,
# data/{include,cutlass/include,cutlass/tools/util/include,cccl,spdlog/include} and data/csrc/batch_mla*) into SITE,
# puts SITE on PYTHONPATH (apache-tvm-ffi comes as a wheel, installed with the device wheels) and finds nvcc for the JIT. With OUT
# set: creates it, records the provenance there and makes it bench's results folder.
if [[ -n ${OUT:-} ]]; then
  mkdir -p "$OUT"
  export PDLAB_RESULTS_DIR="$OUT"
  . "$(dirname "${BASH_SOURCE[0]}")/provenance.sh"
  record_provenance "$OUT"
fi
# a folder of its own: scripts that run first without flashinfer and then with it must not find it in the
# folder the device wheels are installed to
SITE=${FI_SITE:-/tmp/pdlab_flashinfer_site}
FI_TAR=${FI_TAR:-.whl/flashinfer_trim.tar.xz}
mkdir -p "$SITE" && tar xJf "$FI_TAR" -C "$SITE"
export PYTHONPATH=$SITE:${PYTHONPATH:-}
if [[ -z ${CUDA_HOME:-} ]]; then
  for d in /usr/local/cuda /usr/local/cuda-13.0 /usr/local/cuda-13 "$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /x/x/x)")")"; do
    if [[ -x $d/bin/nvcc ]]; then export CUDA_HOME=$d; break; fi
  done
fi
export PATH=${CUDA_HOME:-/usr/local/cuda}/bin:$PATH
export MAX_JOBS=${MAX_JOBS:-16} FLASHINFER_NVCC_THREADS=${FLASHINFER_NVCC_THREADS:-4}

#!/usr/bin/env bash
# Decode hot spots on one H200, ~4 min: per-GEMM timings of the NVFP4 experts (EP4 decode) and MLA fp8
# decode under several configs, then Nsight Compute (`ncu --clock-control none`) sections of the default
# kernels. Usage (repo root, after `pip install -e .`): OUT=/tmp/out bash bench/gpu/profile.sh
# Writes $OUT/profile.tgz (CSV timings, ncu text reports, device/commit/date).
set -u
OUT=${OUT:-/tmp/pdlab_profile}
R="$OUT/profile"; mkdir -p "$R"
export PYTHONUNBUFFERED=1; unset TRITON_INTERPRET
{ date -u +%Y-%m-%dT%H:%M:%SZ; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$R/device.txt" 2>&1
P="python3 bench/gpu/profile_decode.py"
MOE_CFGS=(--config '{}' --config '{"num_stages": 4}' --config '{"num_stages": 5}' --config '{"num_stages": 2}'
          --config '{"BLOCK_N": 256}' --config '{"BLOCK_N": 64, "num_stages": 4}' --config '{"num_warps": 8}'
          --config '{"BLOCK_K": 256, "num_stages": 2}' --config '{"BLOCK_N": 256, "num_warps": 8}'
          ${MOE_EXTRA:-})
# MOE_CFG_FILE / MLA_CFG_FILE (one JSON config per line) replace the lists below; SKIP_MLA=1, SKIP_NCU=1
[[ -n ${MOE_CFG_FILE:-} ]] && MOE_CFGS=(--config-file "$MOE_CFG_FILE")
timeout ${MOE_TIMEOUT:-120} $P --what moe --tokens 1,16 "${MOE_CFGS[@]}" --out "$R" > "$R/moe_timings.txt" 2>&1
MLA_CFGS=(--config '{}' --config '{"num_warps": 8}' --config '{"fp8_upcast": "prefetch", "num_warps": 8}'
          --config '{"fp8_upcast": "prefetch", "num_warps": 8, "BLOCK_N": 16}' --config '{"num_stages": 2}'
          --config '{"num_stages": 1}' --config '{"fp8_upcast": "inline"}' --config '{"BLOCK_N": 64, "num_warps": 8}'
          ${MLA_EXTRA:-})
[[ -n ${MLA_CFG_FILE:-} ]] && MLA_CFGS=(--config-file "$MLA_CFG_FILE")
[[ -z ${SKIP_MLA:-} ]] && timeout ${MLA_TIMEOUT:-90} $P --what mla --kv-dtype fp8,bf16 "${MLA_CFGS[@]}" --out "$R" > "$R/mla_timings.txt" 2>&1
NCU="ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
     --section MemoryWorkloadAnalysis --section SchedulerStats"
[[ -z ${SKIP_NCU:-} ]] && timeout 90 $NCU -k regex:_moe_nvfp4_gemm --launch-skip 2 --launch-count 2 $P --what moe \
    --tokens 16 --once ${NCU_MOE_CONFIG:+--config "$NCU_MOE_CONFIG"} > "$R/ncu_moe.txt" 2>&1
[[ -z ${SKIP_NCU:-}${SKIP_MLA:-} ]] && timeout 60 $NCU -k regex:_mla_fwd --launch-skip 2 --launch-count 1 $P --what mla --kv-dtype fp8 --once \
    > "$R/ncu_mla_fp8_h16.txt" 2>&1
[[ -z ${SKIP_NCU:-}${SKIP_MLA:-} ]] && timeout 60 $NCU -k regex:_mla_fwd --launch-skip 2 --launch-count 1 $P --what mla --kv-dtype bf16 --once \
    > "$R/ncu_mla_bf16_h16.txt" 2>&1
[[ -z ${SKIP_NCU:-}${SKIP_MLA:-} ]] && timeout 60 $NCU -k regex:_mla_fwd --launch-skip 2 --launch-count 1 $P --what mla --kv-dtype bf16 --heads 128 --once \
    > "$R/ncu_mla_bf16_h128.txt" 2>&1
tail -n 40 "$R"/*_timings.txt
grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy|Compute \(SM\)|Block Limit|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" "$R"/ncu_*.txt | head -80
tar czf "$OUT/profile.tgz" -C "$OUT" profile
exit 0

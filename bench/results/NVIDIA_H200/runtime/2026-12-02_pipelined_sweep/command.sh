# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0, flashinfer not installed. Tree: commit df7101f (the package as
# at 60375d9). Preamble: the device wheels installed and put on PYTHONPATH, pdlab installed editable.
export PDLAB_COMMIT=df7101f
STAGES="perf serve" OUT=$OUT/rt bash bench/gpu/runtime.sh
# perf: python3 -m pdlab.runtime.engine.perf --model-path synthetic:deepseek-r1:4 --device cuda \
#   --batch-sizes 1,2,4,8,16,32,64,128,256 --context 1024 --steps 20 --ttft-lens 1024,8192 --overlap-too --profile-host 64
# serve: runtime serve --max-running-requests 64 --max-context-len 4096 --cuda-graph-bs 1 2 4 8 16 24 32 40 48 64, then
#   bench serving --num-prompts 96 --random-input-len 2048 --random-output-len 512 --max-concurrency 32 --request-rate inf

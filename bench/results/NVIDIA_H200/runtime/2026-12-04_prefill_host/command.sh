# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0. Preamble: the device wheels installed and put on PYTHONPATH,
# pdlab installed editable.
# tiny_profile_70125af.txt (tree 70125af), tiny_profile_a014272.txt (tree a014272): the embedded tiny model
python3 bench/gpu/prefill_profile.py --tokens 16,128,512,2048 --out $OUT/pp
# r1_4layers_70125af.txt, r1_4layers_960f6d1.txt: DeepSeek-R1 widths, 4 layers, random weights (one process each)
python3 bench/gpu/prefill_profile.py --model-path synthetic:deepseek-r1:4 --tokens 16,128,512,2048 --out $OUT/r1
# ab_interleaved.txt: ab_interleaved.py (tree 960f6d1), the four variants interleaved step by step in one process
python3 ab_interleaved.py tiny
python3 ab_interleaved.py synthetic:deepseek-r1:4

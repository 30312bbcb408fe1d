# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0. Tree: commit b60f9d9 (the test change is e43c030). Preamble:
# the device wheels installed and put on PYTHONPATH, pdlab installed editable.
python3 bench/gpu/seesaw_fp8_seeds.py --seeds 24 > seeds.txt
python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/attention/test_gluon_mla_wide.py > gluon_mla_wide.txt

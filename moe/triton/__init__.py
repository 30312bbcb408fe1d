"""pdlab's own Triton kernels for MoE (routing, NVFP4 W4A16 grouped GEMMs). Import triton lazily."""

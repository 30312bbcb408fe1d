"""Expert runners of op "moe_experts", one file each; importing this package registers them all."""

from pdlab.moe.runners import cutedsl, torch_grouped, torch_ref, triton_nvfp4  # noqa: F401

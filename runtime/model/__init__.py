"""The served model: DeepSeek-V3/R1 over pdlab's ops, its typed config, checkpoint loader, tokenizer
and the embedded tiny default (`load_model(None, ...)`)."""

from pdlab.runtime.model.config import ConfigError, ModelConfig, QuantConfig, RopeConfig
from pdlab.runtime.model.deepseek_v3 import DeepseekV3ForCausalLM
from pdlab.runtime.model.loader import CheckpointError, LoadOptions, build_model, load_model
from pdlab.runtime.model.tokenizer import Tokenizer

__all__ = ["CheckpointError", "ConfigError", "DeepseekV3ForCausalLM", "LoadOptions", "ModelConfig", "QuantConfig",
           "RopeConfig", "Tokenizer", "build_model", "load_model"]

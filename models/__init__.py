"""The GPT model in Flax NNX; it names logical axes only and imports nothing of ours."""
from models.config import PRESETS, GPTConfig, ModelConfigError, from_dict
from models.gpt import (GPT, abstract_params, flops_per_token, forward, init_params, logical_axes, loss,
                        param_count, param_dict)

__all__ = ["PRESETS", "GPTConfig", "ModelConfigError", "from_dict", "GPT", "abstract_params",
           "flops_per_token", "forward", "init_params", "logical_axes", "loss", "param_count", "param_dict"]

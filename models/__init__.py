"""Model families behind one contract (models/contract.py), in Flax NNX; they name logical axes only and
import nothing of ours. Importing this package imports every module in it, and each family's module registers
itself (contract.register): a new family is its own files, with no line added here."""
import importlib
import pkgutil

from models.config import ModelConfigError, from_dict
from models.contract import (
    FAMILIES,
    LAYERS,
    Block,
    Cost,
    ExpertBuffers,
    Family,
    Forward,
    ModelConfig,
    Parallel,
    TensorTraffic,
    TransformerConfig,
    abstract_params,
    family_of,
    flops_per_token,
    forward,
    init_params,
    layer_specs,
    loss,
    loss_and_metrics,
    param_count,
    register,
    stack_length,
    top_params,
    uniform_attention,
)
from models.documents import loss_mask, split_row, target_counter
from models.gpt_config import GPT_PRESETS, GPTConfig
from models.layer_spec import LayerSpec, Rope
from models.llama_config import LLAMA_PRESETS, LlamaConfig
from models.moe import is_moe, on_whole_rows

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

PRESETS = {name: values for family in FAMILIES.values() for name, values in family.presets.items()}

__all__ = ["Block", "Cost", "ExpertBuffers", "FAMILIES", "Family", "Forward", "GPTConfig", "GPT_PRESETS",
           "LAYERS", "LLAMA_PRESETS", "LayerSpec", "LlamaConfig", "ModelConfig", "ModelConfigError", "PRESETS",
           "Parallel", "Rope", "TensorTraffic", "TransformerConfig", "abstract_params", "family_of", "flops_per_token",
           "forward", "from_dict", "init_params", "is_moe", "layer_specs", "loss", "loss_and_metrics", "loss_mask",
           "on_whole_rows", "param_count", "register", "split_row", "stack_length", "target_counter", "top_params",
           "uniform_attention"]

"""Rules to specs: dedup of mesh axes per array, dropped size-1 axes, divisibility errors, ZeRO axis."""
import pytest
from jax.sharding import PartitionSpec as P

import models
from sharding import rules as rules_lib
from sharding.rules import ShardingConfigError
from sharding.specs import add_axis, mesh_spec, param_specs

SIZES = {"data": 2, "pipeline": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
RULES = rules_lib.STRATEGIES["fsdp_tensor"]


def test_activation_and_weight_share_names():
    # batch takes fsdp first, so the residual stream is not split on embed; weights are.
    assert mesh_spec(P("batch", "seq", "embed"), RULES, (8, 4, 16), SIZES) == P(("data", "fsdp"))
    assert mesh_spec(P("embed", "mlp"), RULES, (16, 64), SIZES) == P("fsdp", "tensor")
    assert mesh_spec(P("layers", "heads"), RULES, (8, 8), {**SIZES, "tensor": 1}) == P()


def test_megatron_tensor_parallel_specs_of_the_tiny_model():
    cfg = models.from_dict({"preset": "tiny"})
    abstract, logical = models.abstract_params(cfg)
    specs = param_specs(abstract, logical, rules_lib.STRATEGIES["tensor_parallel"], {**SIZES, "fsdp": 1})
    layers = specs["layers"]
    assert layers["wqkv"] == P(None, None, None, "tensor")  # column parallel: heads split
    assert layers["wo"] == P(None, "tensor")                 # row parallel: heads (input) split
    assert layers["w_in"] == P(None, None, "tensor") and layers["w_out"] == P(None, "tensor")
    assert specs["embed"] == P("tensor") and specs["head"] == P(None, "tensor")


def test_indivisible_parameter_names_parameter_shape_and_axis():
    cfg = models.from_dict({"preset": "tiny", "n_heads": 4})
    abstract, logical = models.abstract_params(cfg)
    with pytest.raises(ShardingConfigError) as info:
        param_specs(abstract, logical, RULES, {**SIZES, "tensor": 8, "data": 1, "fsdp": 1})
    msg = str(info.value)
    assert "layers/wo" in msg or "layers/wqkv" in msg
    assert "tensor=8" in msg and "(8, " in msg and "\n" not in msg


def test_zero_axis_goes_to_largest_divisible_dim():
    assert add_axis(P(None, "fsdp"), (8, 128), "data", {"data": 4, "fsdp": 2}) == P(None, ("fsdp", "data"))
    assert add_axis(P(), (3, 8), "data", {"data": 4}) == P(None, "data")
    assert add_axis(P(), (3,), "data", {"data": 4}) == P()


def test_strategy_errors():
    with pytest.raises(ShardingConfigError, match="sharding.strategy='zero9'"):
        rules_lib.resolve("zero9", None, SIZES)
    with pytest.raises(ShardingConfigError, match="mesh.tensor=2 but sharding.strategy='fsdp'"):
        rules_lib.resolve("fsdp", None, SIZES)
    with pytest.raises(ShardingConfigError, match="'sequence'"):
        rules_lib.resolve("fsdp_tensor", {"mlp": "sequence"}, SIZES)


def test_user_strategy_can_be_registered():
    rules_lib.register_strategy("my_dp", {"batch": "data", "embed": None})
    try:
        assert rules_lib.resolve("my_dp", None, {"data": 8, "pipeline": 1, "fsdp": 1, "tensor": 1}) == \
            {"batch": ("data",), "embed": ()}
    finally:
        del rules_lib.STRATEGIES["my_dp"]

"""The model contract: a family defined here, unknown to sharding/ and train/, trains and pipelines as one
device does; its top parameters have names of its own (no "embed"/"head")."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import models
from tests.helpers import grads_and_run, rel_norm, tiny_config
from train.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    family: ClassVar[str] = "toy"
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 32
    n_layers: int = 4
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"

    def validate(self):
        return self


def _init(cfg, seed):
    k = jax.random.split(jax.random.key(seed), 3)
    return {"table": 0.1 * jax.random.normal(k[0], (cfg.vocab_size, cfg.d_model)),
            "layers": {"w": 0.1 * jax.random.normal(k[1], (cfg.n_layers, cfg.d_model, cfg.d_model))},
            "unembed": 0.1 * jax.random.normal(k[2], (cfg.d_model, cfg.vocab_size))}


def _abstract(cfg):
    logical = {"table": P("vocab", "embed"), "layers": {"w": P("layers", "embed", "mlp")},
               "unembed": P("embed", "vocab")}
    return jax.eval_shape(lambda: _init(cfg, 0)), logical


def _run_layers(layers, x, inputs, cfg, constrain, layer_ids=None):
    x, _ = jax.lax.scan(lambda x, w: (x + jnp.tanh(x @ w["w"]), None), x, layers)
    return x, (jnp.zeros((), jnp.float32), {})


def _logits(top, x, cfg, constrain):
    return x @ top["unembed"]


def _head_loss(top, x, targets, cfg, constrain, loss_mask=None):
    return optax.softmax_cross_entropy_with_integer_labels(_logits(top, x, cfg, constrain), targets).mean(), {}


TOY = models.register(models.Family(
    name="toy", config_cls=ToyConfig, presets={},
    forward=models.Forward(init_params=_init, abstract_params=_abstract,
                           embed=lambda top, tokens, cfg, constrain: jnp.take(top["table"], tokens, axis=0),
                           run_layers=_run_layers, head_loss=_head_loss, logits=_logits),
    parallel=models.Parallel(lookup_keys=lambda cfg: ("table",), divisibility=lambda cfg: {}),
    cost=models.Cost(flops_per_token=lambda cfg: 6.0 * cfg.n_layers * cfg.d_model ** 2,
                     param_count=lambda cfg: cfg.n_layers * cfg.d_model ** 2 + 2 * cfg.vocab_size * cfg.d_model)))


def _toy_config(**mesh):
    config = tiny_config(**mesh)
    config.model.preset = ""
    config.model.family = "toy"
    return config


def test_a_family_unknown_to_sharding_and_train_trains_and_pipelines():
    reference = Trainer.build(_toy_config(), num_devices=1)
    assert isinstance(reference.plan.model, ToyConfig)
    ref_grads, ref_losses, _ = grads_and_run(reference, 3)
    config = _toy_config(pipeline=2, data=2, tensor=2)
    piped = Trainer.build(config)
    grads, losses, _ = grads_and_run(piped, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert rel_norm(grads, ref_grads) < 1e-5


def test_every_family_declares_one_layer_spec_per_layer_as_its_stack_holds_them():
    """Each preset's LayerSpecs: one per layer; its expert layers the mixture's groups; a sliding layer's window
    within the row; a family that declares none (the toy) gets causal layers. Gemma 3 27B: a global layer every
    sixth (10 of 62), the others sliding over 1,024 positions, each kind its own rotary base."""
    for family in models.FAMILIES.values():
        for preset in family.presets:
            cfg = models.from_dict({"preset": preset})
            specs = models.layer_specs(cfg)
            assert len(specs) == cfg.n_layers and all(isinstance(s, models.LayerSpec) for s in specs), preset
            experts = family.parallel.expert_buffers(cfg)
            assert sum(s.mlp == "experts" for s in specs) == (experts.layers if experts else 0), preset
            assert all(0 < s.window or s.attention != "sliding" for s in specs), preset
    assert models.layer_specs(ToyConfig()) == (models.LayerSpec(),) * 4 and models.uniform_attention(ToyConfig())
    gemma = models.layer_specs(models.from_dict({"preset": "gemma3-27b"}))
    assert [i for i, s in enumerate(gemma) if s.attention == "causal"] == list(range(5, 62, 6))
    assert {s.window for s in gemma if s.attention == "sliding"} == {1024}
    assert {(s.attention, s.rope) for s in gemma} == {("causal", models.Rope(1e6, "linear", 8.0)),
                                                     ("sliding", models.Rope(1e4))}

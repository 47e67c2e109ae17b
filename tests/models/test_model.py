"""The model: presets, logical names on every dimension, causality, remat policies that change nothing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models


def test_presets():
    tiny = models.from_dict({"preset": "tiny"})
    assert models.param_count(tiny) <= 5_000_000 and tiny.n_layers == 8
    assert all(v % 8 == 0 for v in (tiny.n_heads, tiny.d_model, tiny.d_mlp, tiny.vocab_size))
    sizes = {name: models.param_count(models.from_dict({"preset": name})) / 1e9 for name in models.PRESETS}
    assert 0.12 < sizes["gpt2-125m"] < 0.17 and 0.3 < sizes["gpt2-350m"] < 0.45
    assert 1.2 < sizes["gpt3-1.3b"] < 1.5 and 6.0 < sizes["7b"] < 7.5


def test_every_parameter_dimension_is_named():
    abstract, logical = models.abstract_params(models.from_dict({"preset": "tiny"}))
    for leaf, names in zip(jax.tree.leaves(abstract), jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, jax.P))):
        assert len(names) == leaf.ndim
    assert all(names[0] == "layers" for names in jax.tree.leaves(
        logical["layers"], is_leaf=lambda x: isinstance(x, jax.P)))


def test_attention_is_causal():
    cfg = models.from_dict({"preset": "tiny", "n_layers": 2})
    params = models.init_params(cfg, 0)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    changed = tokens.at[:, 10:].set(7)
    a, b = models.forward(params, tokens, cfg), models.forward(params, changed, cfg)
    np.testing.assert_allclose(a[:, :10], b[:, :10], atol=1e-5)
    assert not np.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_changes_nothing_numerically(remat):
    cfg = models.from_dict({"preset": "tiny", "n_layers": 2})
    params = models.init_params(cfg, 0)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
    ref = jax.value_and_grad(models.loss)(params, tokens, cfg)
    out = jax.value_and_grad(models.loss)(params, tokens, models.from_dict({"preset": "tiny", "n_layers": 2,
                                                                             "remat": remat}))
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def test_bf16_compute_keeps_fp32_params_and_logits():
    cfg = models.from_dict({"preset": "tiny", "n_layers": 2, "compute_dtype": "bfloat16"})
    params = models.init_params(cfg, 0)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    tokens = jax.random.randint(jax.random.key(2), (2, 17), 0, 256)
    assert models.forward(params, tokens[:, :-1], cfg).dtype == jnp.float32
    fp32 = models.loss(params, tokens, models.from_dict({"preset": "tiny", "n_layers": 2}))
    np.testing.assert_allclose(models.loss(params, tokens, cfg), fp32, rtol=2e-2)


def test_initial_loss_is_uniform_and_bad_settings_are_named():
    cfg = models.from_dict({"preset": "tiny"})
    loss = models.loss(models.init_params(cfg, 0), jnp.arange(65)[None] % 256, cfg)
    assert abs(float(loss) - np.log(256)) < 0.05
    with pytest.raises(models.ModelConfigError, match="model.remat='some'"):
        models.from_dict({"preset": "tiny", "remat": "some"})
    with pytest.raises(models.ModelConfigError, match="model.width"):
        models.from_dict({"preset": "tiny", "width": 3})

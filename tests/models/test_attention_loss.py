"""The attention kernels' selection and segment handling, and the chunked head+loss against the plain one."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention
from models import lm_loss as loss_lib
from tests.helpers import run_python


def test_auto_resolves_to_xla_on_cpu_and_cudnn_where_it_can_run():
    assert attention.resolve("auto", jax.devices()[0].platform, "bfloat16", 64) == "xla"
    assert attention.resolve("auto", "gpu", "bfloat16", 64) == "cudnn"
    assert attention.resolve("auto", "gpu", "float32", 64) == "xla"
    assert attention.resolve("auto", "gpu", "bfloat16", 256) == "xla"
    assert attention.resolve("xla", "gpu", "bfloat16", 64) == "xla"


@pytest.mark.parametrize("args, needle", [(("cudnn", "cpu", "bfloat16", 64), "NVIDIA GPU"),
                                          (("cudnn", "gpu", "float32", 64), "compute_dtype"),
                                          (("flash", "gpu", "bfloat16", 64), "use one of")])
def test_explicit_choices_that_cannot_run_are_one_line_errors(args, needle):
    with pytest.raises(ValueError, match=needle) as e:
        attention.resolve(*args)
    assert "model.attention" in str(e.value) and "\n" not in str(e.value)


def test_segment_offsets_describe_each_rows_documents():
    seg = jnp.array([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    lengths, offsets = attention.segment_offsets(seg, max_segments=4)
    np.testing.assert_array_equal(lengths, [[3, 2, 1, -1], [6, -1, -1, -1]])
    np.testing.assert_array_equal(offsets, [[0, 3, 5, 6, -1], [0, 6, -1, -1, -1]])


def test_xla_attention_with_segments_keeps_documents_apart():
    key = jax.random.key(0)
    q, k, v = (jax.random.normal(kk, (1, 12, 4, 8)) for kk in jax.random.split(key, 3))
    k, v = k[:, :, :2], v[:, :, :2]  # grouped-query: 2 K/V heads for 4 query heads
    seg = jnp.array([[0] * 5 + [1] * 7])
    packed = attention.attend(q, k, v, "xla", seg)
    alone = attention.attend(q[:, 5:], k[:, 5:], v[:, 5:], "xla")
    np.testing.assert_allclose(packed[:, 5:], alone, atol=1e-6)
    first = attention.attend(q[:, :5], k[:, :5], v[:, :5], "xla")
    np.testing.assert_allclose(packed[:, :5], first, atol=1e-6)
    assert not np.allclose(attention.attend(q, k, v, "xla")[:, 5:], alone, atol=1e-3)


def _plain_mean(h, head, targets, mask):
    logits = jnp.einsum("bld,dv->blv", h, head)
    per = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    return jnp.sum(per * mask) / jnp.sum(mask)


@pytest.mark.parametrize("chunk", [4, 5])  # divides L=12, and does not
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_loss_equals_plain_loss_and_gradients(chunk, masked):
    kh, kw, kt, km = jax.random.split(jax.random.key(1), 4)
    h, head = jax.random.normal(kh, (3, 12, 16)), 0.3 * jax.random.normal(kw, (16, 40))
    targets = jax.random.randint(kt, (3, 12), 0, 40)
    mask = jax.random.bernoulli(km, 0.7, (3, 12)).astype(jnp.float32) if masked else jnp.ones((3, 12))

    def mean(fn):
        return lambda h, w: (lambda s, n: s / n)(*fn(h, w))

    chunked = mean(lambda h, w: loss_lib.head_loss(h, w, targets, mask if masked else None, chunk))
    whole = mean(lambda h, w: loss_lib.head_loss(h, w, targets, mask if masked else None, 0))
    reference = lambda h, w: _plain_mean(h, w, targets, mask)  # noqa: E731
    value, grads = jax.value_and_grad(chunked, argnums=(0, 1))(h, head)
    for other in (whole, reference):
        ref_value, ref_grads = jax.value_and_grad(other, argnums=(0, 1))(h, head)
        np.testing.assert_allclose(value, ref_value, rtol=1e-5)
        for g, r in zip(grads, ref_grads):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
    assert float(loss_lib.head_loss(h, head, targets, mask, chunk)[1]) == float(mask.sum())


def test_gpu_defaults_parse_and_respect_the_users_settings():
    from train.runtime import xla_env
    changes = xla_env.gpu_defaults({"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"})
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in changes["XLA_FLAGS"]
    assert changes["XLA_FLAGS"].startswith("--xla_gpu_enable_latency_hiding_scheduler=false ")
    assert changes["XLA_PYTHON_CLIENT_MEM_FRACTION"] == xla_env.MEM_FRACTION
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in xla_env.gpu_defaults({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"})
    assert not xla_env.gpu_expected({"JAX_PLATFORMS": "cpu"})
    # XLA aborts the process on a flag it does not know: the defaults must parse (on CPU too).
    env = {"XLA_FLAGS": xla_env.gpu_defaults({})["XLA_FLAGS"], "JAX_PLATFORMS": "cpu"}
    run = run_python("-c", "import jax; print(jax.numpy.ones(3).sum())", env=env, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "3.0", run.stderr[-500:]


def test_preset_loss_chunk_drops_the_float32_logits_from_temporaries():
    """gpt2-125m, batch 8 on one device: the chunked loss no longer holds the [8, 1024, 50304] float32 logits
    and their gradient (1.65 GB each), so XLA's temporaries shrink by at least 1.5 GB."""
    from tests.helpers import tiny_config
    from train.plan.compile_report import memory_per_device
    from train.trainer import Trainer

    def temp_bytes(chunk):
        config = tiny_config()
        config.model.update(preset="gpt2-125m", loss_chunk_size=chunk)
        config.train.update(global_batch_size=8, memory_check=False)
        return memory_per_device(Trainer.build(config, num_devices=1).compile())["temp_bytes"]

    from models.gpt_config import GPT_PRESETS
    assert GPT_PRESETS["gpt2-125m"]["loss_chunk_size"] > 0
    assert temp_bytes(0) - temp_bytes(None) >= 1.5e9


@pytest.mark.parametrize("preset", ["llama3-tiny"])  # tied head: covers GPT's path too
def test_family_loss_with_chunks_equals_plain(preset):
    import dataclasses

    import models
    cfg = dataclasses.replace(models.from_dict({"preset": preset, "n_layers": 1, "seq_len": 16}), attention="xla")
    params = models.init_params(cfg, 0)
    tokens = jax.random.randint(jax.random.key(2), (2, 17), 0, cfg.vocab_size)
    plain, chunked = (jax.value_and_grad(models.loss)(params, tokens, dataclasses.replace(cfg, loss_chunk_size=c))
                      for c in (0, 6))
    np.testing.assert_allclose(chunked[0], plain[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(chunked[1]), jax.tree.leaves(plain[1])):
        np.testing.assert_allclose(a, b, atol=1e-5)

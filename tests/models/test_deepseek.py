"""DeepSeek-V3 (models/deepseek*.py): judged by transformers on tiny random DeepseekV3ForCausalLM models made here (one
dense layer then mixture layers with a shared expert, 8 experts in 2 groups, YaRN, the balancing bias drawn away
from 0; queries with and without a low rank): imported logits within 1e-5 at every position; a trained run, resumed
once (the bias continues as if uninterrupted), exported, loads in transformers and greedy-decodes as train.sample
does; deepseek-v3-tiny on expert x tensor x fsdp and in a pipeline with `expert` equals one device, the bias
included; the bias evens out skewed routing and takes the load, never the loss's gradient; the MTP loss against the
paper's definition written here; the engine's latent cache decodes as the full forward and holds the formula's
bytes per token."""
import dataclasses
import functools
import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the `hf` extra (transformers, torch) is not installed")
torch = pytest.importorskip("torch", reason="the `hf` extra (transformers, torch) is not installed")

import models  # noqa: E402
from models import attention, deepseek, moe  # noqa: E402
from models.contract import no_constraint  # noqa: E402
from models.layers import rotation  # noqa: E402
from sharding import pipeline as pipeline_lib  # noqa: E402
from tests.helpers import rel_norm, run_steps, tiny_config  # noqa: E402
from tests.hf_models import greedy_as_train_sample  # noqa: E402
from train import placed as placed_lib  # noqa: E402
from train import state as state_lib  # noqa: E402
from train.config.settings import ConfigError  # noqa: E402
from train.export_hf import command as export_hf  # noqa: E402
from train.hf import export as hf_export  # noqa: E402
from train.hf import model as hf_model  # noqa: E402
from train.loop import runner as loop  # noqa: E402
from train.serve.engine import Engine, Settings  # noqa: E402
from train.trainer import Trainer  # noqa: E402

TOKENS = np.random.default_rng(0).integers(0, 128, (2, 32))
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
HF = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
          n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
          v_head_dim=16, max_position_embeddings=64, routed_scaling_factor=2.5, rope_parameters=YARN,
          num_nextn_predict_layers=0)


@functools.lru_cache(maxsize=None)
def _saved(tmp: str, q_lora_rank: int | None) -> tuple[str, np.ndarray]:
    """A random tiny model saved by transformers under `tmp` (norms and the bias drawn away from their ones and
    zeros), and its float32 logits of TOKENS."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **HF, q_lora_rank=q_lora_rank, attn_implementation="eager"))
    with torch.no_grad():
        for name, w in model.named_parameters():
            if "norm" in name:
                w.normal_(1.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.eval().save_pretrained(tmp)
    with torch.no_grad():
        return tmp, model(input_ids=torch.tensor(TOKENS)).logits.numpy()


@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["plain_queries", "low_rank_queries"])
def test_imported_logits_are_transformers_at_every_position(q_lora_rank, tmp_path_factory):
    path, theirs = _saved(str(tmp_path_factory.mktemp("deepseek") / "hf"), q_lora_rank)
    fields = hf_model.fields(f"hf:{path}", hf_model.read_config(f"hf:{path}"), models.FAMILIES["deepseek"])
    cfg = models.from_dict({"family": "deepseek", **fields, "seq_len": 32})
    assert (cfg.q_lora_rank, cfg.n_group, cfg.first_k_dense_replace, cfg.rope_scaling[0]) == (q_lora_rank or 0, 2, 1, 4)
    placed = placed_lib.from_hf(placed_lib.on_one_device(cfg), f"hf:{path}")
    ours = np.asarray(jax.jit(lambda p, t: models.forward(p, t, cfg))(placed.params, TOKENS))
    assert np.abs(ours - theirs).max() < 1e-5


# ----------------------------------------------------------------------------- layouts, and a run on one of them

def _config(**mesh):
    """deepseek-v3-tiny on bytes of text, batches of 8 in 2 slices (a pipeline's 2 microbatches: one reference for
    every layout), lr 1e-2."""
    config = tiny_config("text", **mesh)
    config.model.preset = "deepseek-v3-tiny"
    config.train.update(global_batch_size=8, grad_accum_steps=2, eval_batches=0, log_every=1, loggers="")
    config.optimizer.update(lr=1e-2, warmup_steps=1, decay_steps=50)
    if mesh.get("pipeline", 1) > 1:
        config.train.grad_accum_steps, config.pipeline.microbatches = 1, 2
    return config


def _updates(final, initial):
    return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), final, initial)


STEPS = 4


@functools.lru_cache(maxsize=None)
def _one_device():
    trainer = Trainer.build(_config(), num_devices=1)
    state = jax.device_get(trainer.init_state())
    losses, final = run_steps(trainer, STEPS, jax.device_put(state, trainer.layout.state))
    return state, losses, jax.device_get(final["params"])


def _check_equals_one_device(losses, params):
    """Losses within 1e-4 and the parameters' updates within 1e-5 of one device's (the composition matrix compares
    first-step gradients as closely), the balancing biases equal (they moved: 1e-3 a step)."""
    state, ref_losses, ref_params = _one_device()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert rel_norm(_updates(params, state["params"]), _updates(ref_params, state["params"])) < 1e-5
    for where in ("layers", "mtp"):
        assert np.abs(params[where][moe.BIAS]).max() > 0
        np.testing.assert_array_equal(params[where][moe.BIAS], ref_params[where][moe.BIAS])


LAYOUTS = [{"expert": 2, "tensor": 2, "fsdp": 2}, {"pipeline": 2, "expert": 2, "tensor": 2}]


def test_a_pipeline_with_expert_equals_one_device_with_the_bias():
    """The production step, its chunks' layers back in logical order (expert x tensor x fsdp: the run below)."""
    state = _one_device()[0]
    trainer = Trainer.build(_config(**LAYOUTS[1]), num_devices=math.prod(LAYOUTS[1].values()))
    losses, final = run_steps(trainer, STEPS, trainer.from_logical(jax.device_put(state, trainer.layout.state)))
    params = jax.device_get(final["params"])
    _check_equals_one_device(losses, params if trainer.layer_order is None else
                             pipeline_lib.to_logical(params, trainer.layer_order))


def _params_of(run):
    return export_hf.restore_params(run, None)[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """deepseek-v3-tiny trained STEPS steps by train.loop on expert=2 x tensor=2 x fsdp=2, a checkpoint every 2
    steps; then its last checkpoint removed and the run resumed from step 2 to the end again: (run dir, export dir,
    the params the uninterrupted run ended with, the resumed run's, its model config)."""
    root = tmp_path_factory.mktemp("deepseek_run")
    config = _config(**LAYOUTS[0])
    config.train.steps = STEPS
    config.checkpoint.update(every_steps=2, keep=3)
    loop.run(config, str(root / "run"))
    uninterrupted = _params_of(root / "run")
    shutil.rmtree(root / "run" / "checkpoints" / str(STEPS))
    loop.run(config, str(root / "run"))  # resumes from step 2
    cfg, params, step = export_hf.restore_params(root / "run", None)
    assert step == STEPS
    hf_export.write(root / "out", cfg, params, "float32", None)
    return root / "run", root / "out", uninterrupted, params, cfg


def test_a_run_on_expert_tensor_fsdp_equals_one_device_with_the_bias(trained):
    """The run's logged losses (the resumed steps logged again, equal) and its uninterrupted final params."""
    run, _, uninterrupted, _, _ = trained
    logged = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if "loss" in r}
    _check_equals_one_device([logged[step] for step in range(1, STEPS + 1)], uninterrupted)


def test_a_resumed_run_continues_the_same_bias(trained):
    _, _, uninterrupted, resumed, _ = trained
    assert np.abs(resumed["layers"][moe.BIAS]).max() > 0  # it moved: 1e-3 a step
    for where in ("layers", "mtp"):
        np.testing.assert_array_equal(resumed[where][moe.BIAS], uninterrupted[where][moe.BIAS])
    assert rel_norm(resumed, uninterrupted) == 0


def test_an_exported_run_greedy_decodes_as_train_sample_and_our_forward(trained):
    """train.sample decodes on the engine's latent cache (queries absorbed into the latent), with and without
    speculation, transformers on its expanded keys and values, our full forward over the whole sequence: the same 16
    tokens."""
    run, out, _, params, cfg = trained
    prompt = list(TOKENS[0, :12])
    ours = greedy_as_train_sample(run, out, prompt, "DeepseekV3ForCausalLM")  # ngram guesses on the latent pages
    full = np.asarray(jax.jit(lambda p, t: models.forward(p, t, cfg))(params, np.asarray([prompt + ours])))[0]
    assert ours == np.argmax(full, -1)[len(prompt) - 1:-1].tolist()
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["first_k_dense_replace"] == 1


# ----------------------------------------------------------------------------- balancing, MTP, the latent cache

@functools.lru_cache(maxsize=None)
def _model(**changes):
    cfg = models.from_dict({"preset": "deepseek-v3-tiny", **changes})
    return cfg, models.init_params(cfg, 0)


@functools.lru_cache(maxsize=None)
def _objective_and_grads(cfg):
    """jit((params, tokens [B, 65]) -> ((objective, metrics), grads)): one program per config's trace."""
    return jax.jit(jax.value_and_grad(lambda p, t: models.loss_and_metrics(p, t, cfg), has_aux=True))


def test_the_bias_evens_out_skewed_routing_and_takes_the_load_not_a_gradient():
    """Rows of 4 distinct tokens send a third of the choices to one expert. Every other weight held, the bias alone
    moving 0.01 a step: the busiest expert's share falls over 20 steps; frozen (speed 0), it stays. What reaches the
    bias in place of a gradient is its layer's load over the layers: summed over them, the logged mean load."""
    cfg, params = _model(num_nextn_predict_layers=0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 4, (4, 65)))
    shares = {}
    for speed in (0.01, 0.0):
        update, p, shares[speed] = state_lib.balance_update(speed).update, params, []
        for _ in range(20):
            (_, metrics), grads = _objective_and_grads(cfg)(p, tokens)
            load = np.array([metrics[f"moe_load_e{e}"] for e in range(cfg.n_experts)])
            shares[speed].append(load.max() / load.sum())
            np.testing.assert_allclose(np.asarray(grads["layers"][moe.BIAS]).sum(axis=0), load, rtol=1e-6, atol=1e-7)
            step, _ = update(grads["layers"][moe.BIAS], None)
            p = {**p, "layers": {**p["layers"], moe.BIAS: p["layers"][moe.BIAS] + step}}
    assert shares[0.01][0] > 0.3 and shares[0.01][-1] < 0.2, shares[0.01]
    assert shares[0.0] == [shares[0.0][0]] * 20


def _rms(x, w, eps):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _mtp_reference(params, tokens, cfg):
    """The MTP module's mean cross entropy of t_{i+2}, from the paper's equations (the test's docstring)."""
    inputs, eps, L = tokens[:, :-1], cfg.norm_eps, cfg.seq_len
    top, block = models.top_params(params), deepseek.block(cfg, no_constraint)
    h = deepseek.embed(top, inputs, cfg)
    h = models.family_of(cfg).forward.run_layers(params["layers"], h, inputs, cfg, no_constraint)[0][:, :L - 1]
    m = jax.tree.map(lambda a: a[0], params["mtp"])
    combined = jnp.concatenate([_rms(params["embed"][tokens[:, 1:L]], m["enorm"], eps), _rms(h, m["hnorm"], eps)], -1)
    x = combined @ jnp.concatenate([m["eh_proj"][0], m["eh_proj"][1]], axis=0)
    spec = models.layer_specs(cfg)[-1]
    x = x + block.attention(m["moe"], x, rotation(spec.rope, spec.rope_dim, None),
                            lambda q, k, v: attention.attend(q, k, v, "xla"))
    x, _ = moe.mixture_half(m, x, cfg, no_constraint, block)
    logits = _rms(x, m["head_norm"], eps) @ params["head"]
    target = jnp.take_along_axis(logits, tokens[:, 2:, None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)


def test_the_mtp_loss_is_the_papers_and_off_changes_nothing():
    """DeepSeek-V3 section 2.2, depth 1, written here: h'_i = M [RMSNorm(Emb(t_{i+1})); RMSNorm(h_i)] over the
    positions whose target t_{i+2} is in the row, one transformer block (the model's own), the module's norm and the
    shared head; the loss the mean cross entropy. With its weight 0 the model reads nothing of the modules (given
    params without them) and its objective and gradients are those of the model without MTP."""
    cfg, params = _model()
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (4, 65)))
    objective, metrics = jax.jit(lambda p, t: models.loss_and_metrics(p, t, cfg))(params, tokens)
    reference = jax.jit(functools.partial(_mtp_reference, cfg=cfg))(params, tokens)  # one program, not op by op
    np.testing.assert_allclose(metrics["mtp_loss"], reference, rtol=2e-6)
    without = {k: v for k, v in params.items() if k != "mtp"}
    (off, off_metrics), off_grads = _objective_and_grads(dataclasses.replace(cfg, mtp_loss_weight=0.0))(without, tokens)
    (ref, _), ref_grads = _objective_and_grads(_model(num_nextn_predict_layers=0)[0])(without, tokens)
    assert float(off) == float(ref) and "mtp_loss" not in off_metrics and rel_norm(off_grads, ref_grads) == 0
    assert float(objective) > float(off) + 0.29 * float(reference)  # lambda = 0.3, and the module's router terms


def test_the_latent_cache_holds_the_formulas_bytes():
    """A token holds kv_lora_rank + qk_rope_head_dim numbers per layer (against 2 x heads x (Kn + Kr) for the keys
    and values expanded); the pool holds that per page slot and no value pool."""
    cfg, params = _model()
    placed = placed_lib.on_one_device(cfg)
    engine = Engine(dataclasses.replace(placed, params=jax.device_put(params, placed.layout.params)),
                    Settings(kv_pages=5))
    per_token = cfg.n_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4  # float32
    assert engine.kv_bytes_per_token == per_token == 3 * (32 + 8) * 4
    assert sum(k.nbytes for k in engine.runner.pool["k"]) == 5 * engine.settings.page_size * per_token
    assert engine.runner.pool["v"] == [None] * cfg.n_layers
    assert models.paged.cache_bytes(cfg, 64, cfg.n_heads) == 64 * per_token


def test_pipelines_and_context_refuse_what_does_not_split():
    config = _config(pipeline=4, data=2)
    config.pipeline.microbatches = 4
    with pytest.raises(ConfigError, match="first_k_dense_replace=1 mixture layers are not divisible"):
        Trainer.build(config)
    config = _config(pipeline=2, context=2, data=2)
    with pytest.raises(ConfigError, match="multi-token prediction reads the next positions"):
        Trainer.build(config)


def test_the_671b_sizes_and_its_latent_cache():
    """DeepSeek-V3's published sizes (671B; 37B active with the embedding) from the parameters as built; the stack
    pipelines cut is its 58 mixture layers; a token caches 61 x (512 + 64) bfloat16 numbers, 3.6x fewer bytes than the
    same model with 8 grouped KV heads of 128."""
    cfg = models.from_dict({"preset": "deepseek-v3-671b"})
    abstract, _ = models.abstract_params(cfg)
    assert models.param_count(cfg) == sum(math.prod(a.shape) for a in jax.tree.leaves(abstract))
    without_mtp = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    assert round(models.param_count(without_mtp) / 1e9, 2) == 671.03
    assert round((deepseek.matmul_params(cfg, active=True, with_mtp=False) + 129280 * 7168) / 1e9, 1) == 37.6
    assert models.stack_length(cfg) == 58
    per_token = models.paged.cache_bytes(cfg, 1, cfg.n_heads)
    gqa = models.from_dict({"preset": "llama3-tiny", "d_model": 7168, "n_layers": 61, "n_heads": 128, "n_kv_heads": 8,
                            "head_dim": 128, "compute_dtype": "bfloat16"})
    assert per_token == 61 * 576 * 2 == 70272 and models.paged.cache_bytes(gqa, 1, 8) == 249856

"""Gemma 3, the first family whose layers differ (models/layer_spec.py): judged by transformers on a tiny random
Gemma3ForCausalLM made here (six layers, a window of 8 within 64 positions, each kind its own rotary base, linear
scaling on the global layer, query_pre_attn_scalar apart from head_dim) and on the text tower of a tiny
Gemma3ForConditionalGeneration; a trained run exported loads in transformers and greedy-decodes past the window as
train.sample does; gemma3-tiny on context x tensor, on context=4 (whose sliding layers' ring skips a step the audit
counts) and in a pipeline equals one device; the engine decodes 8x the window with a sliding layer's pages bounded."""
import dataclasses
import functools

import jax
import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the `hf` extra (transformers, torch) is not installed")
torch = pytest.importorskip("torch", reason="the `hf` extra (transformers, torch) is not installed")

import models  # noqa: E402
from models.layer_spec import window_pages  # noqa: E402
from sharding import context as context_lib  # noqa: E402
from tests.helpers import compiled_step, grads_and_run, rel_norm, tiny_config  # noqa: E402
from tests.hf_models import greedy_as_train_sample  # noqa: E402
from train import placed as placed_lib  # noqa: E402
from train.export_hf import command as export_hf  # noqa: E402
from train.hf import export as hf_export  # noqa: E402
from train.hf import model as hf_model  # noqa: E402
from train.hf import restore as hf_import  # noqa: E402
from train.loop import runner as loop  # noqa: E402
from train.plan import audit as audit_lib  # noqa: E402
from train.plan import compile_report as report  # noqa: E402
from train.serve.engine import Engine, SamplingParams, Settings  # noqa: E402
from train.trainer import Trainer  # noqa: E402

TOKENS = np.random.default_rng(0).integers(0, 128, (2, 64))
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24, max_position_embeddings=128,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


def _perturbed(model):
    """Norm weights drawn away from zero (transformers starts them at 0: x (1 + 0))."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if "norm" in name:
                w.normal_(0.0, 0.2)
    return model.eval()


@functools.lru_cache(maxsize=None)
def _saved(tmp: str, multimodal: bool) -> tuple[str, np.ndarray]:
    """A random tiny model saved by transformers under `tmp`, and its float32 logits of TOKENS."""
    torch.manual_seed(0)
    text = transformers.Gemma3TextConfig(**TEXT, attn_implementation="eager")
    if multimodal:
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14)
        model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=127))
    else:
        model = transformers.Gemma3ForCausalLM(text)
    _perturbed(model).save_pretrained(tmp)
    with torch.no_grad():
        return tmp, model(input_ids=torch.tensor(TOKENS)).logits.numpy()


def _imported_logits(path: str) -> np.ndarray:
    fields = hf_model.fields(f"hf:{path}", hf_model.read_config(f"hf:{path}"), models.FAMILIES["gemma3"])
    cfg = models.from_dict({"family": "gemma3", **fields, "seq_len": 64})
    placed = placed_lib.from_hf(placed_lib.on_one_device(cfg), f"hf:{path}")
    return np.asarray(jax.jit(lambda p, t: models.forward(p, t, cfg))(placed.params, TOKENS))


@pytest.mark.parametrize("multimodal", [False, True], ids=["causal_lm", "text_tower"])
def test_imported_logits_are_transformers_at_every_position(multimodal, tmp_path_factory):
    path, theirs = _saved(str(tmp_path_factory.mktemp("gemma3") / "hf"), multimodal)
    ours = _imported_logits(path)
    assert np.abs(ours - theirs).max() < 1e-5
    if multimodal:
        assert "the vision tower" in hf_import.left_out(f"hf:{path}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """gemma3-tiny trained 3 steps on bytes of text (a window of 8), exported: (run dir, export dir)."""
    root = tmp_path_factory.mktemp("gemma3_run")
    config = tiny_config("text", tensor=2)
    config.mesh.data = -1  # the rest of the 8 devices
    config.model.preset = "gemma3-tiny"
    config.train.update(steps=3, global_batch_size=8, eval_batches=0, log_every=1, loggers="")
    config.optimizer.update(lr=1e-2, warmup_steps=1, decay_steps=50)
    loop.run(config, str(root / "run"))
    cfg, params, _ = export_hf.restore_params(root / "run", None)
    hf_export.write(root / "out", cfg, params, "float32", None)
    return root / "run", root / "out"


def test_an_exported_run_greedy_decodes_past_the_window_as_train_sample(trained):
    run, out = trained
    prompt = list(TOKENS[0, :20])  # longer than the window: the sliding layers drop its first positions
    greedy_as_train_sample(run, out, prompt, "Gemma3ForCausalLM")  # with ngram guesses over the sliding pages


def _config(**mesh):
    config = tiny_config(**mesh)
    config.model.preset = "gemma3-tiny"
    return config


@functools.lru_cache(maxsize=None)
def _one_device():
    return grads_and_run(Trainer.build(_config(), num_devices=1), 3)[:2]


@functools.lru_cache(maxsize=None)
def _trainer(mesh: tuple) -> Trainer:
    return Trainer.build(_config(**dict(mesh)))


LAYOUTS = [{"context": 2, "tensor": 2, "data": 2}, {"context": 4, "data": 2}, {"pipeline": 2, "tensor": 2, "data": 2}]


@pytest.mark.parametrize("mesh", LAYOUTS, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_every_layer_kind_on_a_layout_equals_one_device(mesh):
    ref_grads, ref_losses = _one_device()
    grads, losses, _ = grads_and_run(_trainer(tuple(mesh.items())), 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert rel_norm(grads, ref_grads) < 1e-5


def test_a_sliding_layers_ring_sends_only_the_blocks_its_window_reaches():
    """context=4 over 64 positions: chunks of 8, a window of 8 reaches the adjacent chunks alone, which the ring's
    steps 1 and 3 bring; the audit finds those permutes (2 of the 3 blocks of each of 5 sliding layers, all 3 of the
    global one: 13 of the 18 blocks a causal stack sends) and nothing unexpected. (The gradient row holds the tied
    table's gradient twice: XLA all-reduces the lookup's and the head's parts apart, 7% of this tiny model's.)"""
    assert context_lib.ring_steps(4, 64, 8) == (1, 3) and context_lib.ring_steps(4, 64, 0) == (1, 2, 3)
    trainer = _trainer((("context", 4), ("data", 2)))
    result = audit_lib.audit(trainer, report.build(trainer.plan, trainer.mesh, compiled_step(trainer)), "",
                             topology="dgx-h100", hosts=16, mfu=0.4)
    rows = {r["purpose"]: r for r in result["rows"] if r["purpose"] != "scalars (loss, norms)"}
    assert set(rows) == {"gradient all-reduce", "ring attention K/V blocks"}
    ring = rows["ring attention K/V blocks"]
    assert abs(ring["ratio"] - 1) <= 0.01 and ring["exact"], ring


def test_the_engine_decodes_8x_the_window_with_a_sliding_layers_pages_bounded():
    cfg = models.from_dict({"preset": "gemma3-tiny", "seq_len": 128})
    params = jax.tree.map(lambda x: 3 * x if x.ndim >= 2 else x, models.init_params(cfg, 0))  # decisive logits
    placed = placed_lib.on_one_device(cfg)
    placed = dataclasses.replace(placed, params=jax.device_put(params, placed.layout.params))
    engine = Engine.build(placed, Settings(page_size=4, max_num_seqs=2, max_batch_tokens=16, prefill_chunk=16),
                          max_context=128)
    prompt = TOKENS[1, :24].tolist()
    engine.add("a", prompt, SamplingParams(max_tokens=40))
    held, out = [], None
    while engine.has_work():
        for o in engine.step():
            out = o if o.finished else out
        if "a" in engine.requests:
            held.append(engine.kv.held("a"))
    assert engine.runner.windows == [8, 0]
    sliding, causal = zip(*held)
    assert max(sliding) <= window_pages(8, 4) == 3 and causal[-1] == 16 > causal[0]  # 64 tokens: 8x the window
    tokens = prompt + out.token_ids
    full = np.asarray(jax.jit(lambda p, t: models.forward(p, t, cfg))(params, np.asarray([tokens])))[0]
    assert out.token_ids == np.argmax(full, -1)[len(prompt) - 1:-1].tolist()

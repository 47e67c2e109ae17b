"""Short trained runs of the newer families, judged by transformers: Qwen3 trained whole, and LoRA on Mixtral and
Qwen3-MoE (adapters on attention: the base frozen, the loss falls), exported as train.export_hf writes them (LoRA
merged); transformers gives the trained logits, and its greedy tokens are those train.sample draws on the serving
engine (from the adapters as the run keeps them)."""
import json

import jax
import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the `hf` extra (transformers, torch) is not installed")
torch = pytest.importorskip("torch", reason="the `hf` extra (transformers, torch) is not installed")

import checkpoint  # noqa: E402
import models  # noqa: E402
from models import lora  # noqa: E402
from tests import hf_models as families  # noqa: E402
from tests.helpers import losses, tiny_config  # noqa: E402
from train.export_hf import command as export_hf  # noqa: E402
from train.hf import export as hf_export  # noqa: E402
from train.loop import runner as loop  # noqa: E402
from train.sample import command as sample_lib  # noqa: E402

STEPS = 3
NEW = 16


def _config(kind: str, base) -> object:
    """A 3-step run from the Hugging Face base `base` on bytes of Python's sources: Qwen3 on data x tensor = 4 x 2,
    the mixtures with rank-4 adapters on q, k, v, o, Mixtral on expert=2, Qwen3-MoE on tensor=2."""
    config = tiny_config("text", expert=2) if kind == "mixtral" else tiny_config("text", tensor=2)
    config.mesh.data = -1  # the rest of the 8 devices
    if kind == "qwen3":
        config.model.update(**families.QWEN3_OURS, tie_embeddings=False)
    else:
        config.model.update(**families.MIXTURES[kind][1], seq_len=24, tie_embeddings=False, lora_rank=4,
                            lora_alpha=8.0, lora_targets="q,k,v,o")
    config.checkpoint.restore_from = f"hf:{base}"
    config.train.update(steps=STEPS, global_batch_size=8, eval_batches=0, log_every=1, loggers="")
    config.optimizer.update(lr=3e-2 if kind != "qwen3" else 3e-3, warmup_steps=1, decay_steps=50)
    return config


@pytest.fixture(scope="module", params=["qwen3", "mixtral", "qwen3_moe"])
def trained(request, tmp_path_factory):
    """(kind, the HF base, the run's workdir, its export: LoRA merged as --merge_lora writes it)."""
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    base = families.save_qwen3(root / "hf") if kind == "qwen3" else families.save_mixture(kind, root / "hf")
    loop.run(_config(kind, base), str(root / "run"))
    cfg, params, step = export_hf.restore_params(root / "run", None)
    assert step == STEPS
    trained_logits = np.asarray(jax.jit(lambda p, t: models.forward(p, t, cfg))(params, families.TOKENS))
    if lora.enabled(cfg):
        cfg, params = hf_export.merged(cfg, params)
    hf_export.write(root / "out", cfg, params, "float32", None)
    return kind, base, root / "run", root / "out", trained_logits


def test_the_run_trains_and_its_export_gives_the_trained_logits_in_transformers(trained):
    kind, base, run, out, trained_logits = trained
    logged = list(losses(run).values())
    assert len(logged) == STEPS and logged[-1] < logged[0] - 0.05, logged
    ours = np.abs(trained_logits - families.hf_logits(base)).max()
    assert ours > 1e-2, ours  # training changed the model
    np.testing.assert_allclose(families.hf_logits(out), trained_logits, atol=1e-4, rtol=0)
    if kind != "qwen3":  # LoRA: the checkpoint holds the attention adapters only, the base is read again from hf:
        meta = checkpoint.Checkpoints(run / "checkpoints", read_only=True).read_meta(STEPS)
        params = [k for k in meta["arrays"] if k.startswith("params/")]
        assert params and all(k.startswith("params/layers/moe/lora/") for k in params), params
        assert {k.split("/")[4] for k in params} == {"q", "k", "v", "o"}


def test_greedy_tokens_of_train_sample_equal_transformers_generate_on_the_export(trained):
    kind, _, run, out, _ = trained
    prompt = families.TOKENS[0, :8]
    request = sample_lib.Request(prompt_tokens=",".join(map(str, prompt)), max_new=NEW, as_json=True)
    # On the run's mesh, but for `expert`: the serving engine's one sequence cannot split over data x expert.
    mesh = {"data": 8, "expert": 1} if kind == "mixtral" else None
    ours = json.loads(sample_lib.sample(run, None, request, mesh))["tokens"]
    with torch.no_grad():
        theirs = families.hf_model(out).generate(torch.tensor(prompt[None]), max_new_tokens=NEW, do_sample=False,
                                                  min_new_tokens=NEW)
    assert ours == theirs.numpy()[0, 8:].tolist()

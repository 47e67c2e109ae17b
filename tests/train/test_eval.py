"""train.eval against lm-evaluation-harness's own `hf` model on the run's Hugging Face export (the oracle): the
same per-example log-likelihoods and generations on a local multiple-choice and a local generation task; on
data x tensor = 2 x 2 the same as on one device; bad flags are one line and exit 2, writing nothing."""
import json
import sys

import jax
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the `eval` extra (lm_eval) is not installed")

import checkpoint  # noqa: E402
from checkpoint import format as ckpt_format  # noqa: E402
from tests.helpers import ROOT, tiny_config  # noqa: E402
from train import cli  # noqa: E402
from train.data import tokenizer as tok_lib  # noqa: E402
from train.eval import command  # noqa: E402
from train.eval.options import Options  # noqa: E402
from train.hf import export as hf_export  # noqa: E402
from train.loop import saver  # noqa: E402
from train.trainer import Trainer  # noqa: E402

TASKS = ("tiny_choice", "tiny_gen")
INCLUDE = "tests/fixtures/eval"  # the task YAMLs name their JSONL files relative to the repository
STEP = 3


def _tokenizer():
    texts = [line for name in ("tiny_choice.jsonl", "tiny_gen.jsonl")
             for line in (ROOT / INCLUDE / name).read_text().splitlines()]
    return tok_lib.train_bpe(texts * 4, 300)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A llama3-tiny run (2 layers, d_model 64) whose workdir holds a DATADIR's tokenizer.json (a byte-level
    BPE), with a checkpoint of step 3 and its Hugging Face export. The (untied) head is scaled up so greedy
    choices are far from ties."""
    workdir = tmp_path_factory.mktemp("eval") / "run"
    workdir.mkdir()
    tok = _tokenizer()
    tok.save(str(workdir / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    (workdir / "data_meta.json").write_text(json.dumps({"eos_id": tok.token_to_id(tok_lib.EOS_TEXT),
                                                        "vocab_size": vocab}))
    config = tiny_config()
    config.model.update(preset="llama3-tiny", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=96,
                        seq_len=16, vocab_size=vocab, tie_embeddings=False)
    config.train.loggers = ""
    trainer = Trainer.build(config, num_devices=1)
    state = trainer.init_state()
    state["params"]["head"] = state["params"]["head"] * 10.0
    ckpts = checkpoint.Checkpoints(workdir / "checkpoints")
    ckpts.save(STEP, ckpt_format.to_tree(trainer, state, ckpt_format.rng_of(0, trainer.mesh)),
               saver.describe_run(trainer))
    ckpts.wait()
    ckpts.close()
    (workdir / "config.json").write_text(json.dumps({"config": saver.recorded_config(trainer)}))
    export = workdir.parent / "hf"
    params = jax.tree.map(np.asarray, jax.device_get(state["params"]))
    hf_export.write(export, trainer.plan.model, params, "float32", tok_lib.load_run_codec(workdir))
    return workdir, export


def _options(workdir, **kw):
    return Options(workdir, TASKS, batch_size=4, include_path=INCLUDE, **kw)


@pytest.fixture(scope="module")
def ours(run):
    workdir, _ = run
    with pytest.MonkeyPatch.context() as m:
        m.chdir(ROOT)
        return command.evaluate(_options(workdir, mesh={"data": 1}, num_devices=1, json_path=str(workdir / "r.json")),
                                echo=lambda _: None)


def _per_example(results, task):
    """[(doc_id, filtered responses)] of one task, in document order."""
    return sorted((s["doc_id"], s["filtered_resps"]) for s in results["samples"][task])


def _lls(results):
    return np.array([[ll for ll, _ in resps] for _, resps in _per_example(results, "tiny_choice")])


def test_the_harness_hf_model_on_the_export_scores_as_we_do(run, ours, monkeypatch):
    workdir, export = run
    monkeypatch.chdir(ROOT)
    manager = lm_eval.tasks.TaskManager(include_path=INCLUDE, include_defaults=False)
    torch = pytest.importorskip("torch", reason="the `hf` extra (transformers, torch) is not installed")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only waits for the core XLA uses (200x slower here)
    try:
        theirs = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={export},dtype=float32",
                                         tasks=list(TASKS), device="cpu", batch_size=8, task_manager=manager,
                                         verbosity="WARNING")
    finally:
        torch.set_num_threads(threads)
    assert _lls(ours).shape == (7, 3)
    np.testing.assert_allclose(_lls(ours), _lls(theirs), atol=1e-4, rtol=0)
    texts = _per_example(ours, "tiny_gen")
    assert texts == _per_example(theirs, "tiny_gen") and len(texts) == 6
    assert len({resps[0] for _, resps in texts}) >= 3  # generations that differ: a padding mistake would show
    metrics = (("tiny_choice", "acc,none"), ("tiny_choice", "acc_norm,none"), ("tiny_gen", "exact_match,none"))
    for task, metric in metrics:
        assert ours["results"][task][metric] == theirs["results"][task][metric]

    saved = json.loads((workdir / "eval" / f"step_{STEP}.json").read_text())
    assert saved == json.loads((workdir / "r.json").read_text())
    assert saved["step"] == STEP and saved["results"]["tiny_choice"] == ours["results"]["tiny_choice"]
    logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert logged == [{"step": STEP, "kind": "eval_harness",
                       "eval_harness/tiny_choice/acc": ours["results"]["tiny_choice"]["acc,none"],
                       "eval_harness/tiny_choice/acc_norm": ours["results"]["tiny_choice"]["acc_norm,none"],
                       "eval_harness/tiny_gen/exact_match": ours["results"]["tiny_gen"]["exact_match,none"]}]


def test_data_2_tensor_2_scores_as_one_device(run, ours, monkeypatch):
    """Through lm_eval's registry this time: the `spmdtrain` model built from model_args."""
    workdir, _ = run
    monkeypatch.chdir(ROOT)
    manager = lm_eval.tasks.TaskManager(include_path=INCLUDE, include_defaults=False)
    sharded = lm_eval.simple_evaluate(model="spmdtrain", tasks=["tiny_choice"], task_manager=manager,
                                      model_args=f"workdir={workdir},batch_size=4,data=2,tensor=2,num_devices=4",
                                      verbosity="WARNING")
    assert sharded["config"]["model"] == "spmdtrain"
    np.testing.assert_allclose(_lls(sharded), _lls(ours), atol=1e-5, rtol=0)


def test_lm_evals_local_completions_model_against_the_server_scores_as_we_do(run, ours, monkeypatch):
    """lm_eval's `local-completions` model (echo with logprobs, tokenized with the export's tokenizer) against
    train.serve's app over the same run gives train.eval's log-likelihoods and accuracy. lm_eval's max_length 18
    sends rows of 17 tokens, as train.eval keeps (seq_len + 1), and asks for one new token: the engine takes 18."""
    from train import placed as placed_lib
    from train.serve.engine import Engine, Settings
    from train.serve.server import Served, create_app, run_in_thread
    workdir, export = run
    monkeypatch.chdir(ROOT)
    placed = placed_lib.from_run(workdir, mesh={"data": 1}, num_devices=1)
    engine = Engine.build(placed, Settings(page_size=4, max_num_seqs=4, max_batch_tokens=32, prefill_chunk=8,
                                           min_step_tokens=32), max_context=18)
    app = create_app(Served(placed, engine, "run"))
    server, port = run_in_thread(app)
    try:
        manager = lm_eval.tasks.TaskManager(include_path=INCLUDE, include_defaults=False)
        theirs = lm_eval.simple_evaluate(
            model="local-completions", tasks=["tiny_choice"], task_manager=manager, verbosity="WARNING",
            model_args=f"base_url=http://127.0.0.1:{port}/v1/completions,model=run,tokenizer_backend=huggingface,"
                       f"tokenizer={export},max_length=18")
    finally:
        server.should_exit = True
        app.state.service.close()
    np.testing.assert_allclose(_lls(theirs), _lls(ours), atol=1e-4, rtol=0)
    for metric in ("acc,none", "acc_norm,none"):
        assert theirs["results"]["tiny_choice"][metric] == ours["results"]["tiny_choice"][metric]


@pytest.mark.parametrize("change,message", [
    (dict(include_path="tests/fixtures/no_such_folder"), "--include_path=tests/fixtures/no_such_folder: no such file"),
    (dict(tasks=("tiny_choice", "no_such_task_xyz")), "--tasks: no task 'no_such_task_xyz' in lm_eval's registry"),
    (dict(tasks=("tiny_gen_long",), mesh={"data": 1}, num_devices=1),
     "--tasks: task 'tiny_gen_long' asks for max_gen_toks=16, which leaves no context within the model's seq_len=16"),
    (dict(tasks=("tiny_hub",)), "--tasks: the data of task 'tiny_hub' cannot be loaded"),
], ids=["include_path", "task", "max_gen_toks", "hub_offline"])
def test_bad_flags_are_one_line_and_exit_2(run, change, message, monkeypatch, capsys):
    """The Hub dataset is read in offline mode (train/runtime/hub.py turns it on where the Hub cannot be reached;
    here lm_eval's import has read the mode already, so the test sets it where the clients look)."""
    workdir, _ = run
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["train.eval"])
    import datasets
    import huggingface_hub
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    options = Options(workdir, **{"tasks": TASKS, "include_path": INCLUDE, **change})
    before = sorted(p.name for p in workdir.rglob("*"))
    with pytest.raises(SystemExit) as exit_:
        cli.run(lambda argv: command.evaluate(options))
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines
    assert sorted(p.name for p in workdir.rglob("*")) == before

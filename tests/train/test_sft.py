"""Supervised fine-tuning: train.prepare --format=chat gives the tokens and loss mask of the chat template (checked
against transformers' apply_chat_template), masked targets count for nothing, packed conversations score as they
do alone, and every layout normalizes by the global batch's counted targets."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from tests.helpers import rel_norm, tiny_config
from train.data import chat
from train.data import tokenizer as tok_lib
from train.prepare import command as prepare
from train.prepare import encode
from train.trainer import Trainer

# A template in the style of the Hub's: BOS first, every turn closed by the tokenizer's eos_token (here an
# end-of-turn token, not the end-of-document one), {% generation %} around what the assistant says, which is
# what transformers' assistant mask reads: an oracle independent of how prepare finds the assistant's text.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>\n{% generation %}"
            "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{{ '\\n' }}{% else %}<|{{ m['role'] }}|>\n"
            "{{ m['content'] }}{{ eos_token }}{{ '\\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
GOOD = [[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is two and two?"},
         {"role": "assistant", "content": "Four."}],
        [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "hello there"},
         {"role": "user", "content": "Again, en français"}, {"role": "assistant", "content": "bonjour, ça va"}]]
BAD = [[{"role": "user", "content": "nobody answers"}], [{"role": "user"}], "not a list"]


def _jsonl(path, conversations):
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return path


def _hf_dir(path):
    """A small byte-level BPE with <s> and <|end|> as special tokens, and a tokenizer_config.json naming them."""
    path.mkdir()
    text = [m["content"] for conv in GOOD for m in conv] * 20
    tok = tok_lib.train_bpe(text, 300)
    tok.add_special_tokens(["<s>", "<|end|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "<|end|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def _tokens_and_mask(out):
    return np.fromfile(out / "train.bin", np.uint16), np.fromfile(out / "train_mask.bin", np.uint8)


def test_chat_tokens_and_mask_are_the_templates(tmp_path, monkeypatch):
    """Tokens and mask of an hf: tokenizer's template equal transformers' apply_chat_template and assistant mask,
    each conversation followed by the (untrained) end-of-document token, also when every conversation is a work
    unit of its own; the unusable records are counted."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(encode, "CHUNK_BYTES", 1)
    hf = _hf_dir(tmp_path / "tok")
    data = _jsonl(tmp_path / "chats.jsonl", [GOOD[0], BAD[0], GOOD[1], BAD[1], BAD[2]])
    meta = prepare.prepare([str(data)], str(tmp_path / "out"), f"hf:{hf}", val_percent=0, data_format="chat",
                           max_skipped_percent=60)
    assert meta["loss_mask"] and meta["chat_template"] == "tokenizer"
    assert meta["records"] == {"read": 5, "kept": 2, "unrenderable": 2, "no_assistant": 1}
    oracle = transformers.PreTrainedTokenizerFast.from_pretrained(str(hf))
    eos = oracle.convert_tokens_to_ids(tok_lib.EOS_TEXT)
    ids, mask = [], []
    for conversation in GOOD:
        got = oracle.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        ids += [*got["input_ids"], eos]
        mask += [*got["assistant_masks"], 0]
    tokens, written = _tokens_and_mask(tmp_path / "out")
    np.testing.assert_array_equal(tokens, ids)
    np.testing.assert_array_equal(written, mask)
    assert meta["train"]["targets"] == sum(mask) > 0


def test_default_template_and_too_many_bad_records(tmp_path):
    """The bytes tokenizer renders DEFAULT_TEMPLATE (ChatML's layout as text): the mask keeps the assistant's
    content and <|im_end|>, not the line break after it; past --max_skipped_percent nothing is written."""
    data = _jsonl(tmp_path / "one.jsonl", [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]])
    meta = prepare.prepare([str(data)], str(tmp_path / "out"), "bytes", val_percent=0, data_format="chat")
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"
    start, end = text.index("Yo"), text.index("Yo") + len("Yo<|im_end|>")
    tokens, mask = _tokens_and_mask(tmp_path / "out")
    np.testing.assert_array_equal(tokens, [*text.encode(), meta["eos_id"]])
    np.testing.assert_array_equal(np.flatnonzero(mask), np.arange(start, end))
    assert meta["chat_template"] == "default" and meta["records"]["kept"] == 1

    bad = _jsonl(tmp_path / "bad.jsonl", [GOOD[0], *BAD])
    with pytest.raises(chat.ChatError, match=r"^--format=chat: 1 of 4 conversations kept, skipped 2 that the "
                                                   r"template cannot render, 1 without an assistant turn, more than "
                                                   r"--max_skipped_percent=50;"):
        prepare.prepare([str(bad)], str(tmp_path / "bad-out"), "bytes", val_percent=0, data_format="chat")
    assert not (tmp_path / "bad-out").exists()


# Qwen3's layout, written here: ChatML turns with <|im_start|> and <|im_end|> as special tokens; the assistant turn
# after the last user message opens with an empty think block, earlier assistant turns are rendered bare.
QWEN3_STYLE = ("{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
               "{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
               "{%- for m in messages -%}{%- if m['role'] == 'assistant' and loop.index0 > ns.last -%}"
               "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' -}}"
               "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
               "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def test_a_template_that_renders_the_last_assistant_turn_apart(tmp_path):
    """With a Qwen3-style template an earlier assistant turn renders otherwise in the conversation than as its
    last turn: every conversation is kept, the tokens are transformers' apply_chat_template, and the mask holds
    each assistant turn as the conversation renders it (the last one with its empty think block)."""
    transformers = pytest.importorskip("transformers")
    hf = tmp_path / "tok"
    hf.mkdir()
    tok = tok_lib.train_bpe([m["content"] for conv in GOOD for m in conv] * 20, 300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN3_STYLE, "eos_token": "<|im_end|>",
                                                          "tokenizer_class": "PreTrainedTokenizerFast"}))
    data = _jsonl(tmp_path / "chats.jsonl", GOOD)
    meta = prepare.prepare([str(data)], str(tmp_path / "out"), f"hf:{hf}", val_percent=0, data_format="chat")
    assert meta["records"]["kept"] == 2, meta["records"]
    oracle = transformers.PreTrainedTokenizerFast.from_pretrained(str(hf))
    eos = oracle.convert_tokens_to_ids(tok_lib.EOS_TEXT)
    want = [t for conv in GOOD for t in (*oracle.apply_chat_template(conv, tokenize=True, return_dict=True)[
        "input_ids"], eos)]
    tokens, mask = _tokens_and_mask(tmp_path / "out")
    np.testing.assert_array_equal(tokens, want)
    runs = np.split(tokens, np.flatnonzero(np.diff(mask.astype(int)) != 0) + 1)
    kept = [oracle.decode(r) for r, on in zip(runs, np.split(mask, np.flatnonzero(np.diff(mask.astype(int))) + 1))
            if on[0]]
    think = "<think>\n\n</think>\n\n"
    assert kept == [think + "Four.<|im_end|>", "hello there<|im_end|>", think + "bonjour, ça va<|im_end|>"], kept


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """(DATADIR of conversations of random words prepared with the bytes tokenizer and the default template, the
    model the runs on it train, its initial params, and jit(params, one row [1, 17]) -> (loss, grads, per-token
    cross-entropies from the plain forward pass)): compiled once for every test below."""
    tmp = tmp_path_factory.mktemp("sft")
    rng = np.random.default_rng(2)
    words = ["alpha", "beta", "gamma", "delta", "echo", "fox", "golf", "hotel"]
    say = lambda n: " ".join(rng.choice(words, n))  # noqa: E731
    conversations = [[{"role": "user", "content": say(rng.integers(1, 6))},
                      {"role": "assistant", "content": say(rng.integers(1, 9))}] for _ in range(60)]
    prepare.prepare([str(_jsonl(tmp / "chats.jsonl", conversations))], str(tmp / "data"), "bytes", val_percent=10,
                    data_format="chat")
    cfg = Trainer.build(_config(tmp / "data"), num_devices=1).plan.model
    params = jax.device_get(jax.jit(models.init_params, static_argnums=(0, 1))(cfg, 0))

    def probe(params, rows_1xL1):
        loss, grads = jax.value_and_grad(models.loss)(params, rows_1xL1, cfg)
        ids_1xL1 = jnp.where(rows_1xL1 < 0, -rows_1xL1 - 1, rows_1xL1)
        logits = models.forward(params, ids_1xL1[:, :-1], cfg)
        return loss, grads, -jnp.take_along_axis(jax.nn.log_softmax(logits), ids_1xL1[:, 1:, None], -1)[..., 0]
    return tmp / "data", cfg, params, lambda params, rows: jax.device_get(jax.jit(probe)(params, rows))


def _config(path, **mesh):
    config = tiny_config("tokens", **mesh)
    config.data.update(path=str(path), document_mask=True, loss_mask=True)
    config.model.update(n_layers=2, d_model=32, n_heads=4, seq_len=16)  # two layers: one per pipeline stage
    config.train.global_batch_size = 8
    return config


def _counted(rows, eos) -> int:
    """The targets of rows that count: stored as they are (not masked) and not after an end-of-document input."""
    ids = np.where(rows < 0, -rows - 1, rows)
    return int(np.sum((rows[:, 1:] >= 0) & (ids[:, :-1] != eos)))


def _masked(ids, counted):
    """Rows of ids with the targets that do not count stored as -(id+1), as the loader writes them."""
    return np.where(counted, ids, -np.asarray(ids) - 1).astype(np.int32)


def test_masked_targets_count_for_nothing(sft):
    """The loss is the mean of the plain forward pass's cross-entropies over the counted targets (neither masked
    nor after an end-of-document input); changing a masked target changes neither the loss nor any gradient,
    while changing a counted one does."""
    _, cfg, params, probe = sft
    eos = cfg.document_eos_id
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 250, (1, 17))
    ids[0, 7] = eos
    counted = rng.random((1, 17)) < 0.5
    counted[0, -1] = False
    loss, grads, per_token = probe(params, _masked(ids, counted))
    kept = counted[:, 1:] & (ids[:, :-1] != eos)
    np.testing.assert_allclose(loss, per_token[kept].mean(), rtol=1e-6)

    other = ids.copy()
    other[0, -1] = ids[0, -1] + 1
    same_loss, same_grads, _ = probe(params, _masked(other, counted))
    assert float(same_loss) == float(loss)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(same_grads), jax.tree.leaves(grads)))
    counted[0, -1] = True
    assert float(probe(params, _masked(other, counted))[0]) != float(probe(params, _masked(ids, counted))[0])


def test_packed_conversations_score_as_they_do_alone(sft):
    """Two conversations packed in one row (EOS between) give the loss and gradients of each alone in a row of its
    own (padded with masked tokens), weighted by their counted targets."""
    _, cfg, params, probe = sft
    rng = np.random.default_rng(1)
    first, second = rng.integers(0, 250, 6), rng.integers(0, 250, 10)
    first_counted, second_counted = rng.random(6) < 0.6, rng.random(10) < 0.6
    row = lambda *parts: _masked(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))[None]  # noqa: E731
    eos, pad = ([cfg.document_eos_id], [False]), lambda n: (np.ones(n, int), np.zeros(n, bool))
    packed = row((first, first_counted), eos, (second, second_counted))
    alone = [row((first, first_counted), eos, pad(10)), row((second, second_counted), pad(7))]
    loss, grads, _ = probe(params, packed)
    parts = [(_counted(r, cfg.document_eos_id), *probe(params, r)[:2]) for r in alone]
    total = sum(n for n, _, _ in parts)
    assert total == _counted(packed, cfg.document_eos_id) == first_counted[1:].sum() + second_counted[1:].sum()
    np.testing.assert_allclose(loss, sum(n * part for n, part, _ in parts) / total, rtol=1e-5)
    weighted = jax.tree.map(lambda a, b: (parts[0][0] * a + parts[1][0] * b) / total, parts[0][2], parts[1][2])
    assert rel_norm(grads, weighted) < 1e-5


def _loss_and_grads(config, params, num_devices=None):
    trainer = Trainer.build(config, num_devices=num_devices)
    params = jax.device_put(params, trainer.layout.state["params"])
    return jax.device_get(jax.jit(trainer.loss_and_grad)(params, trainer.batch(0))), trainer


def test_sft_loss_is_the_global_mean_in_every_layout(sft):
    """Gradient accumulation on data x tensor and a 1F1B pipeline over data give the loss and
    gradients of the batch's rows taken one by one on one device, weighted by their counted targets, though
    accumulation slices and microbatches hold different numbers of the assistant's tokens."""
    path, cfg, params, probe = sft
    accum_config = _config(path, data=2, tensor=2)
    accum_config.train.grad_accum_steps = 2
    (loss, grads), accum = _loss_and_grads(accum_config, params, num_devices=4)
    assert accum.plan.model == cfg
    batch = np.asarray(accum.batch(0))
    assert (batch < 0).any() and (batch >= 0).any()
    counts = [_counted(row[None], cfg.document_eos_id) for row in batch]
    assert sum(counts[:4]) != sum(counts[4:])  # unequal slices: an unweighted average would be off
    rows = [probe(params, row[None])[:2] for row in batch]
    ref_loss = sum(n * r[0] for n, r in zip(counts, rows)) / sum(counts)
    ref_grads = jax.tree.map(lambda *g: sum(n * x for n, x in zip(counts, g)) / sum(counts), *[r[1] for r in rows])
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert rel_norm(grads, ref_grads) < 1e-5

    piped_config = _config(path, pipeline=2, data=4)
    piped_config.pipeline.update(schedule="1f1b", microbatches=2)
    (loss, grads), _ = _loss_and_grads(piped_config, params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert rel_norm(grads, ref_grads) < 1e-5

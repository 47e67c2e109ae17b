"""The OpenAI-compatible server (train/serve/server.py) over a tiny model, one uvicorn in a thread for the module:
greedy completions (streamed or not) equal the full forward pass's tokens, chat renders with prepare's template,
usage counts, /v1/models, /health, /metrics; 400s name their field, 401 without the key, 429 on a full queue, a
client gone mid-stream frees its pages, a drain refuses new requests and finishes the running ones; the command's
bad flags are one error line, exit 2."""
import dataclasses
import json
import subprocess
import sys
import threading
import time

import httpx
import jax
import numpy as np
import openai
import pytest

import models
from tests.helpers import tiny_config
from train import placed as placed_lib
from train.data import chat as chat_lib
from train.data import tokenizer as tok_lib
from train.serve.engine import Engine, Settings
from train.serve.sampling import SamplingParams
from train.serve.server import Served, create_app, run_in_thread

KEY = "test-key"
SETTINGS = Settings(page_size=4, max_num_seqs=4, max_batch_tokens=32, prefill_chunk=8, max_waiting=2,
                    min_step_tokens=8)  # three step shapes compiled (8, 16, 32)
CONTEXT = 96
PROMPT = [5, 9, 2, 7, 1, 3]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    config = tiny_config()
    config.model.preset = "llama3-tiny"
    config.model.update(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_mlp=128, seq_len=32, vocab_size=256,
                        compute_dtype="float32", param_dtype="float32")
    placed = placed_lib.initialized(placed_lib.place(config, 1))
    codec = tok_lib.Codec(tok_lib.bytes_tokenizer(), 256, None, from_run=False)
    placed = dataclasses.replace(placed, codec=codec)
    served = Served(placed, Engine.build(placed, SETTINGS, max_context=CONTEXT), "tiny", chat_lib.Renderer("bytes"))
    app = create_app(served, api_key=KEY)
    uv, port = run_in_thread(app)
    url = f"http://127.0.0.1:{port}"
    yield {"url": url, "served": served, "service": app.state.service,
           "client": openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0),
           "http": httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)}
    uv.should_exit = True
    app.state.service.close()


def _greedy(placed, prompt, new):
    """Greedy tokens of the full forward pass, re-run on the whole sequence for each token."""
    forward = jax.jit(lambda p, t: models.forward(p, t, placed.model))
    tokens = list(prompt)
    for _ in range(new):
        tokens.append(int(np.argmax(forward(placed.params, np.asarray([tokens], np.int32))[0, -1])))
    return tokens[len(prompt):]


def _all_free(served, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = served.engine.stats()
        if s["running"] == s["waiting"] == 0 and s["pages_used"] == 0:
            return True
        time.sleep(0.02)
    return False


def test_completions_greedy_equal_the_forward_pass_streamed_or_not(server):
    client, served = server["client"], server["served"]
    want = _greedy(served.placed, PROMPT, 6)
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    codec = served.placed.codec
    assert got.choices[0].text == codec.decode(want) and got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (6, 6, 12)
    assert got.choices[0].logprobs.tokens == [codec.decode([t]) for t in want]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 6 and "".join(texts) == codec.decode(want)
    assert chunks[-1].usage.completion_tokens == 6
    text = client.completions.create(model="tiny", prompt="def f", max_tokens=4, temperature=0)
    assert text.choices[0].text == codec.decode(_greedy(served.placed, codec.encode("def f"), 4))


def test_stop_strings_and_seeds(server):
    client = server["client"]
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = whole[4:6]
    cut = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == whole[:whole.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    drawn = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7,
                                       logprobs=1).choices[0].logprobs.tokens for _ in range(2)]
    assert drawn[0] == drawn[1]


def test_chat_renders_with_prepares_template_streamed_or_not(server):
    client, served = server["client"], server["served"]
    prompt = served.placed.codec.encode(chat_lib.Renderer("bytes").render(MESSAGES, add_generation_prompt=True))
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0)
    assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens <= 5
    assert got.choices[0].message.role == "assistant"
    want = served.placed.codec.decode(_greedy(served.placed, prompt, got.usage.completion_tokens))
    assert got.choices[0].message.content == want.split("<|im_end|>")[0]
    streamed = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == got.choices[0].message.content


def test_models_health_and_metrics(server):
    assert [m.id for m in server["client"].models.list().data] == ["tiny"]
    http = server["http"]
    assert http.get("/health").json() == {"status": "ok"}
    text = http.get("/metrics").text
    for name in ("serve_running_requests", "serve_waiting_requests", "serve_kv_pages_used", "serve_kv_pages_free",
                 "serve_prefix_cache_hit_rate", "serve_time_to_first_token_seconds_bucket",
                 "serve_inter_token_latency_seconds_bucket", "serve_generation_tokens_total"):
        assert f"\n{name}" in text, name
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    generated = server["served"].engine.stats()["tokens_generated"]
    assert generated > 0 and float(values["serve_generation_tokens_total"]) == generated
    assert float(values["serve_kv_pages_used"]) == 0 and float(values["serve_running_requests"]) == 0


@pytest.mark.parametrize("body, param", [
    ("{not json", None),
    ({"model": "other", "prompt": "a"}, "model"),
    ({"prompt": "a", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": [1, 2, 999]}, "prompt"),
    ({"prompt": "a", "max_tokens": CONTEXT}, "max_tokens"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param):
    data = body if isinstance(body, str) else json.dumps(body)
    r = server["http"].post("/v1/completions", content=data)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_chat_bad_messages_and_logprobs_are_400(server):
    http = server["http"]
    assert http.post("/v1/chat/completions", json={"messages": "hi"}).json()["error"]["param"] == "messages"
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_api_key(server):
    url = server["url"]
    assert httpx.post(url + "/v1/completions", json={"prompt": "a"}).status_code == 401
    r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_full_queue_is_429_with_retry_after(server):
    served, loop = server["served"], server["service"].loop
    with loop.lock:  # no step runs: what is added stays waiting
        for i in range(SETTINGS.max_waiting):
            served.engine.add(f"filler-{i}", [1, 2], SamplingParams(max_tokens=2))
        r = server["http"].post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        for i in range(SETTINGS.max_waiting):
            served.engine.abort(f"filler-{i}")
    assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
    assert _all_free(served)


def test_a_client_gone_mid_stream_frees_its_pages(server):
    served = server["served"]
    body = {"prompt": PROMPT, "max_tokens": CONTEXT - len(PROMPT), "temperature": 0, "stream": True}
    before = served.engine.stats()["tokens_generated"]
    with server["http"].stream("POST", "/v1/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen == 2:
                break
    assert _all_free(served)
    assert served.engine.stats()["tokens_generated"] - before < CONTEXT - len(PROMPT)


def test_drain_refuses_new_requests_and_finishes_running_ones(server):
    service, http = server["service"], server["http"]
    got, first = [], threading.Event()

    def stream():
        body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    got.append(line)
                    first.set()
    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(10)
    drained = []
    drainer = threading.Thread(target=lambda: drained.append(service.drain(30)))
    drainer.start()
    try:
        while not service.draining:
            time.sleep(0.01)
        r = http.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 503 and r.json()["error"]["message"]
        reader.join(30)
        drainer.join(30)
    finally:
        service.draining = False
    assert drained == [True] and got[-1] == "data: [DONE]" and len(got) == 41


def test_a_drain_out_of_time_aborts_what_runs(server):
    service, http, served = server["service"], server["http"], server["served"]
    body = {"prompt": PROMPT, "max_tokens": CONTEXT - len(PROMPT), "temperature": 0, "stream": True}
    events = []
    try:
        with http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line[len("data: "):])
                    if len(events) == 1:
                        assert service.drain(0) is False
    finally:
        service.draining = False
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    assert len(events) < CONTEXT - len(PROMPT) and _all_free(served)


def test_the_command_fails_in_one_line_before_loading():
    r = subprocess.run([sys.executable, "-m", "train.serve", "--workdir=/nonexistent/run"], capture_output=True,
                       text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --workdir="), r.stderr


def test_a_hugging_face_directory_is_served_within_the_context_its_config_names(tmp_path):
    """`--hf=DIR` takes the model's context from config.json (max_position_embeddings), not from the preset the
    family's fields are laid over."""
    from train.config.experiment import base_config, resolve
    from train.hf import serving as hf_serving
    cfg = models.from_dict({"preset": "llama3-tiny", "seq_len": 96})
    family = models.family_of(cfg)
    (tmp_path / "config.json").write_text(json.dumps(family.hf.hf_config(cfg, "float32", None, 0)))
    plan = resolve(hf_serving.config_for(base_config(), tmp_path, {"data": 1}), 1)
    assert plan.model.seq_len == 96 != models.from_dict({"preset": "llama3-tiny"}).seq_len


def test_the_detokenizer_streams_the_whole_text_and_holds_half_characters():
    from train.serve.detokenize import Detokenizer
    codec = tok_lib.Codec(tok_lib.bytes_tokenizer(), 256, None, from_run=False)
    text = "a é 日本 🙂\n"
    ids = codec.encode(text)
    detok = Detokenizer(codec)
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == detok.text == text and pieces[ids.index(0xC3)] == ""  # é's first byte waits
    detok.add(0xF0)  # the first byte of a 4-byte character, and no more: U+FFFD once flushed, as a whole decode
    assert detok.text == text and detok.flush() == "\ufffd" == codec.decode(ids + [0xF0])[len(text):]

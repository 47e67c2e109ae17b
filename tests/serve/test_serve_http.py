"""The OpenAI-compatible server (train/serve/server.py) over a tiny model, one uvicorn in a thread for the module:
greedy completions (streamed or not) equal the full forward pass's tokens, chat renders with prepare's template,
usage counts, /v1/models, /health, /metrics; 400s name their field, 401 without the key, 429 on a full queue, a
client gone mid-stream frees its pages, a drain refuses new requests and finishes the running ones; the command's
bad flags are one error line, exit 2."""
import dataclasses
import json
import socket
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
                    min_step_tokens=8, max_body_bytes=1 << 18)  # three step shapes compiled (8, 16, 32)
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
                 "serve_inter_token_latency_seconds_bucket", "serve_generation_tokens_total",
                 "serve_spec_decode_draft_tokens_total", "serve_spec_decode_accepted_tokens_total",
                 "serve_spec_decode_verify_steps_total", "serve_spec_decode_mean_accepted_length"):
        assert f"\n{name}" in text, name
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    generated = server["served"].engine.stats()["tokens_generated"]
    assert generated > 0 and float(values["serve_generation_tokens_total"]) == generated
    assert float(values["serve_kv_pages_used"]) == 0 and float(values["serve_running_requests"]) == 0


DEEP = 100_000


@pytest.mark.parametrize("body, param", [
    ("{not json", None),
    ({"model": "other", "prompt": "a"}, "model"),
    ({"prompt": "a", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": [1, 2, 999]}, "prompt"),
    ({"prompt": "a", "max_tokens": CONTEXT}, "max_tokens"),
    ('{"prompt": "\\ud800abc"}', "prompt"),  # a lone surrogate: not text
    ('{"prompt": ' + "[" * DEEP + "]" * DEEP + "}", None),  # too deep for the JSON parser
    ('{"prompt": "a", "user": ' + "[" * 40 + "]" * 40 + "}", "user"),  # parsed, then too deep
    ('{"prompt": "a", "temperature": Infinity}', "temperature"),
    ('{"prompt": "a", "top_p": NaN}', "top_p"),
    ({"prompt": "a", "max_tokenz": 8}, "max_tokenz"),
    ({"prompt": "a", "best_of": 2}, "best_of"),
    ({"prompt": "a", "logit_bias": {"5": 10}}, "logit_bias"),
    ({"prompt": "a", "suffix": "b"}, "suffix"),
    ({"prompt": "a", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "a", "n": 2}, "n"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param):
    data = body if isinstance(body, str) else json.dumps(body)
    r = server["http"].post("/v1/completions", content=data)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


@pytest.mark.parametrize("change, param", [
    ({"messages": "hi"}, "messages"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"echo": True}, "echo"),
])
def test_chat_bad_requests_are_400_naming_the_field(server, change, param):
    r = server["http"].post("/v1/chat/completions", json={"messages": MESSAGES, **change})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_fields_that_ask_for_nothing_pass_and_a_tiny_top_p_keeps_the_likeliest(server):
    """top_p 1e-300 (0 in float32) keeps the most likely token alone: the greedy one."""
    http, codec = server["http"], server["served"].placed.codec
    body = {"prompt": PROMPT, "max_tokens": 4, "best_of": 1, "logit_bias": {}, "suffix": "", "user": "u",
            "presence_penalty": 0}
    greedy = http.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
    r = http.post("/v1/completions", json={**body, "temperature": 1.0, "top_p": 1e-300, "seed": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy == \
        codec.decode(_greedy(server["served"].placed, PROMPT, 4))


def test_every_error_is_in_openais_format(server):
    http, url = server["http"], server["url"]
    big = http.post("/v1/completions", content=b'{"prompt": "' + b"a" * (1 << 19) + b'"}')
    chunked = http.post("/v1/completions", content=iter([b'{"prompt": "', b"a" * (1 << 19), b'"}']))
    missing = http.get("/v1/nothing")
    wrong = http.get("/v1/completions")
    for r, status in ((big, 413), (chunked, 413), (missing, 404), (wrong, 405)):
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    assert httpx.get(url + "/v1/models").json()["error"]["code"] == "invalid_api_key"


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


def test_echo_puts_the_prompt_and_its_log_probabilities_first(server):
    """`echo` with `logprobs` (what lm-eval's local-completions model scores with): the prompt's tokens' log-
    probabilities equal the forward pass's, the first one null."""
    http, placed = server["http"], server["served"].placed
    codec = placed.codec
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                                           "echo": True}).json()["choices"][0]
    logits = np.asarray(jax.jit(lambda p, t: models.forward(p, t, placed.model))(
        placed.params, np.asarray([PROMPT], np.int32))[0], np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    want = [logp[i, t] for i, t in enumerate(PROMPT[1:])]
    lp = r["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and len(lp["tokens"]) == 7
    np.testing.assert_allclose(lp["token_logprobs"][1:6], want, atol=1e-5)
    assert r["text"] == codec.decode(PROMPT) + codec.decode(_greedy(placed, PROMPT, 1))
    plain = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "temperature": 0, "echo": True})
    assert plain.json()["choices"][0]["text"].startswith("ab")


def test_a_client_gone_without_streaming_frees_its_slot_within_2_seconds(server):
    """The engine is held between steps while the client times out and hangs up: its request then leaves within
    a step, read from /metrics."""
    served, loop, http = server["served"], server["service"].loop, server["http"]
    before = served.engine.stats()["tokens_generated"]
    body = {"prompt": PROMPT, "max_tokens": CONTEXT - len(PROMPT), "temperature": 0}
    with loop.lock:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=0.5)
    deadline, values = time.monotonic() + 2, {}
    while time.monotonic() < deadline:
        text = http.get("/metrics").text
        values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        if float(values["serve_running_requests"]) == float(values["serve_waiting_requests"]) == 0 and \
                float(values["serve_kv_pages_used"]) == 0:
            break
        time.sleep(0.02)
    assert float(values["serve_running_requests"]) == 0 and float(values["serve_kv_pages_used"]) == 0, values
    assert served.engine.stats()["tokens_generated"] - before < CONTEXT - len(PROMPT)


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


def test_a_pool_too_small_a_port_in_use_and_an_unknown_host_are_one_line_before_loading(tmp_path):
    """`--config.serve.kv_pages=1` over a Hugging Face directory holding config.json alone (no weights: the error
    comes before they are read), with --num_cpu_devices as every command takes it; the address checks in process."""
    from train.config.experiment import ConfigError
    from train.serve import command
    cfg = models.from_dict({"preset": "llama3-tiny", "seq_len": 64})
    (tmp_path / "config.json").write_text(json.dumps(models.family_of(cfg).hf.hf_config(cfg, "float32", None, 0)))
    r = subprocess.run([sys.executable, "-m", "train.serve", f"--hf={tmp_path}", "--port=0", "--num_cpu_devices=2",
                        "--config.serve.kv_pages=1"], capture_output=True, text=True, timeout=300)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: serve.kv_pages=1: too few for one "
                                                                         "sequence of 64 positions"), r.stderr
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--port={port}: cannot listen on 127.0.0.1:{port}"):
            command.check_address("127.0.0.1", port)
    with pytest.raises(ConfigError, match="--host=no-such-host.invalid: cannot resolve it"):
        command.check_address("no-such-host.invalid", 8000)


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

"""Load generator for any OpenAI-compatible server: streamed `/v1/completions` requests at fixed concurrencies
or Poisson arrival rates; per level the request and output-token throughput, TTFT and inter-token latency (the
gaps between successive streamed chunks, as `vllm bench serve` counts them) percentiles and end-to-end latency.

    python -m experiments.bench_serve --url=http://127.0.0.1:8000 --concurrency=1,4,16,64
    python -m experiments.bench_serve --url=... --request_rate=2,8 --num_prompts=200 --tokenizer=HF_DIR
    python -m experiments.bench_serve --url=... --peer=transformers --peer_model=HF_DIR --tokenizer=HF_DIR

`--speculative=ngram|draft` starts train.serve itself on --model_dir twice, speculation off then on (draft: with
--draft), and measures both with the same requests over the usual random prompts and repetitive ones
(experiments/bench_serve_spec.py):

    python -m experiments.bench_serve --speculative=ngram --model_dir=HF_DIR --tokenizer=HF_DIR --concurrency=1,16

`--engine_only` measures the serving engine (train/serve/) in process, no HTTP: the step time at a full batch of
--engine_seqs decoding sequences beside a bare jitted decode step of the same model, batch and cache length over a
contiguous KV cache (experiments/bare_decode.py), and the engine's throughput by serve.max_num_seqs
(--seqs). Weights are random: speed does not depend on their values.

    python -m experiments.bench_serve --engine_only --preset=llama3-tiny --engine_seqs=16 --seqs=1,8,16
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time

import httpx
import numpy as np
from absl import app, flags

from experiments import bench_servers as servers

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defined only when run as a script, so tests can import this module beside other tools' flags."""
    flags.DEFINE_string("url", "http://127.0.0.1:8000", "The server's base URL (without /v1).")
    flags.DEFINE_string("model", "", "The `model` field of each request (default: the server's first).")
    flags.DEFINE_string("api_key", "", "Sent as `Authorization: Bearer KEY` when set.")
    flags.DEFINE_list("concurrency", ["1", "4", "16", "64"], "Requests in flight, one level each.")
    flags.DEFINE_list("request_rate", [], "Poisson arrival rates (requests/s), one level each; replaces "
             "--concurrency when set.")
    flags.DEFINE_integer("num_prompts", 64, "Requests per level.")
    flags.DEFINE_integer("input_len", 32, "Prompt tokens per request (random token ids).")
    flags.DEFINE_integer("output_len", 32, "Tokens each request generates (end of text ignored).")
    flags.DEFINE_integer("vocab", 256, "Random prompt ids are drawn below this (without --tokenizer).")
    flags.DEFINE_string("tokenizer", "", "A Hugging Face model directory: random ids are decoded to "
             "text with its tokenizer (servers that take text prompts only).")
    flags.DEFINE_list("prompts", [], "Prompt sets, one table block each: usual (random text or ids, the default), "
                      "repetitive (a passage said twice and begun again), or a text file of prompts, one a line.")
    flags.DEFINE_integer("seed", 0, "Seed of the prompts and the arrival times.")
    flags.DEFINE_integer("repeat", 1, "Runs of each level; the table shows each figure's median over them (a "
                         "shared or noisy machine).")
    flags.DEFINE_string("json", "", "Also write the rows to this JSON file.")
    flags.DEFINE_enum("peer", "", ["", "transformers"], "Also start this server on --peer_model and measure "
             "it with the same requests, side by side.")
    flags.DEFINE_string("peer_model", "", "The peer's model: a `train.export_hf` output directory.")
    flags.DEFINE_integer("peer_port", 8031, "The peer server's port on 127.0.0.1.")
    flags.DEFINE_float("timeout", 600.0, "Seconds one request may take.")
    flags.DEFINE_boolean("engine_only", False, "Measure the engine in process instead of a server: "
             "its step time beside a bare decode step, and its throughput by --seqs.")
    flags.DEFINE_string("preset", "llama3-tiny", "--engine_only: the model preset (a family with paged "
             "decoding).")
    flags.DEFINE_integer("vocab_size", 0, "--engine_only: the model's vocabulary (0: the preset's); e.g. 1024 for "
                         "the README's train-bpe:1024 stand-in.")
    flags.DEFINE_integer("engine_seqs", 16, "--engine_only: the full batch the step times compare.")
    flags.DEFINE_list("seqs", ["1", "8", "16"], "--engine_only: serve.max_num_seqs values of the throughput "
             "table (empty: no table).")
    flags.DEFINE_integer("steps", 20, "--engine_only: decode steps timed (the median is reported).")
    flags.DEFINE_enum("speculative", "", ["", "ngram", "draft"], "Start train.serve on --model_dir with speculation "
                      "off, then with this, and measure both (default prompt sets: usual,repetitive).")
    flags.DEFINE_string("model_dir", "", "--speculative: the model train.serve serves (a run's directory or a "
                        "Hugging Face one).")
    flags.DEFINE_string("draft", "", "--speculative=draft: the draft model (serve.draft: a run's directory or hf:DIR).")
    flags.DEFINE_integer("num_speculative_tokens", 0, "--speculative: serve.num_speculative_tokens (0: its default).")
    flags.DEFINE_integer("serve_port", 8032, "--speculative: the port of train.serve without speculation "
                         "(127.0.0.1); the next one: with it.")


@dataclasses.dataclass
class Result:
    """One request as the client saw it: when each streamed chunk with text arrived, relative to the send."""
    ok: bool
    chunk_times: list[float]
    latency: float
    output_tokens: int
    error: str = ""
    text: str = ""  # the streamed text: greedy outputs of two servers compare by it


def percentile(values, q: float) -> float:
    """The q-th percentile (linear interpolation, numpy's default), in the values' units; nan when empty."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(results: list[Result], duration: float) -> dict:
    """A level's figures (milliseconds for latencies) from its requests and its wall-clock duration."""
    done = [r for r in results if r.ok]
    ttft = [r.chunk_times[0] for r in done if r.chunk_times]
    itl = [b - a for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tokens = sum(r.output_tokens for r in done)
    ms = 1e3
    return {"completed": len(done), "failed": len(results) - len(done), "duration_s": round(duration, 3),
            "request_throughput": round(len(done) / duration, 3), "output_tokens_per_s": round(tokens / duration, 1),
            "ttft_p50_ms": round(ms * percentile(ttft, 50), 2), "ttft_p99_ms": round(ms * percentile(ttft, 99), 2),
            "itl_p50_ms": round(ms * percentile(itl, 50), 2), "itl_p99_ms": round(ms * percentile(itl, 99), 2),
            "e2e_p50_ms": round(ms * percentile([r.latency for r in done], 50), 2)}


def sse_events(lines):
    """The JSON payloads of an SSE stream's `data:` lines, up to `data: [DONE]` (an async generator)."""
    async def events():
        async for line in lines:
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)
    return events()


def request_body(model: str, prompt, output_len: int, peer: str) -> dict:
    """A streamed completion of exactly `output_len` tokens: `ignore_eos` (vLLM's extension) for servers that
    take it; transformers' server rejects unknown fields and takes a generation config instead. Both report
    `usage` at the end, which the output-token counts read: a token whose text is empty (an id the tokenizer
    cannot spell) streams no text, and transformers' server sends no chunk for it."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if peer == "transformers":
        body["generation_config"] = json.dumps({"max_new_tokens": output_len, "min_new_tokens": output_len,
                                                "do_sample": False})
    else:
        body["ignore_eos"] = True
    return body


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    """Send one streamed completion; a chunk counts as a token arrival when it carries text."""
    times, usage, texts, start = [], None, [], time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return Result(False, [], 0.0, 0, f"HTTP {response.status_code}: {text[:200]}")
            async for event in sse_events(response.aiter_lines()):
                if "error" in event:
                    return Result(False, times, 0.0, 0, str(event["error"])[:200])
                if event.get("usage"):
                    usage = event["usage"]
                chunk = "".join(c.get("text") or "" for c in event.get("choices") or ())
                if chunk:
                    times.append(time.perf_counter() - start)
                    texts.append(chunk)
    except httpx.HTTPError as e:
        return Result(False, times, 0.0, 0, f"{type(e).__name__}: {e}")
    tokens = usage["completion_tokens"] if usage and usage.get("completion_tokens") else len(times)
    return Result(True, times, time.perf_counter() - start, tokens, text="".join(texts))


async def run_level(url: str, bodies: list[dict], concurrency: int = 0, rate: float = 0.0,
                    seed: int = 0, headers: dict | None = None, timeout: float = 600.0) -> tuple[list[Result], float]:
    """All `bodies` at `concurrency` in flight, or arriving as a Poisson process of `rate` per second."""
    limits = httpx.Limits(max_connections=max(concurrency, 1) if concurrency else None, max_keepalive_connections=None)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(bodies)) if rate else np.zeros(len(bodies))
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        gate = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()

        async def gated(body):
            async with gate:
                return await one_request(client, url, body)

        start, tasks = time.perf_counter(), []
        for body, gap in zip(bodies, gaps):
            if rate:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(gated(body)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def make_prompts(kind: str, n: int, input_len: int, seed: int):
    """`n` prompts of a set (--prompts): `usual` random token ids (with --tokenizer: text that reads back at
    `input_len` tokens), `repetitive` a passage said until the prompt is full, else the lines of a file in turn."""
    from experiments import bench_serve_spec as spec
    if kind not in ("usual", "repetitive"):
        lines = [line for line in open(kind, encoding="utf-8").read().splitlines() if line.strip()]
        return [lines[i % len(lines)] for i in range(n)]
    if not FLAGS.tokenizer:
        if kind == "repetitive":
            return spec.repetitive_ids(n, input_len, FLAGS.vocab, seed)
        return np.random.default_rng(seed).integers(0, FLAGS.vocab, (n, input_len)).tolist()
    from transformers import AutoTokenizer  # the hf extra, only for text prompts
    tok = AutoTokenizer.from_pretrained(FLAGS.tokenizer)
    rng = np.random.default_rng(seed)
    whole = whole_character_ids(tok)
    if kind == "repetitive":
        return [spec.repetitive_text(tok, rng, whole, input_len, steady_text) for _ in range(n)]
    return [steady_text(tok, rng, whole, input_len) for _ in range(n)]


def whole_character_ids(tok) -> np.ndarray:
    """The ids, special tokens aside, that decode alone to whole characters (not a byte of one)."""
    return np.asarray([i for i in range(tok.vocab_size)
                       if i not in tok.all_special_ids and "\ufffd" not in tok.decode([i])])


def steady_text(tok, rng, whole, length: int, tries: int = 20) -> str:
    """Text of random tokens (of `whole`, the ids that decode to whole characters) that the tokenizer reads back
    as exactly `length` tokens.

    Decoded random ids often tokenize to another count (merges across the joins), which would make prompts longer
    than --input_len (a server then refuses one whose prompt and max_tokens pass its context); re-encode, keep the
    first ids, draw the rest afresh, and stop at the first text that reads back at its length.
    """
    ids = rng.choice(whole, length).tolist()
    for _ in range(tries):
        text = tok.decode(ids)
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) == length:
            return text
        keep = ids[:length - 1]
        ids = keep + rng.choice(whole, length - len(keep)).tolist()
    raise SystemExit(f"--tokenizer={FLAGS.tokenizer}: found no random text of {length} tokens that reads back "
                     f"at its length; pass --prompts=FILE instead")


def served_model(url: str, headers: dict) -> str:
    response = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def measure(server: str, url: str, model: str, prompts: list, peer: str = "", around=None,
            repeat: int | None = None) -> list[dict]:
    """Every level against one server, each `repeat` times (default --repeat): one row each (`around(url)`,
    called before a level, returns what to call after it for more figures of its row)."""
    headers = {"Authorization": f"Bearer {FLAGS.api_key}"} if FLAGS.api_key else {}
    model = model or served_model(url, headers)
    bodies = [request_body(model, p, FLAGS.output_len, peer) for p in prompts]
    levels = [("rate", float(r)) for r in FLAGS.request_rate] or [("concurrency", int(c)) for c in FLAGS.concurrency]
    asyncio.run(run_level(url, bodies[:1], concurrency=1, headers=headers, timeout=FLAGS.timeout))  # warm-up
    rows = []
    for kind, value in levels:
        kw = {"rate": value} if kind == "rate" else {"concurrency": value}
        after = around(url) if around else dict
        runs = [asyncio.run(run_level(url, bodies, seed=FLAGS.seed, headers=headers, timeout=FLAGS.timeout, **kw))
                for _ in range(repeat or FLAGS.repeat)]
        extra = after()
        results = runs[0][0]
        errors = sorted({r.error for rs, _ in runs for r in rs if not r.ok})
        rows.append({"server": server, kind: value, "input_len": FLAGS.input_len,
                     "output_len": FLAGS.output_len, **median_summary([summarize(*run) for run in runs]),
                     **extra, **({"errors": errors[:3]} if errors else {}),
                     "texts": [r.text if r.ok else None for r in results]})
    return rows


def median_summary(summaries: list[dict]) -> dict:
    """Each figure's median over the repeats of a level (--repeat); `repeats` says how many."""
    out = {k: round(float(np.median([s[k] for s in summaries])), 3) for k in summaries[0]}
    out.update(completed=min(s["completed"] for s in summaries), failed=max(s["failed"] for s in summaries))
    return {**out, "repeats": len(summaries)} if len(summaries) > 1 else summaries[0]


def same_outputs(rows: list[dict]) -> None:
    """Beside each peer row, how many of its requests streamed exactly our text for the same prompt (greedy: the
    same tokens; a text may be empty, the ids of a model whose vocabulary passes its tokenizer's); a failed request
    (None) never counts. The texts themselves leave the rows."""
    ours = {(r.get("concurrency"), r.get("rate")): r["texts"] for r in rows if r["server"] == "ours"}
    for r in rows:
        texts = r.pop("texts")
        mine = ours.get((r.get("concurrency"), r.get("rate")))
        if r["server"] != "ours" and mine is not None:
            r["same_as_ours"] = sum(a == b and a is not None for a, b in zip(mine, texts))


def print_table(rows: list[dict]) -> None:
    kind = "rate" if "rate" in rows[0] else "concurrency"
    cols = [("server", 14), (kind, 12), ("completed", 10), ("request_throughput", 9), ("output_tokens_per_s", 10),
            ("ttft_p50_ms", 10), ("ttft_p99_ms", 10), ("itl_p50_ms", 10), ("itl_p99_ms", 10), ("e2e_p50_ms", 10)]
    names = {"request_throughput": "req/s", "output_tokens_per_s": "tok/s", "ttft_p50_ms": "TTFT p50",
             "ttft_p99_ms": "TTFT p99", "itl_p50_ms": "ITL p50", "itl_p99_ms": "ITL p99",
             "e2e_p50_ms": "E2E p50", "completed": "done"}
    same = any("same_as_ours" in r for r in rows)
    cols += [("same_as_ours", 9)] if same else []
    names["same_as_ours"] = "same"
    print("".join(f"{names.get(c, c):>{w}}" for c, w in cols) + "   (latencies in ms" +
          ("; same: requests whose text equals ours" if same else "") + ")")
    for r in rows:
        print("".join(f"{r.get(c, ''):>{w}}" for c, w in cols))
        for e in r.get("errors", ()):
            print(f"  error: {e}")


def main(argv):
    del argv
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the table
    if FLAGS.peer and not (FLAGS.peer_model and os.path.isdir(FLAGS.peer_model)):
        raise app.UsageError("--peer_model: give the train.export_hf output directory the peer serves")
    if FLAGS.peer and not (FLAGS.tokenizer or FLAGS.prompts):
        raise app.UsageError("--tokenizer: the peer takes text prompts; give the exported model directory")
    if FLAGS.speculative and not (FLAGS.model_dir and os.path.isdir(FLAGS.model_dir)):
        raise app.UsageError("--model_dir: give the directory train.serve serves (a run's, or a Hugging Face one)")
    if FLAGS.speculative == "draft" and not FLAGS.draft:
        raise app.UsageError("--draft: give the draft model (a run's directory or hf:DIR)")
    if FLAGS.speculative:
        from experiments import bench_serve_spec
        rows = bench_serve_spec.rows(FLAGS, make_prompts, measure)
    elif FLAGS.engine_only:
        rows = engine_rows(FLAGS.preset, FLAGS.vocab_size, FLAGS.engine_seqs, [int(s) for s in FLAGS.seqs],
                           FLAGS.num_prompts, FLAGS.input_len, FLAGS.output_len, FLAGS.steps)
    else:
        rows = serve_rows()
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(rows, f, indent=2)


def serve_rows() -> list[dict]:
    prompts = make_prompts((FLAGS.prompts or ["usual"])[0], FLAGS.num_prompts, FLAGS.input_len, FLAGS.seed)
    rows = measure("ours", FLAGS.url.rstrip("/"), FLAGS.model, prompts) if FLAGS.url else []
    if FLAGS.peer:
        with servers.transformers_server(FLAGS.peer_model, FLAGS.peer_port) as url:
            rows += measure(FLAGS.peer, url, "", prompts, peer=FLAGS.peer)
    same_outputs(rows)
    print_table(rows)
    return rows


# ---------------------------------------------------------------------------------------------- --engine_only

def _median_seconds(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def engine_step_seconds(placed, seqs: int, input_len: int, steps: int) -> float:
    """The median engine.step() with `seqs` sequences all decoding (every prompt prefilled, none finishing)."""
    from train.serve.engine import Engine, Settings
    from train.serve.sampling import SamplingParams
    context = input_len + steps + 2
    settings = Settings(max_num_seqs=seqs, prefix_cache=False, max_batch_tokens=max(256, seqs))
    engine = Engine.build(placed, settings, max_context=context)
    rng = np.random.default_rng(0)
    for i in range(seqs):
        engine.add(f"b{i}", rng.integers(0, placed.model.vocab_size, input_len).tolist(),
                   SamplingParams(max_tokens=steps + 2))
    started: set[str] = set()
    while len(started) < seqs:  # prefill: each sequence's first token
        started |= {o.request_id for o in engine.step()}
    assert engine.stats()["running"] == seqs, engine.stats()
    return _median_seconds(engine.step, steps)


def bare_step_seconds(placed, seqs: int, input_len: int, steps: int) -> float:
    """The median jitted greedy decode step of `seqs` rows over a contiguous cache of the engine's length
    (experiments/bare_decode.py)."""
    import jax
    import jax.numpy as jnp

    from experiments import bare_decode
    from models import paged
    cfg, constrain = placed.model, placed.layout.constrain()

    def run(weights, tokens, cache, length):
        logits, cache = bare_decode.step(weights, tokens, cache, length, cfg, constrain)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None], cache
    step = jax.jit(run, donate_argnums=(2,))
    weights = jax.jit(lambda p: paged.unstack(p, cfg))(placed.params)
    state = {"cache": bare_decode.empty_cache(cfg, seqs, input_len + steps + 2),
             "tokens": jnp.ones((seqs, 1), jnp.int32), "length": input_len}

    def one():
        state["tokens"], state["cache"] = step(weights, state["tokens"], state["cache"],
                                               jnp.asarray(state["length"], jnp.int32))
        state["tokens"].block_until_ready()
        state["length"] += 1
    one()  # compile
    state["length"] = input_len
    return _median_seconds(one, steps)


def engine_throughput(placed, seqs: int, requests: int, input_len: int, output_len: int) -> dict:
    """All `requests` added at once, run to completion with serve.max_num_seqs=`seqs`: new tokens per second."""
    from train.serve.engine import Engine, Settings
    from train.serve.sampling import SamplingParams
    engine = Engine.build(placed, Settings(max_num_seqs=seqs, prefix_cache=False))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, placed.model.vocab_size, input_len).tolist() for _ in range(requests)]
    t = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=output_len))
    seconds = time.perf_counter() - t
    new = sum(len(o.token_ids) for o in outs)
    return {"max_num_seqs": seqs, "requests": requests, "new_tokens": new, "seconds": round(seconds, 3),
            "tokens_per_s": round(new / seconds, 1)}


def engine_rows(preset: str, vocab_size: int, seqs: int, table_seqs: list[int], requests: int, input_len: int,
                output_len: int, steps: int) -> list[dict]:
    """The step-time comparison (printed) and the throughput table (printed), as rows."""
    import models
    from train import placed as placed_lib
    cfg = models.from_dict({"preset": preset, **({"vocab_size": vocab_size} if vocab_size else {})})
    placed = placed_lib.initialized(placed_lib.on_one_device(cfg))
    device = str(placed.mesh.devices.flat[0].platform)
    engine_s = engine_step_seconds(placed, seqs, input_len, steps)
    bare_s = bare_step_seconds(placed, seqs, input_len, steps)
    step = {"kind": "step", "preset": preset, "vocab_size": cfg.vocab_size, "batch": seqs,
            "cache_len": input_len + steps + 2,
            "engine_step_ms": round(1e3 * engine_s, 3), "bare_step_ms": round(1e3 * bare_s, 3),
            "ratio": round(engine_s / bare_s, 3), "device": device}
    print(f"{'preset':<14}{'batch':>6}{'cache':>7}{'engine ms':>11}{'bare ms':>10}{'ratio':>8}")
    print(f"{preset:<14}{seqs:>6}{step['cache_len']:>7}{step['engine_step_ms']:>11.3f}{step['bare_step_ms']:>10.3f}"
          f"{step['ratio']:>8.2f}")
    rows = [step]
    if table_seqs:
        print(f"\n{'preset':<14}{'seqs':>6}{'requests':>10}{'seconds':>10}{'tok/s':>10}")
    for s in table_seqs:
        r = {"kind": "throughput", "preset": preset, **engine_throughput(placed, s, requests, input_len, output_len),
             "device": device}
        print(f"{preset:<14}{s:>6}{requests:>10}{r['seconds']:>10.2f}{r['tokens_per_s']:>10.1f}")
        rows.append(r)
    return rows


if __name__ == "__main__":
    define_flags()
    app.run(main)

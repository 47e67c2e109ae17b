"""bench_serve's speculative-decoding comparison (`--speculative=ngram|draft`): the same load against train.serve
started twice on one model (ports --serve_port and the next), speculation off and on, measured in turns, over the
usual random prompts and over repetitive ones (a passage said twice and begun a third time: what prompt lookup can
guess); beside each row of the speculating server its tokens/s over speculation off's, its accepted share of the
proposed tokens and the mean accepted length (from the server's /metrics), and how many requests streamed off's
very text."""
from __future__ import annotations

import contextlib
import pathlib
import sys

import httpx
import numpy as np

from experiments import bench_servers as servers

SPEC_METRICS = ("serve_spec_decode_draft_tokens_total", "serve_spec_decode_accepted_tokens_total",
                "serve_spec_decode_verify_steps_total")


def repetitive_ids(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of `input_len` ids: a random passage of a third of them, said until the prompt is full."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        passage = rng.integers(0, vocab, max(1, input_len // 3)).tolist()
        out.append((passage * 4)[:input_len])
    return out


def repetitive_text(tok, rng, whole, input_len: int, steady) -> str:
    """A passage of random words of about a third of `input_len` tokens, said until about `input_len` tokens."""
    passage = steady(tok, rng, whole, max(1, input_len // 3))
    text = passage
    while len(tok.encode(text + passage, add_special_tokens=False)) <= input_len:
        text += passage
    return text


def serve_command(model: str, port: int, speculative: str, draft: str, tokens: int) -> list[str]:
    """`python -m train.serve` on `model` (a run's directory, or a Hugging Face one), speculation as asked."""
    path = pathlib.Path(model)
    source = f"--workdir={model}" if (path / "checkpoints").is_dir() else f"--hf={model}"
    cmd = [sys.executable, "-m", "train.serve", source, f"--port={port}", f"--config.serve.speculative={speculative}"]
    if speculative == "draft":
        cmd.append(f"--config.serve.draft={draft}")
    if tokens:
        cmd.append(f"--config.serve.num_speculative_tokens={tokens}")
    return cmd


def spec_counts(url: str) -> dict[str, float]:
    """The server's speculative-decoding counters (0 when absent)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(values.get(name, 0)) for name in SPEC_METRICS}


def rows(flags, make_prompts, measure) -> list[dict]:
    """train.serve on --model_dir twice at once, speculation off and --speculative, each level of every prompt set
    run on one then the other --repeat times (so a busy machine's drift weighs on both alike; the idle server waits
    without work); each figure the median of its runs. bench_serve's `make_prompts` and `measure` do the work."""
    sets = {name: make_prompts(name, flags.num_prompts, flags.input_len, flags.seed)
            for name in flags.prompts or ["usual", "repetitive"]}
    modes = ("off", flags.speculative)
    runs: dict[tuple, list[dict]] = {}
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(servers.our_server(serve_command(flags.model_dir, flags.serve_port + i, mode,
                                                                     flags.draft, flags.num_speculative_tokens),
                                                       flags.serve_port + i)) for i, mode in enumerate(modes)]
        for _ in range(flags.repeat):
            for name, prompts in sets.items():
                for mode, url in zip(modes, urls):
                    for row in measure(mode, url, "", prompts, around=level_counts, repeat=1):
                        runs.setdefault((mode, name, row["concurrency"]), []).append(row)
    out = [median_row(rs, name) for (_, name, _), rs in runs.items()]
    compare(out)
    print_rows(out)
    return out


def median_row(runs: list[dict], prompts: str) -> dict:
    """One row from a level's runs: each figure's median, the worst run's failures, the first run's texts."""
    row = {**runs[0], "prompts": prompts, "repeats": len(runs)}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and key not in ("concurrency", "input_len", "output_len"):
            row[key] = round(float(np.median([r[key] for r in runs])), 3)
    row.update(completed=min(r["completed"] for r in runs), failed=max(r["failed"] for r in runs))
    return row


def level_counts(url: str):
    """Read the server's counters now; the returned function gives the level's acceptance once it has run."""
    before = spec_counts(url)
    return lambda: acceptance(before, spec_counts(url))


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict:
    """A level's accepted share of the proposed tokens and mean accepted length, from counters around it."""
    proposed, accepted, steps = (after[n] - before[n] for n in SPEC_METRICS)
    return {"accepted": round(accepted / proposed, 3) if proposed else 0.0,
            "mean_len": round(1 + accepted / steps, 2) if steps else 0.0}


def compare(rows: list[dict]) -> None:
    """Beside each speculating row: tokens/s over the off row of the same prompts and level (`x_off`), and how
    many of its requests streamed the off row's text (`same`: greedy, so every one should). Texts leave the rows."""
    off = {(r["prompts"], r["concurrency"]): r for r in rows if r["server"] == "off"}
    for r in rows:
        base = off.get((r["prompts"], r["concurrency"]))
        if r["server"] != "off" and base is not None:
            r["x_off"] = round(r["output_tokens_per_s"] / base["output_tokens_per_s"], 2)
            r["same"] = sum(a == b and a is not None for a, b in zip(base["texts"], r["texts"]))
    for r in rows:
        r.pop("texts", None)


def print_rows(rows: list[dict]) -> None:
    cols = [("server", 8), ("prompts", 12), ("concurrency", 12), ("completed", 10), ("output_tokens_per_s", 10),
            ("x_off", 7), ("accepted", 9), ("mean_len", 9), ("ttft_p50_ms", 10), ("itl_p50_ms", 10),
            ("e2e_p50_ms", 10), ("same", 6)]
    names = {"output_tokens_per_s": "tok/s", "ttft_p50_ms": "TTFT p50", "itl_p50_ms": "ITL p50",
             "e2e_p50_ms": "E2E p50", "completed": "done", "mean_len": "mean len"}
    print("".join(f"{names.get(c, c):>{w}}" for c, w in cols) + "   (latencies in ms; x_off: tokens/s over "
          "speculation off; accepted: of the proposed tokens; same: requests whose text equals off's)")
    for r in rows:
        print("".join(f"{r.get(c, ''):>{w}}" for c, w in cols))
        for e in r.get("errors", ()):
            print(f"  error: {e}")

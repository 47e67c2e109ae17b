"""experiments/bench_serve.py's figures from streamed chunk times, held to numpy, and its SSE reader."""
import asyncio

import numpy as np

from experiments import bench_serve as bench


def test_summarize_matches_numpy():
    a = bench.Result(True, [0.1, 0.3, 0.35], 0.4, 3)
    b = bench.Result(True, [0.2, 0.5], 0.6, 2)
    failed = bench.Result(False, [], 0.0, 0, "HTTP 500")
    row = bench.summarize([a, b, failed], duration=2.0)
    assert (row["completed"], row["failed"]) == (2, 1)
    assert row["request_throughput"] == 1.0 and row["output_tokens_per_s"] == 2.5
    itl = [0.2, 0.05, 0.3]  # gaps between successive chunks, over every request
    assert row["itl_p50_ms"] == round(1e3 * np.percentile(itl, 50), 2)
    assert row["itl_p99_ms"] == round(1e3 * np.percentile(itl, 99), 2)
    assert row["ttft_p50_ms"] == round(1e3 * np.percentile([0.1, 0.2], 50), 2)
    assert row["e2e_p50_ms"] == 500.0


def test_sse_events_stop_at_done():
    async def lines():
        for line in ['data: {"choices": [{"text": "a"}]}', "", ": keep-alive", 'data: {"usage": {"x": 1}}',
                     "data: [DONE]", 'data: {"late": 1}']:
            yield line

    async def collect():
        return [e async for e in bench.sse_events(lines())]
    assert asyncio.run(collect()) == [{"choices": [{"text": "a"}]}, {"usage": {"x": 1}}]


def test_a_peer_row_counts_the_requests_that_streamed_our_text():
    rows = [{"server": "ours", "concurrency": 4, "texts": ["a b", "c", "", None]},
            {"server": "transformers", "concurrency": 4, "texts": ["a b", "d", "", None]},
            {"server": "transformers", "concurrency": 16, "texts": ["a b", "c", "", None]}]
    bench.same_outputs(rows)
    assert [r.get("same_as_ours") for r in rows] == [None, 2, None]  # an empty text counts, a failure (None) not
    assert not any("texts" in r for r in rows)


def test_repeats_report_each_figures_median():
    runs = [{"completed": 8, "failed": 0, "output_tokens_per_s": v, "ttft_p50_ms": t} for v, t in
            ((100.0, 9.0), (300.0, 3.0), (200.0, 5.0))]
    runs[1].update(completed=7, failed=1)
    row = bench.median_summary(runs)
    assert (row["output_tokens_per_s"], row["ttft_p50_ms"], row["repeats"]) == (200.0, 5.0, 3)
    assert (row["completed"], row["failed"]) == (7, 1)  # the worst run's
    assert bench.median_summary(runs[:1]) == runs[0]


def test_text_prompts_read_back_at_their_length():
    """Random ids decoded to text re-tokenize to other counts; the prompts sent must hold --input_len tokens."""
    from transformers import PreTrainedTokenizerFast

    from train.data.tokenizer import train_bpe
    words = [f"w{i} caf\u00e9 na\u00efve {i * 7} \u6f22\u5b57" for i in range(200)]  # multi-byte characters too
    tok = PreTrainedTokenizerFast(tokenizer_object=train_bpe(words, 300))
    rng = np.random.default_rng(0)
    texts = [bench.steady_text(tok, rng, bench.whole_character_ids(tok), 12) for _ in range(64)]
    assert {len(tok.encode(t, add_special_tokens=False)) for t in texts} == {12}
    assert len(set(texts)) == 64


def test_the_speculative_comparison_reads_acceptance_and_compares_with_off():
    from experiments import bench_serve_spec as spec
    before = dict.fromkeys(spec.SPEC_METRICS, 10.0)
    after = dict(zip(spec.SPEC_METRICS, (50.0, 40.0, 20.0)))  # 40 proposed, 30 accepted over 10 steps
    assert spec.acceptance(before, after) == {"accepted": 0.75, "mean_len": 4.0}
    rows = [{"server": "off", "prompts": "usual", "concurrency": 1, "output_tokens_per_s": 50.0, "texts": ["a", "b"]},
            {"server": "ngram", "prompts": "usual", "concurrency": 1, "output_tokens_per_s": 120.0,
             "texts": ["a", None]}]
    spec.compare(rows)
    assert (rows[1]["x_off"], rows[1]["same"]) == (2.4, 1) and "x_off" not in rows[0]
    assert not any("texts" in r for r in rows)
    prompts = spec.repetitive_ids(2, 10, 256, 0)
    assert [len(p) for p in prompts] == [10, 10] and prompts[0][:3] == prompts[0][3:6] == prompts[0][6:9]

"""The serving engine: many requests decoded together over a paged KV cache, admitted and retired every step
(continuous batching), with chunked prefill, prefix caching and preemption when pages run out; and the
OpenAI-compatible HTTP server over it (server.py, `python -m train.serve`)."""

"""Data-parallel serving: a mesh with `data` > 1 serves as that many independent engines, one per slice of the
mesh along `data` (each slice keeps the other axes, so `tensor` still splits heads inside it), each with its own
KV pages and batch; a request goes to the least loaded. A step launches every replica's model before waiting for
any, so the replicas decode at once on their own devices."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from train import state as state_lib
from train.placed import Placed
from train.serve.engine import Engine, Output, RequestError, SamplingParams, ServingEngine, Settings
from train.serve.speculative import with_mean


def slices(placed: Placed) -> list[Placed]:
    """`placed` once per index along `data`: the same params on that slice's devices alone."""
    mesh = placed.mesh
    axis = mesh.axis_names.index("data")
    out = []
    for i in range(mesh.devices.shape[axis]):
        sub = jax.sharding.Mesh(np.take(mesh.devices, [i], axis=axis), mesh.axis_names)
        layout = state_lib.param_layout(placed.model, placed.layout.rules, sub)
        params = None if placed.params is None else jax.device_put(placed.params, layout.params)
        out.append(dataclasses.replace(placed, layout=layout, params=params))
    return out


def data_size(placed: Placed) -> int:
    return placed.mesh.shape.get("data", 1)


def build(placed: Placed, settings: Settings | None = None, max_context: int | None = None,
          draft: Placed | None = None) -> ServingEngine:
    """The engine `placed` serves with: one Engine, or Replicas of one per `data` slice of its mesh (`draft`:
    serve.speculative=draft's model on the same mesh, sliced alike; read from serve.draft when not given)."""
    if data_size(placed) == 1:
        return Engine.build(placed, settings, max_context, draft)
    settings = settings or Settings()
    if settings.speculative == "draft" and draft is None:
        from train.serve import draft as draft_lib
        draft = draft_lib.load(settings.draft, placed)
    drafts = slices(draft) if draft is not None else [None] * data_size(placed)
    return Replicas([Engine.build(p, settings, max_context, d) for p, d in zip(slices(placed), drafts)])


class Replicas(ServingEngine):
    """Engines on disjoint devices behind the one engine interface."""

    def __init__(self, engines: list[Engine]):
        self.engines = engines
        self.replicas = len(engines)
        first = engines[0]
        self.settings, self.cfg, self.placed = first.settings, first.cfg, first.placed
        self.max_context = min(e.max_context for e in engines)
        self.num_pages = sum(e.num_pages for e in engines)
        self._of: dict[str, Engine] = {}  # request id -> the replica holding it

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Queue a request on the least loaded replica."""
        if request_id in self._of:
            raise RequestError(f"request_id {request_id!r}: already in the engine", "request_id")
        engine = min(self.engines, key=Engine.load)
        engine.add(request_id, prompt_token_ids, params)
        self._of[request_id] = engine

    def abort(self, request_id: str) -> None:
        engine = self._of.get(request_id)
        if engine is not None:
            engine.abort(request_id)

    def full(self) -> bool:
        return all(e.full() for e in self.engines)

    def load(self) -> int:
        return sum(e.load() for e in self.engines)

    def has_work(self) -> bool:
        return any(e.has_work() for e in self.engines)

    def stats(self) -> dict[str, float]:
        each = [e.stats() for e in self.engines]
        return with_mean({key: sum(s[key] for s in each) for key in each[0]})

    def reset_prefix_cache(self) -> None:
        for e in self.engines:
            e.reset_prefix_cache()

    def step(self) -> list[Output]:
        launched = [e.launch() for e in self.engines]
        outputs = [out for e, step in zip(self.engines, launched) for out in e.collect(step)]
        for out in outputs:
            if out.finished:
                self._of.pop(out.request_id, None)
        return outputs

    def _generate_id(self) -> str:
        return self.engines[0]._generate_id()

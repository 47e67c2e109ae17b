"""The draft model of serve.speculative=draft: a smaller model with the target's vocabulary, placed on the target's
devices, with its own model runner and paged KV cache (its own KV-cache manager, prefix cache included). For the
sequences a step guesses for, it first computes whatever of their tokens it has not seen (usually the last one or
two), then proposes their next tokens greedily, one step of its own per guessed token. After the target's
verification its cache keeps what the target accepted."""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from models import paged
from train.config.sections import ServeSection
from train.exit_codes import ConfigError
from train.placed import Placed
from train.serve.pages import KVCacheManager
from train.serve.runner import ModelRunner
from train.serve.sampling import SamplingParams
from train.serve.scheduler import Chunk, Sequence

GREEDY = SamplingParams()


class _Guessing:
    """The draft model's view of a target sequence: its tokens, then the draft's own guesses after them."""

    def __init__(self, seq: Sequence):
        self.seq, self.request_id, self.slot, self.params = seq, seq.request_id, seq.slot, GREEDY
        self.output: list[int] = []  # the guesses (greedy: their sampling keys are never read)

    def length(self) -> int:
        return self.seq.length() + len(self.output)

    def token_slice(self, start: int, count: int) -> list[int]:
        own = self.seq.length()
        if start + count <= own:
            return self.seq.token_slice(start, count)
        return (self.seq.token_slice(start, max(0, own - start)) + self.output[max(0, start - own):])[:count]


class DraftProposer:
    def __init__(self, placed: Placed, settings: ServeSection, max_context: int):
        # The draft's pool is sized from memory (on CPU: every slot's longest sequence), whatever serve.kv_pages is.
        own = dataclasses.replace(settings, kv_pages=0, speculative="off")
        limit = paged.position_limit(placed.model)
        if limit and limit < max_context:
            raise ConfigError(f"serve.draft: the draft model encodes {limit} positions, fewer than the engine's "
                              f"max_context {max_context}; choose a draft with rotary positions or a longer table")
        self.runner = ModelRunner(placed, own, max_context)
        if self.runner.max_context < max_context:
            raise ConfigError(f"serve.draft: the draft model's pool holds {self.runner.max_context} positions, fewer "
                              f"than the engine's {max_context}; lower serve.kv_memory_fraction's share elsewhere")
        self.kv = KVCacheManager(self.runner.group_pages, self.runner.windows, settings.page_size,
                                 settings.prefix_cache)
        self.computed: dict[str, int] = {}  # request id -> the tokens whose keys and values the draft holds
        self.fed: dict[str, int] = {}  # request id -> its guesses whose keys and values the draft holds beyond

    def cost(self, depth: int, seqs: int) -> float:
        """The seconds of `depth` draft steps over `seqs` sequences (the fastest measured at warmup)."""
        return depth * self.runner.step_seconds[self.runner.bucket(max(1, min(seqs, self.runner.buckets[-1])))]

    def propose(self, wants: dict[Sequence, int]) -> dict[str, list[int]]:
        """Up to wants[seq] greedy guesses after each sequence's tokens, by request id (none for a sequence whose
        unseen tokens do not fit one draft step, or whose pages do not fit its pool: it catches up later)."""
        budget, feeds, guessing = self.runner.buckets[-1], [], []
        for seq, n in wants.items():
            rid, length = seq.request_id, seq.length()
            if rid not in self.computed:
                self.computed[rid] = self.kv.cached_prefix(rid, seq.token_slice, length)
            start = self.computed[rid]
            count = min(length - start, budget, self.runner.settings.prefill_chunk)
            if count < 1 or not self.kv.allocate(rid, start, start + count + (n - 1 if count == length - start
                                                                              else 0)):
                continue
            view = _Guessing(seq)
            feeds.append(Chunk(view, start, count))
            budget -= count
            if count == length - start:
                guessing.append((view, n))
        self._run(feeds)
        depth = max((n for _, n in guessing), default=0)
        for step in range(1, depth):
            self._run([Chunk(view, view.length() - 1, 1) for view, n in guessing if n > step])
        for view, n in guessing:
            self.fed[view.request_id] = n - 1
        return {view.request_id: view.output for view, _ in guessing}

    def _run(self, feeds: list[Chunk]) -> None:
        """One draft step over `feeds`; each sampling feed's greedy token becomes its view's next guess."""
        if not feeds:
            return
        inputs = self.runner.inputs(feeds, self.kv.tables, self.runner.bucket(sum(c.tokens for c in feeds)))
        tokens = np.asarray(self.runner.run(inputs)[0])
        for row, chunk in enumerate(c for c in feeds if c.samples):
            chunk.seq.output.append(int(tokens[row]))
        for chunk in feeds:
            own = min(chunk.start + chunk.count, chunk.seq.seq.length())
            if own > self.computed[chunk.seq.request_id]:
                self.computed[chunk.seq.request_id] = own
                self.kv.commit(chunk.seq.request_id, own, chunk.seq.seq.token_slice)

    def sync(self, seq: Sequence) -> None:
        """After the target's step: the draft keeps the keys and values of the tokens the target now holds too
        (its guesses up to the first rejected one), and gives back the pages past them."""
        rid = seq.request_id
        if rid in self.computed:
            self.computed[rid] = min(self.computed[rid] + self.fed.pop(rid, 0), seq.computed)
            self.kv.commit(rid, self.computed[rid], seq.token_slice)
            self.kv.truncate(rid, self.computed[rid])

    def drop(self, request_id: str) -> None:
        self.kv.free(request_id)
        self.computed.pop(request_id, None)
        self.fed.pop(request_id, None)


def load(spec: str, target: Placed) -> Placed:
    """serve.draft's model (a run's workdir, or hf:DIR) on the target's mesh, its vocabulary checked."""
    from train import placed as placed_lib
    from train import state as state_lib
    from train.config.experiment import resolve
    mesh = dict(target.mesh.shape)
    if spec.startswith("hf:"):
        from train.config.experiment import base_config
        from train.hf import serving as hf_serving
        config = hf_serving.config_for(base_config(), pathlib.Path(spec[len("hf:"):]).expanduser(), mesh)
    else:
        config = placed_lib.decoding_config(pathlib.Path(spec).expanduser(), mesh)
    model = resolve(config, target.mesh.devices.size).model
    if model.vocab_size != target.model.vocab_size:
        raise ConfigError(f"serve.draft={spec}: its vocabulary has {model.vocab_size} ids, the model's "
                          f"{target.model.vocab_size}; a draft model must share the model's vocabulary")
    placed = Placed(model, state_lib.param_layout(model, target.layout.rules, target.mesh))
    if spec.startswith("hf:"):
        placed = placed_lib.from_hf(placed, spec)
    else:
        placed = placed_lib.restore(placed, pathlib.Path(spec).expanduser())
    return placed

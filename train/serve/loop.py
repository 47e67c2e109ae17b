"""The engine's one thread: it loops engine steps while there is work and hands each request's Outputs to its
asyncio queue (call_soon_threadsafe), so handlers await tokens while the synchronous engine runs beside the event
loop. Adds and aborts take the same lock as a step; the latency histograms are observed here, as tokens leave."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

from train.serve.engine import Engine, Output, SamplingParams


class QueueFull(Exception):
    """serve.max_waiting requests are queued: the server answers 429."""


@dataclasses.dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    added: float
    last: float | None = None  # when its latest token left the engine


class EngineLoop:
    def __init__(self, engine: Engine, on_first_token=None, on_next_token=None):
        self.engine = engine
        self.lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._subs: dict[str, _Subscriber] = {}
        self._first, self._next = on_first_token, on_next_token  # callbacks(seconds), for the metrics
        self._thread = threading.Thread(target=self._run, name="serve-engine", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, queue: asyncio.Queue,
               loop: asyncio.AbstractEventLoop) -> None:
        """Queue a request whose Outputs go to `queue`; QueueFull, or the engine's ValueError (one line)."""
        if self.full():  # before the lock: a refusal never waits for a step
            raise QueueFull()
        with self.lock:
            if self.full():
                raise QueueFull()
            self.engine.add(request_id, prompt, params)
            self._subs[request_id] = _Subscriber(loop, queue, time.perf_counter())
        self._wake.set()

    def full(self) -> bool:
        return self.engine.full()

    def abort(self, request_id: str, notify: bool = False) -> None:
        """Drop a request (a client gone, a drain out of time); its pages go back to the pool now. `notify`: its
        handler still gets the last Output (finish_reason "abort")."""
        with self.lock:
            if not notify:
                self._subs.pop(request_id, None)
            self.engine.abort(request_id)
        self._wake.set()

    def busy(self) -> bool:
        return bool(self._subs)

    def request_ids(self) -> list[str]:
        return list(self._subs)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop:
            if not self.engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                with self.lock:
                    outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001  (every waiting handler hears of it; the thread goes on)
                logging.exception("serve: an engine step failed")
                self._fail_all(e)
                continue
            now = time.perf_counter()
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            for out in outputs:
                sub = self._deliver(out, now)
                if sub is not None:
                    by_loop.setdefault(sub.loop, []).append((sub.queue, out))
            for loop, items in by_loop.items():  # one wake-up of each event loop per step, not one per token
                loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, out: Output, now: float) -> _Subscriber | None:
        """The subscriber `out` goes to (None: aborted, nobody waits), its latencies observed."""
        sub = self._subs.get(out.request_id)
        if sub is None:
            return None
        if out.finish_reason != "abort":
            if sub.last is None and self._first:
                self._first(now - sub.added)
            elif sub.last is not None and self._next:
                self._next(now - sub.last)
            sub.last = now
        if out.finished:
            self._subs.pop(out.request_id, None)
        return sub

    def _fail_all(self, error: Exception) -> None:
        with self.lock:
            subs, self._subs = self._subs, {}
            for request_id in subs:
                self.engine.abort(request_id)
        for sub in subs.values():
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, error)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)

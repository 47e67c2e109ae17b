"""The response shapes of the server's two generation endpoints (train/serve/server.py): a whole completion, or a
stream's opening and chunks, with their log-probabilities; a completion's `echo` puts the prompt before the text
(and, with `logprobs`, its tokens' log-probabilities before the new tokens', the first one's null)."""
from __future__ import annotations

from train.serve import protocol as proto
from train.serve.engine import Output


class Completion:
    """The /v1/completions response shapes of one request (`name`: the served model's). `echo`: the prompt's
    (ids, text) to put first, or None."""
    prefix, kind, chunk_kind = "cmpl", "text_completion", "text_completion"

    def __init__(self, name: str, codec, params, top: int, echo: tuple[list[int], str] | None = None):
        self.name, self.codec, self.params, self.top, self.echo = name, codec, params, top, echo
        self._logged = 0  # tokens whose log-probabilities a chunk carried

    def _logprobs(self, out: Output, start: int):
        if not self.params.logprobs or out.logprobs is None:
            return None
        tokens, rows = out.token_ids[start:], out.logprobs[start:]
        if self.echo is not None and start == 0 and out.prompt_logprobs is not None:
            tokens, rows = self.echo[0] + tokens, out.prompt_logprobs + rows
        return proto.completion_logprobs_body(self.codec, tokens, rows, self.top)

    def _echoed(self, text: str, first: bool) -> str:
        return self.echo[1] + text if self.echo is not None and first else text

    def whole(self, rid: str, out: Output) -> dict:
        choice = {"index": 0, "text": self._echoed(out.text or "", True), "logprobs": self._logprobs(out, 0),
                  "finish_reason": proto.finish(out)}
        return proto.envelope(self.kind, rid, self.name, [choice], {"usage": proto.usage(out)})

    def opening(self, rid: str) -> list[dict]:
        return []

    def chunk(self, rid: str, delta: str, out: Output) -> dict:
        first = self._logged == 0
        logprobs, self._logged = self._logprobs(out, self._logged), len(out.token_ids)
        choice = {"index": 0, "text": self._echoed(delta, first), "logprobs": logprobs,
                  "finish_reason": proto.finish(out)}
        return proto.envelope(self.chunk_kind, rid, self.name, [choice])


class Chat(Completion):
    """The /v1/chat/completions response shapes; `top` -1: no log-probabilities asked for."""
    prefix, kind, chunk_kind = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def _logprobs(self, out: Output, start: int):
        if self.top < 0 or out.logprobs is None:
            return None
        return proto.chat_logprobs_body(self.codec, out.token_ids[start:], out.logprobs[start:], self.top)

    def whole(self, rid: str, out: Output) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text or ""},
                  "logprobs": self._logprobs(out, 0), "finish_reason": proto.finish(out)}
        return proto.envelope(self.kind, rid, self.name, [choice], {"usage": proto.usage(out)})

    def opening(self, rid: str) -> list[dict]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [proto.envelope(self.chunk_kind, rid, self.name, [choice])]

    def chunk(self, rid: str, delta: str, out: Output) -> dict:
        logprobs, self._logged = self._logprobs(out, self._logged), len(out.token_ids)
        choice = {"index": 0, "delta": {"content": delta}, "logprobs": logprobs, "finish_reason": proto.finish(out)}
        return proto.envelope(self.chunk_kind, rid, self.name, [choice])

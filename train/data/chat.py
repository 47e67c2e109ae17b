"""Conversations for supervised fine-tuning (`train.prepare --format=chat`): each JSONL record's `messages` rendered
with the tokenizer's Jinja chat template (or DEFAULT_TEMPLATE), and which characters are the assistant's, so that
only the assistant's tokens become targets. A record that cannot be used is counted by reason, not silently dropped."""
from __future__ import annotations

import datetime
import hashlib
import json
import pathlib
from typing import Any, Iterator

import numpy as np

from mesh.errors import UserError
from train.data import sources
from train.data.corpus import JSONL, CorpusError, jsonl_records
from train.runtime import extras

# For the bytes and train-bpe tokenizers, and a Hugging Face tokenizer without a chat_template: ChatML's layout,
# its markers as plain text (they are no special tokens of those vocabularies). <|im_end|> ends a turn.
DEFAULT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
SKIP_REASONS = ("unrenderable", "no_assistant")
FEATURE = "train.prepare --format=chat"


class ChatError(UserError):
    """A --format=chat setting, input or template the user can fix, or too many unusable records; one line."""


class Skip(Exception):
    """A record that yields no training conversation; `reason` is one of SKIP_REASONS."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _tokenizer_config(spec: str) -> dict[str, Any]:
    """tokenizer_config.json beside an hf: tokenizer ({} when there is none, or for bytes and train-bpe)."""
    if not spec.startswith("hf:"):
        return {}
    where = pathlib.Path(spec[3:]).expanduser()
    path = (where if where.is_dir() else where.parent) / "tokenizer_config.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        raise CorpusError(f"--tokenizer={spec}: {path} is not JSON; fix or remove it") from None


def template_source(spec: str) -> tuple[str, dict[str, str]]:
    """(the Jinja chat template, the special tokens it may use by name) of a --tokenizer spec."""
    config = _tokenizer_config(spec)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the one called "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    specials = {}
    for name in SPECIAL_NAMES:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            specials[name] = value
    return (template if isinstance(template, str) and template else DEFAULT_TEMPLATE), specials


def _environment():
    """A sandboxed Jinja environment set up as Hugging Face chat templates expect (block whitespace trimmed,
    loop controls, tojson that keeps non-ASCII text, raise_exception, strftime_now, {% generation %} blocks)."""
    jinja2, sandbox, ext = (extras.load(m, FEATURE) for m in ("jinja2", "jinja2.sandbox", "jinja2.ext"))

    class Generation(ext.Extension):
        """{% generation %}...{% endgeneration %}: marks the assistant's text for some tools; rendered as is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env


class Renderer:
    """Renders conversations with one template; `counts` tallies records read, kept and skipped by reason."""

    def __init__(self, spec: str):
        source, self.specials = template_source(spec)
        self.default = source == DEFAULT_TEMPLATE
        self.sha256 = hashlib.sha256(source.encode("utf-8")).hexdigest()
        env = _environment()
        try:
            self.template = env.from_string(source)
        except Exception as e:  # noqa: BLE001  (jinja2's TemplateSyntaxError, or what a broken extension raises)
            raise ChatError(f"--tokenizer={spec}: its chat template does not compile ({e}); fix chat_template in "
                            f"tokenizer_config.json") from None
        self.counts = {"read": 0, "kept": 0, **dict.fromkeys(SKIP_REASONS, 0)}

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.specials)

    def spans(self, messages: Any) -> tuple[str, list[tuple[int, int]]]:
        """(the conversation's text, the [start, end) characters of each assistant turn); raises Skip."""
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise Skip("unrenderable")
        if not any(m["role"] == "assistant" for m in messages):
            raise Skip("no_assistant")
        try:
            return self._turns(messages)
        except Skip:
            raise
        except Exception:  # noqa: BLE001  (a template may raise anything: TemplateError, TypeError, ...)
            raise Skip("unrenderable") from None

    def _turns(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """An assistant turn is what rendering through it adds to rendering the turns before it with the
        generation prompt, up to its last non-blank character: its content and end-of-turn marker, not the line
        break after. A template that renders the last assistant turn otherwise than an earlier one (Qwen3's empty
        think block after the last user message) is read in the whole conversation (_history_turn). A template
        that does not render the conversation turn by turn either way cannot be used."""
        text, spans = self.render(messages, False), []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt, through = self.render(messages[:i], True), self.render(messages[:i + 1], False)
            end = len(through.rstrip())
            if not (len(prompt) < end and through.startswith(prompt)):
                raise Skip("unrenderable")
            spans.append((len(prompt), end) if text.startswith(through[:end])
                         else _history_turn(text, prompt, through[len(prompt):end], message["content"]))
        return text, spans

    def documents(self, item: sources.Input) -> Iterator[tuple[str, list[tuple[int, int]]]]:
        """The usable conversations of one JSONL input, as (text, assistant spans); the rest are counted."""
        for messages in records(item):
            self.counts["read"] += 1
            try:
                doc = self.spans(messages)
            except Skip as skip:
                self.counts[skip.reason] += 1
                continue
            self.counts["kept"] += 1
            yield doc


def _history_turn(text: str, prompt: str, alone: str, content: str) -> tuple[int, int]:
    """The [start, end) characters in `text` of an assistant turn that the whole conversation renders otherwise
    than the turn rendered last (`alone`, after `prompt`): from the generation prompt's end through the turn's
    content and what `alone` ends it with (its end-of-turn marker); raises Skip when `text` does not hold them."""
    cut = alone.rfind(content)
    if not content or cut < 0 or not text.startswith(prompt):
        raise Skip("unrenderable")
    closing = alone[cut + len(content):]
    at = text.find(content + closing, len(prompt))
    if at < 0:
        raise Skip("unrenderable")
    return len(prompt), at + len(content) + len(closing)


def records(item: sources.Input) -> Iterator[Any]:
    """The `messages` value of every JSONL record of one input (None where a record has none)."""
    for _number, record in jsonl_records(item):
        yield record.get("messages") if isinstance(record, dict) else None


def check(files: list[sources.Input], spec: str, max_skipped_percent: float) -> str:
    """--format=chat's settings and inputs, before any work: JSONL files only, the template compiles; returns the
    template's SHA-256 (a rerun with another template is another preparation)."""
    if not 0 <= max_skipped_percent <= 100:
        raise ChatError(f"--max_skipped_percent={max_skipped_percent}: use a percentage in [0, 100]")
    other = next((f for f in files if f.is_dataset or not f.name.endswith(JSONL)), None)
    if other is not None:
        raise ChatError(f"--format=chat: {other.where} is not a JSONL file (.jsonl or .ndjson, compressed or not) of "
                        f"records with `messages`; convert it or leave it out")
    return Renderer(spec).sha256  # the extra is there and the template compiles


def check_skipped(counts: dict[str, int], max_percent: float) -> None:
    """Records that give no conversation are counted; too many of them is an error (nothing is written)."""
    skipped = counts["read"] - counts["kept"]
    if skipped and skipped * 100 > max_percent * counts["read"]:
        raise ChatError(f"--format=chat: {summary(counts)}, more than --max_skipped_percent={max_percent:g}; fix the "
                        f"records' `messages` or the chat template (--tokenizer), or raise the limit")


def target_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 per token: 1 where the token's characters [a, b) overlap an assistant span."""
    mask = np.zeros(len(offsets), np.uint8)
    if not offsets:
        return mask
    a_T, b_T = np.asarray(offsets, np.int64).T
    for start, end in spans:
        mask |= ((a_T < end) & (b_T > start)).astype(np.uint8)
    return mask


def summary(counts: dict[str, int]) -> str:
    """The records line of prepare's report."""
    skipped = {k: counts[k] for k in SKIP_REASONS if counts[k]}
    why = ", ".join(f"{n:,} {'without an assistant turn' if k == 'no_assistant' else 'that the template cannot render'}"
                    for k, n in skipped.items())
    return f"{counts['kept']:,} of {counts['read']:,} conversations kept" + (f", skipped {why}" if why else "")

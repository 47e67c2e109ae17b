"""Tokenizers as Hugging Face `tokenizers` objects: bytes (id = byte value, EOS 256), a tokenizer.json, or a
byte-level BPE trained on the corpus; and a run's codec (text <-> ids) that sampling loads from a workdir."""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mesh.errors import UserError

EOS_TEXT = "<|endoftext|>"
FILE = "tokenizer.json"


class TokenizerError(UserError):
    """A tokenizer setting or file the user can fix; one line."""


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters (what ByteLevel uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def bytes_tokenizer() -> Tokenizer:
    """id = byte value; EOS_TEXT = 256. No merges, so every byte is one token."""
    vocab = {ch: b for b, ch in _byte_alphabet().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TEXT])
    return tok


MAX_TRAINED_VOCAB = 1 << 20  # far past any published vocabulary; a huge one aborts the tokenizers library


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` ids (EOS_TEXT included) trained on `texts`."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise TokenizerError(f"--tokenizer=train-bpe:{vocab_size}: a byte-level BPE needs a vocabulary of at "
                             f"least {len(alphabet) + 1} (256 bytes and the end-of-document token); raise it")
    if vocab_size > MAX_TRAINED_VOCAB:
        raise TokenizerError(f"--tokenizer=train-bpe:{vocab_size}: a trained BPE is at most {MAX_TRAINED_VOCAB:,} "
                             f"ids (the largest published vocabularies are about 256k); lower it")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TEXT], initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_file(path: str, setting: str = "--tokenizer") -> Tokenizer:
    """A tokenizer.json, or a directory holding one."""
    p = pathlib.Path(path).expanduser()
    if p.is_dir():
        p = p / FILE
    if not p.is_file():
        raise TokenizerError(f"{setting}=hf:{path}: no tokenizer.json there; give the file or its directory")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # noqa: BLE001  (the library raises a bare Exception for a damaged file)
        raise TokenizerError(f"{setting}=hf:{path}: {p} is not a Hugging Face tokenizer.json ({e})") from None


def declared_eos(tok: Tokenizer) -> str | None:
    """The end-of-document token a tokenizer declares: a special token named like one."""
    specials = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
    for name in (EOS_TEXT, "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]"):
        if name in specials:
            return name
    return None


def token_id(tok: Tokenizer, text: str, setting: str) -> int:
    found = tok.token_to_id(text)
    if found is None:
        raise TokenizerError(f"{setting}={text!r}: the tokenizer has no such token; give one of its special tokens")
    return found


@dataclasses.dataclass(frozen=True)
class Codec:
    """Text <-> token ids of a run's data: what train.sample encodes prompts and decodes samples with."""
    tokenizer: Tokenizer
    eos_id: int
    bos_id: int | None = None
    from_run: bool = True  # False: the bytes fallback of a run that has no tokenizer.json

    def token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokenizer.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Ids at or past the tokenizer's vocabulary (model padding) are dropped; EOS is kept as its text."""
        n = self.tokenizer.get_vocab_size()
        return self.tokenizer.decode([int(i) for i in ids if 0 <= int(i) < n], skip_special_tokens=False)


def load_run_codec(workdir: str | pathlib.Path) -> Codec:
    """The codec of a run: the tokenizer.json copied into its workdir at train start (data.source=tokens with
    a prepared DATADIR), else bytes (data.source=text, whose ids are byte values)."""
    path = pathlib.Path(workdir).expanduser()
    if (path / FILE).is_file():
        meta = json.loads((path / "data_meta.json").read_text()) if (path / "data_meta.json").is_file() else {}
        try:
            tok = Tokenizer.from_file(str(path / FILE))
        except Exception:  # noqa: BLE001  (the library raises a bare Exception for a damaged file)
            raise TokenizerError(f"--workdir={path}: {path / FILE} is not a Hugging Face tokenizer.json; copy the "
                                 f"training DATADIR's tokenizer.json there again") from None
        eos, bos = meta.get("eos_id"), meta.get("bos_id")
        if eos is None:
            eos = tok.token_to_id(declared_eos(tok) or EOS_TEXT) or 0
        return Codec(tok, int(eos), None if bos is None else int(bos))
    return Codec(bytes_tokenizer(), 256, None, from_run=False)

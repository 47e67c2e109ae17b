"""Where the policy comes from (rl.policy): a training run's workdir, a Hugging Face directory (hf:DIR), or a fresh
model from train.seed; turned into the config's start (checkpoint.restore_from, the run's model section) so the
training loop's own restore reads it, and into the codec and chat template its prompts are read with."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import ml_collections

from train.config.experiment import ConfigError, load_run_config
from train.data import tokenizer as tok_lib
from train.hf import model as hf_model


def apply(config: ml_collections.ConfigDict) -> None:
    """Set the start of `config` from rl.policy (in place): hf:DIR becomes checkpoint.restore_from; a workdir
    becomes checkpoint.restore_from with restore_params_only, its model section replacing the config's."""
    spec = config.rl.policy
    if not spec:
        return
    start = spec if spec.startswith(hf_model.PREFIX) else str(pathlib.Path(spec).expanduser())
    if config.checkpoint.restore_from not in ("", start):
        raise ConfigError(f"rl.policy={spec!r} and checkpoint.restore_from={config.checkpoint.restore_from!r}: set "
                          f"only rl.policy (the model the run starts from)")
    config.checkpoint.restore_from = start
    if spec.startswith(hf_model.PREFIX):
        return
    workdir = pathlib.Path(start)
    try:
        saved = load_run_config(workdir)
    except ConfigError:
        raise ConfigError(f"rl.policy={spec!r}: no config.json there; give a training run's workdir, hf:DIR, or '' "
                          f"for a fresh model") from None
    config.model = ml_collections.ConfigDict(saved.model.to_dict())
    config.checkpoint.restore_params_only = True


@dataclasses.dataclass(frozen=True)
class Text:
    """How the policy reads and writes text: its codec, the tokenizer spec whose chat template renders
    conversations (train/data/chat.py), and the tokenizer files a run's workdir keeps for sampling and export."""
    codec: tok_lib.Codec
    chat_spec: str
    tokenizer_file: pathlib.Path | None = None

    def write(self, workdir: pathlib.Path) -> None:
        """tokenizer.json and its EOS and BOS ids into `workdir`, where train.sample and train.export_hf look."""
        if self.tokenizer_file is None:
            return
        shutil.copyfile(self.tokenizer_file, workdir / tok_lib.FILE)
        meta = {"eos_id": self.codec.eos_id, "bos_id": self.codec.bos_id}
        (workdir / "data_meta.json").write_text(json.dumps(meta) + "\n")


def text(spec: str) -> Text:
    """The policy's Text: a run's tokenizer (bytes when it has none), a Hugging Face directory's, or bytes."""
    from train.serve import command as serve_command  # its codec and chat-spec readers; it starts no server
    if not spec:
        return Text(tok_lib.Codec(tok_lib.bytes_tokenizer(), 256, None, from_run=False), "bytes")
    if spec.startswith(hf_model.PREFIX):
        path = pathlib.Path(spec[len(hf_model.PREFIX):]).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(f"rl.policy={spec!r}: no config.json there; give a directory written by "
                              f"save_pretrained or python -m train.export_hf")
        has = (path / tok_lib.FILE).is_file()
        return Text(serve_command.hf_codec(path), spec if has else "bytes", path / tok_lib.FILE if has else None)
    workdir = pathlib.Path(spec).expanduser()
    own = workdir / tok_lib.FILE
    return Text(tok_lib.load_run_codec(workdir), serve_command.chat_spec(load_run_config(workdir)),
                own if own.is_file() else None)

"""Every bad input of the user's path is one `error:` line naming it, exit status 2, before any expensive work,
and nothing is written (a failed start leaves no workdir behind). One table; every command line runs in a forked
child of one warm interpreter (tests/forked.py), so the table costs one interpreter start."""
import errno
import json
import os
import re
import shutil
import socket
import stat
import struct

import jax
import numpy as np
import pytest

import models
from checkpoint import safetensors_io
from tests.forked import run_many
from tests.helpers import ROOT, tiny_config
from train import exit_codes
from train.config import experiment as config_lib
from train.eval import results
from train.hf import export as hf_export
from train.loop import goodput, metrics, phases
from train.prepare import command as prepare
from train.runtime import hardware
from train.runtime.lock import WorkdirLock

TINY = ["--config=experiments/tiny.py", "--config.mesh.data=8"]


def _datadirs(tmp):
    """A good DATADIR and damaged copies: a train.bin of an odd size, one shorter than meta.json says, a
    tokenizer.json that is not one, another valid tokenizer.json, a meta.json whose max_id exceeds its vocab, and
    one whose max_id is below the ids its train.bin holds."""
    good = tmp / "data"
    prepare.prepare([str(ROOT / "train" / "data")], str(good), "bytes", val_percent=25)
    bad = {name: tmp / name for name in ("odd", "short", "tokenizer", "replaced", "max_id", "low_id")}
    for path in bad.values():
        shutil.copytree(good, path)
    with open(bad["odd"] / "train.bin", "ab") as f:
        f.write(b"\0")
    size = (bad["short"] / "train.bin").stat().st_size
    with open(bad["short"] / "train.bin", "r+b") as f:
        f.truncate(size - 2)
    (bad["tokenizer"] / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    (bad["replaced"] / "tokenizer.json").write_text((good / "tokenizer.json").read_text() + "\n")
    meta = json.loads((good / "meta.json").read_text())
    meta["train"]["max_id"] = meta["vocab_size"] + 100
    (bad["max_id"] / "meta.json").write_text(json.dumps(meta))
    meta["train"]["max_id"] = 10
    (bad["low_id"] / "meta.json").write_text(json.dumps(meta))
    return bad


def _hf_truncated(tmp):
    hf = tmp / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    safetensors_io.write(hf / "model.safetensors", {"w": np.zeros(4096, np.float32)})
    with open(hf / "model.safetensors", "r+b") as f:
        f.truncate(8000)
    return hf


def _damaged_checkpoint(tmp):
    """A copy of a small run's checkpoint (tests/fixtures) whose largest data file has a flipped stretch: its meta
    reads, so only reading the arrays finds the damage."""
    source = tmp / "damaged-run"
    shutil.copytree(ROOT / "tests" / "fixtures" / "checkpoint_604b7c2" / "checkpoints", source / "checkpoints")
    data = max((source / "checkpoints" / "3" / "state").rglob("d/*"), key=lambda f: f.stat().st_size)
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2:len(blob) // 2 + 64] = bytes(255 - b for b in blob[len(blob) // 2:len(blob) // 2 + 64])
    data.write_bytes(bytes(blob))
    return source


def _garbage_header(tmp):
    """An HF directory whose safetensors file starts with a header length no file could hold."""
    hf = tmp / "hf-garbage"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", 2 ** 63 + 5) + b"garbage" * 10)
    return hf


def _without_tokenizer(tmp):
    """A copy of the good DATADIR without its tokenizer.json."""
    shutil.copytree(tmp / "data", tmp / "no-tokenizer")
    (tmp / "no-tokenizer" / "tokenizer.json").unlink()
    return tmp / "no-tokenizer"


def _damaged_zst(tmp):
    """A .jsonl.zst whose bytes are no zstd frame."""
    (tmp / "damaged.jsonl.zst").write_bytes(b"not zstd at all" * 10)
    return tmp / "damaged.jsonl.zst"


def _checkpoint_without_manifest(tmp):
    """A copy of the fixture run (config.json and checkpoint 3) whose checkpoint lacks one file, its OCDBT
    manifest: the restore fails inside TensorStore, whose late callbacks used to print tracebacks."""
    source = tmp / "no-manifest"
    shutil.copytree(ROOT / "tests" / "fixtures" / "checkpoint_604b7c2", source)
    (source / "checkpoints" / "3" / "state" / "manifest.ocdbt").unlink()
    return source


def _saved_dataset(tmp):
    """A `datasets` DatasetDict saved to disk with a train split only (its import logs a line of its own, which
    the error must not follow)."""
    import datasets
    saved = tmp / "saved-dataset"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["one document"]})}).save_to_disk(str(saved))
    return saved


def _user_folder(tmp):
    """A folder of a user's own files (no meta.json): not a DATADIR, so train.prepare --overwrite leaves it."""
    mine = tmp / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    return mine


def _run_without_step_99(tmp):
    """A run directory with config.json (the tiny model on one device) and a (bare) checkpoint 3."""
    run = tmp / "trained"
    (run / "checkpoints" / "3" / "state").mkdir(parents=True)
    (run / "checkpoints" / "3" / "_CHECKPOINT_METADATA").write_text("{}")
    config = tiny_config()
    (run / "config.json").write_text(json.dumps({"config": config.to_dict()}))
    return run


def _chats(tmp):
    """A DATADIR of conversations with a loss mask, and a copy whose mask holds a byte that is not 0 or 1."""
    answered = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    (tmp / "chats.jsonl").write_text((json.dumps(answered) + "\n") * 64)
    prepare.prepare([str(tmp / "chats.jsonl")], str(tmp / "chat"), "bytes", data_format="chat")
    shutil.copytree(tmp / "chat", tmp / "chat-mask")
    with open(tmp / "chat-mask" / "train_mask.bin", "r+b") as f:
        f.write(b"\x07")
    return tmp / "chat", tmp / "chat-mask"


# Values a section's declaration refuses (train/config/sections.py): {override: the error line after it}.
DECLARED = {"optimizer.b1=1.5": "use a decay in [0, 1)", "optimizer.b2=-0.1": "use a decay in [0, 1)",
            "optimizer.eps=-1": "must be a positive number",
            "optimizer.weight_decay=-1": "must be a number >= 0 (0 turns it off)",
            "optimizer.min_lr_ratio=2": "use a fraction in [0, 1] of optimizer.lr",
            "optimizer.lr=nan": "must be a finite number", "optimizer.lr=inf": "must be a finite number",
            "train.seed=-1": "use a whole number >= 0",
            "serve.max_batch_tokens=0": "use a whole number >= 1",
            "data.eval_percent=100": "use a percentage in [0, 100) of the data held out for evaluation",
            "data.eval_percent=150": "use a percentage in [0, 100) of the data held out for evaluation"}


# Multi-process flags that describe no cluster: (row, flags, the error line).
COORDINATOR = [
    ("--coordinator_address without a port", ["--coordinator_address=localhost", "--num_processes=2"],
     "--coordinator_address='localhost': give HOST:PORT (process 0's host and a free port), e.g. 10.0.0.1:1234"),
    ("--coordinator_address on no host", ["--coordinator_address=no.such.host.invalid:1234", "--num_processes=2",
                                          "--init_timeout_s=1"],
     "--coordinator_address='no.such.host.invalid:1234': the host 'no.such.host.invalid' does not resolve (Name "
     "or service not known); give process 0's host name or address"),
    ("a coordinator that never answers", ["--coordinator_address=127.0.0.1:1", "--num_processes=2",
                                          "--process_id=1", "--init_timeout_s=1"],
     "--coordinator_address='127.0.0.1:1': process 0's coordinator did not answer within --init_timeout_s=1; "
     "start process 0 there, or fix the address or port"),
    ("--heartbeat_timeout_s=-1", ["--coordinator_address=127.0.0.1:1", "--num_processes=2",
                                  "--heartbeat_timeout_s=-1"], "--heartbeat_timeout_s=-1: must be >= 1 (seconds)"),
]


# The benchmark scripts' bad flags: (script, flag, the error line as a regex).
EXPERIMENTS = [
    ("bench_train", "--steps=0", re.escape("--steps=0: 0 is not a positive integer")),
    ("bench_train", "--source=csv", re.escape("--source=csv: value should be one of <text|tokens|synthetic>")),
    ("bench_train", "--configs=nope", re.escape("--configs=['nope']: each must be an experiment file of "
                                                "experiments/ (without .py) or a model preset")),
    ("bench_context", "--seq_lens=abc", re.escape("--seq_lens=['abc']: each must be a whole number > 0, e.g. "
                                                  "1024,2048")),
    ("bench_checkpoint", "--repeats=0", re.escape("--repeats=0: 0 is not a positive integer")),
    ("bench_checkpoint", "--models=abc", re.escape("--models=['abc']: each must be D_MODELxN_LAYERS, e.g. 384x6")),
    ("bench_data", "--mb=-1", re.escape("--mb=-1.0: must be > 0 (MB of text to prepare)")),
    ("bench_data", "--tokenizers=wordpiece", re.escape("--tokenizers=['wordpiece']: each must be bytes, "
                                                       "train-bpe:VOCAB or hf:PATH (train.prepare's --tokenizer)")),
]


def _declared(tmp):
    """A row per DECLARED value: refused by the declaration before anything compiles or is written."""
    W = tmp / "W"
    rows = {}
    for override, message in DECLARED.items():
        key, value = override.split("=")
        shown = repr(float(value)) if key.startswith("optimizer") else value
        rows[override] = ("train", [*TINY, f"--config.{override}", f"--workdir={W}"],
                          re.escape(f"{key}={shown}: {message}"), [W])
    return rows


def _full_device(tmp):
    """A character device like /dev/full (writes fail with ENOSPC), made here, never /dev itself; None where the
    test may not make device nodes."""
    node = tmp / "full"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except OSError:
        return None
    return node


def _run_of(tmp, name: str, config_json: str):
    """A copy of the fixture run (config.json and checkpoint 3) whose config.json holds `config_json`."""
    run = tmp / name
    shutil.copytree(ROOT / "tests" / "fixtures" / "checkpoint_604b7c2", run)
    if config_json:
        (run / "config.json").write_text(config_json)
    return run


def _llama_hf(tmp):
    """A Hugging Face directory of a Llama (LlamaForCausalLM): only its config.json is read before the error."""
    cfg, _ = _export_inputs()
    hf = tmp / "llama-hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(models.family_of(cfg).hf.hf_config(cfg, "float32", None, None)))
    return hf


def _user_path(tmp, port: int, full):
    """The command-line rows of a new user's path that once failed otherwise: {name: (module, args, the error line
    as a regex, paths that must not exist afterwards, the file stdout goes to or None)}."""
    W, t, listed = tmp / "W", re.escape, _run_of(tmp, "listed", "[]")
    (tmp / "raises.py").write_text("def get_config(variant=''):\n    raise RuntimeError('no config today')\n")
    rows = {
        "a coordinator that accepts and never answers": ("train", [
            *TINY, f"--workdir={W}", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", "--process_id=1",
            "--init_timeout_s=1"], t(f"--coordinator_address='127.0.0.1:{port}': a server there accepts connections "
                                     "but did not answer as JAX's coordinator within --init_timeout_s=1; give process "
                                     "0's address and port"), [W], None),
        "gpt3-1.3b on data=8": ("train", ["--config=experiments/default.py:data_parallel",
                                          "--config.model.preset=gpt3-1.3b", f"--workdir={W}"],
                                r"the step needs about 31.61 GiB per device \(the planner's memory model\) but a "
                                r"device has [\d.]+ GiB; shard more .*", [W], None),
        "sample on a config.json of []": ("train.sample", [f"--workdir={listed}", "--prompt=a"],
                                          t(f"--workdir={listed}: {listed}/config.json is not a run's config.json (no "
                                            "'config' entry of sections); move it away or choose another --workdir"),
                                          [], None),
        "serve on a config.json of []": ("train.serve", [f"--workdir={listed}", "--port=0"],
                                         rf"--workdir={t(str(listed))}: .* is not a run's config.json .*", [], None),
        "a missing config file with overrides": ("train", ["--config=experiments/nonexistent.py",
                                                           "--config.train.steps=5", f"--workdir={W}"],
                                                 t("--config=experiments/nonexistent.py: no such config file; give an "
                                                   "experiment file such as experiments/default.py"), [W], None),
        "a config file that raises": ("train", [f"--config={tmp / 'raises.py'}", f"--workdir={W}"],
                                      t(f"--config={tmp / 'raises.py'}: its get_config() raised RuntimeError: no "
                                        "config today"), [W], None),
        "bench_moe on a dense preset": ("experiments.bench_moe", ["--presets=tiny"],
                                        r"--presets=tiny: tiny: not a mixture-of-experts preset; use some of .*", [],
                                        None),
        "plan_table --bogus": ("experiments.plan_table", ["--bogus"], t("unrecognized arguments: --bogus"), [], None),
        "data.cache_dir under /proc": ("train", [*TINY, "--config.data.cache_dir=/proc/spmdtrain-cache",
                                                 f"--workdir={W}"],
                                       t("data.cache_dir=/proc/spmdtrain-cache: cannot write there (/proc is not a "
                                         "writable directory); choose a writable path"), [W], None),
        "grad_accum_steps the planner would replace": ("train", ["--config=experiments/tiny.py",
                                                                 "--config.train.grad_accum_steps=2", f"--workdir={W}"],
                                                       r"train.grad_accum_steps=2: plan.auto=True would replace it "
                                                       r"with 1 \(its layout .*\); pin it with "
                                                       r"plan.fixed=grad_accum_steps:2, or drop the setting", [W],
                                                       None),
        "an unknown schedule under plan.fixed=pipeline:2": ("train", ["--config=experiments/tiny.py",
                                                                      "--config.pipeline.schedule=zb_x",
                                                                      "--config.plan.fixed=pipeline:2",
                                                                      f"--workdir={W}"],
                                                            t("pipeline.schedule='zb_x': unknown schedule; did you "
                                                              "mean 'zb_v'? use one of gpipe, 1f1b, interleaved, "
                                                              "zb_h1, zb_v"), [W], None),
        "a qwen3 preset over a Llama directory": ("train", [*TINY, "--config.model.preset=qwen3-tiny",
                                                            f"--config.checkpoint.restore_from=hf:{_llama_hf(tmp)}",
                                                            f"--workdir={W}"],
                                                  r"checkpoint.restore_from='hf:.*': config.json has architectures "
                                                  r"\['LlamaForCausalLM'\] but model.preset='qwen3-tiny' is a "
                                                  r"Qwen3ForCausalLM; set model.preset to one of llama3-tiny, .*", [W],
                                                  None),
        "a mixture preset without experts": ("train", [*TINY, "--config.model.preset=mixtral-tiny",
                                                       "--config.model.n_experts=0", f"--workdir={W}"],
                                             t("model.n_experts=0: model.preset='mixtral-tiny' is a mixture of "
                                               "experts; choose a dense preset rather than removing its experts"), [W],
                                             None),
        "a misspelled preset": ("train", [*TINY, "--config.model.preset=lama3-tiny", f"--workdir={W}"],
                                r"model.preset='lama3-tiny': unknown preset; did you mean 'llama3-tiny'\? use one "
                                r"of .*",
                                [W], None),
    }
    if full is not None:
        sample = _run_of(tmp, "sample-run", "")
        rows |= {
            "eval --json on a device": ("train.eval", [f"--workdir={sample}", "--tasks=x", f"--json={full}"],
                                        t(f"--json={full}: exists and is not a regular file; give a path to a file"),
                                        [], None),
            "plan's output to a full device": ("train.plan", ["--config=experiments/tiny.py"],
                                               t("the output cannot be written to stdout (No space left on device); "
                                                 "redirect it to a writable file"), [], full),
            "sample's output to a full device": ("train.sample", [f"--workdir={sample}", "--prompt=a",
                                                                  "--max_new_tokens=2", "--num_cpu_devices=1"],
                                                 t("the output cannot be written to stdout (No space left on device); "
                                                   "redirect it to a writable file"), [], full),
        }
    return rows


def _cases(tmp):
    """{name: (module, args, the error line as a regex, paths that must not exist afterwards)}."""
    bad, hf, trained = _datadirs(tmp), _hf_truncated(tmp), _run_without_step_99(tmp)
    damaged = _damaged_checkpoint(tmp)
    chats, bad_mask = _chats(tmp)
    no_manifest, mine = _checkpoint_without_manifest(tmp), _user_folder(tmp)
    syntax, no_get = tmp / "syntax.py", tmp / "no_get.py"
    garbage, no_tokenizer, zst = _garbage_header(tmp), _without_tokenizer(tmp), _damaged_zst(tmp)
    (tmp / "empty.txt").write_text("")
    saved = _saved_dataset(tmp)
    (tmp / "no-config" / "checkpoints" / "3").mkdir(parents=True)
    (tmp / "small").mkdir()
    (tmp / "small" / "a.txt").write_text("tiny text " * 100)
    syntax.write_text("def get_config(:\n")
    no_get.write_text("x = 1\n")
    (tmp / "file").write_text("a file, so nothing can be created under it")
    W, blocked, busy = tmp / "W", tmp / "file" / "sub", tmp / "busy"  # busy: held by the test process
    tokens = [*TINY, "--config.data.source=tokens", f"--workdir={W}"]
    t = re.escape
    return {
        "train.bin not whole tokens": ("train", [*tokens, f"--config.data.path={bad['odd']}"],
                                       rf"data.path='{t(str(bad['odd']))}': {t(str(bad['odd']))}/train.bin has "
                                       r"\d+ bytes, not a whole number of uint16 tokens; .*", [W]),
        "train.bin shorter than meta.json": ("train", [*tokens, f"--config.data.path={bad['short']}"],
                                             r"data.path=.*/train.bin holds [\d,]+ tokens but its meta.json says "
                                             r"[\d,]+; the copy is incomplete or damaged: .*", [W]),
        "damaged tokenizer.json": ("train", [*tokens, f"--config.data.path={bad['tokenizer']}"],
                                   r"data.path=.*/tokenizer.json is not a Hugging Face tokenizer.json \(damaged\?\); "
                                   r"run train.prepare again with --overwrite", [W]),
        "replaced tokenizer.json": ("train", [*tokens, f"--config.data.path={bad['replaced']}"],
                                    r"data.path=.*/tokenizer.json is not the tokenizer the tokens were made with "
                                    r"\(its SHA-256 differs from meta.json's\); restore that file, or run "
                                    r"train.prepare again with --overwrite", [W]),
        "meta.json max_id over its vocab": ("train", [*tokens, f"--config.data.path={bad['max_id']}"],
                                            r"data.path=.*/meta.json says train.max_id=\d+, outside its "
                                            r"vocab_size=\d+; the file is damaged: run train.prepare again with "
                                            r"--overwrite", [W]),
        "truncated safetensors": ("train", ["--config=experiments/llama3_tiny.py", "--config.mesh.data=-1",
                                            f"--config.checkpoint.restore_from=hf:{hf}", f"--workdir={W}"],
                                  r"checkpoint.restore_from='hf:.*': .*/model.safetensors is truncated \(8,000 bytes, "
                                  r"its header needs [\d,]+\); download or copy it again", [W]),
        "damaged restore_from checkpoint": ("train", [*TINY, "--config.model.d_model=16", "--config.model.n_layers=2",
                                                      "--config.model.n_heads=2", "--config.data.source=synthetic",
                                                      "--config.train.global_batch_size=8",
                                                      f"--config.checkpoint.restore_from={damaged}:3",
                                                      f"--workdir={W}"],
                                            rf"checkpoint.restore_from='{t(str(damaged))}:3': .*/checkpoints/3 is "
                                            r"damaged \(.*\); name an older step as PATH:STEP", [W]),
        "data.loss_mask on data without one": ("train", [*tokens, f"--config.data.path={tmp / 'data'}",
                                                         "--config.data.loss_mask=True"],
                                               rf"data.loss_mask=True: data.path='{t(str(tmp / 'data'))}' has no loss "
                                               r"mask; prepare conversations with python -m train.prepare "
                                               r"--format=chat, or set data.loss_mask=False", [W]),
        "a loss mask that data.loss_mask ignores": ("train", [*tokens, f"--config.data.path={chats}"],
                                                    rf"data.path='{t(str(chats))}' holds conversations with a loss "
                                                    r"mask, which data.loss_mask=False would ignore .*", [W]),
        "meta.json max_id below its tokens": ("train", [*tokens, f"--config.data.path={bad['low_id']}"],
                                              r"data.path: .*/train.bin holds token id \d+, above meta.json's "
                                              r"train.max_id=10; the files do not match it: run train.prepare again "
                                              r"with --overwrite", [W]),
        "a loss mask of other bytes": ("train", [*tokens, f"--config.data.path={bad_mask}",
                                                 "--config.data.loss_mask=True"],
                                       r"data.path: .*/train_mask.bin holds bytes other than 0 and 1 \(a damaged "
                                       r"loss mask\); the files do not match it: run train.prepare again with "
                                       r"--overwrite", [W]),
        "unwritable data.cache_dir": ("train", [*TINY, f"--config.data.cache_dir={blocked}", f"--workdir={W}"],
                                      rf"data.cache_dir={t(str(blocked))}: cannot write there \(.*", [W]),
        "unwritable checkpoint.local_dir": ("train", [*TINY, f"--config.checkpoint.local_dir={blocked}",
                                                     "--config.checkpoint.local_every_steps=5", f"--workdir={W}"],
                                            rf"checkpoint.local_dir={t(str(blocked))}: cannot write there \(.*", [W]),
        "checkpoint.local_dir without an interval": ("train", [*TINY, f"--config.checkpoint.local_dir={tmp / 'shm'}",
                                                              f"--workdir={W}"],
                                                     rf"checkpoint.local_dir='{t(str(tmp / 'shm'))}' and "
                                                     r"checkpoint.local_every_steps=0: set both .*", [W, tmp / "shm"]),
        "schedule shorter than warmup": ("train", [*TINY, "--config.train.steps=2", f"--workdir={W}"],
                                         t("train.steps=2 (the schedule's length while optimizer.decay_steps=0) is "
                                           "not longer than optimizer.warmup_steps=2; raise train.steps or lower "
                                           "optimizer.warmup_steps"), [W]),
        "export_hf unwritable --out": ("train.export_hf", [f"--workdir={trained}", f"--out={blocked}"],
                                       rf"--out={t(str(blocked))}: cannot write there .*", [blocked]),
        "export_hf into a folder of files": ("train.export_hf", [f"--workdir={trained}", f"--out={mine}"],
                                             t(f"--out={mine} exists and is not empty; give a new directory, or pass "
                                               f"--overwrite to replace an earlier export"), []),
        "export_hf --overwrite over a user's folder": ("train.export_hf", [f"--workdir={trained}", f"--out={mine}",
                                                                           "--overwrite"],
                                                       t(f"--out={mine} holds files an export does not write "
                                                         f"(notes.txt), so --overwrite does not replace it; give a new "
                                                         f"directory"), []),
        "export_hf --max_shard_gb=-1": ("train.export_hf", [f"--workdir={trained}", f"--out={tmp / 'hf-out'}",
                                                            "--max_shard_gb=-1"],
                                        t("--max_shard_gb=-1.0: must be > 0 (the most GB one safetensors file "
                                          "holds)"), [tmp / "hf-out"]),
        "sample --top_k=-5": ("train.sample", [f"--workdir={trained}", "--top_k=-5"],
                              t("--top_k=-5: must be >= 0 (0 keeps every token)"), []),
        "sample --top_p=1.5": ("train.sample", [f"--workdir={trained}", "--top_p=1.5"],
                               t("--top_p=1.5: must be in (0, 1] (1 keeps every token)"), []),
        "sample --temperature=-1": ("train.sample", [f"--workdir={trained}", "--temperature=-1"],
                                    t("--temperature=-1.0: must be >= 0 (0 is greedy)"), []),
        "sample --step=99": ("train.sample", [f"--workdir={trained}", "--step=99", "--prompt=a",
                                              "--num_cpu_devices=1", "--config.mesh.data=1"],
                             rf"--step=99: {t(str(trained))} has no checkpoint of that step \(it has 3\); give one "
                             r"of them, or no --step for the newest", []),
        "a change a new phase cannot make": ("train", [f"--workdir={trained}", "--num_cpu_devices=1",
                                                       "--config.optimizer.lr=0.01"],
                                             t(f"optimizer.lr=0.01: the run in {trained} trains with "
                                               f"optimizer.lr=0.003, and that cannot change between phases (steps, "
                                               f"cadences, loggers, actions, data.path and the layout can); set it "
                                               f"back, or use a new --workdir"), [trained / ".lock"]),
        "prepare --overwrite on a folder that is not a DATADIR": ("train.prepare", [
            f"--input={ROOT / 'train' / 'data'}", f"--out={mine}", "--overwrite"],
            rf"--out={t(str(mine))} exists and is not a prepared DATADIR \(no meta.json\), so --overwrite does not "
            r"replace it; choose an empty or new directory", [mine / "meta.json", mine / "train.bin"]),
        "sample on a checkpoint missing a file": ("train.sample", [f"--workdir={no_manifest}", "--prompt=a",
                                                                   "--num_cpu_devices=1"],
                                                  rf"--workdir={t(str(no_manifest))}: {t(str(no_manifest))}/"
                                                  r"checkpoints/3 is damaged \(its arrays do not restore .*\); "
                                                  r"give an older one with --step=N", []),
        **_declared(tmp),
        "no --config where the workdir holds no run": ("train", [f"--workdir={W}"],
                                                        rf"--workdir={t(str(W))}: no run to continue there \(no "
                                                        r"config.json\); start one with --config=EXPERIMENT.py, "
                                                        r"e.g. --config=experiments/default.py", [W]),
        "an empty --workdir": ("train", [*TINY, "--workdir="],
                               t("--workdir='': give the run's directory, e.g. --workdir=runs/mine"), []),
        "plan.auto with sharding.strategy=zero9": ("train", ["--config=experiments/tiny.py", "--config.plan.auto=True",
                                                             "--config.sharding.strategy=zero9", f"--workdir={W}"],
                                                   r"sharding.strategy='zero9': unknown strategy; .*", [W]),
        "plan.auto with train.grad_accum_steps=0": ("train", ["--config=experiments/tiny.py",
                                                              "--config.plan.auto=True",
                                                              "--config.train.grad_accum_steps=0", f"--workdir={W}"],
                                                    t("train.grad_accum_steps=0: must be a positive number"), [W]),
        "a config file with a syntax error": ("train", [f"--config={syntax}", f"--workdir={W}"],
                                              rf"--config={t(str(syntax))}: SyntaxError at line 1: .*", [W]),
        "a config file without get_config": ("train", [f"--config={no_get}", f"--workdir={W}"],
                                             rf"--config={t(str(no_get))}: the file has no get_config\(\); .*", [W]),
        **{name: ("train", [*TINY, *flags, f"--workdir={W}"], t(line), [W]) for name, flags, line in COORDINATOR},
        "prepare --bpe_sample_mb=0": ("train.prepare", [f"--input={ROOT / 'train' / 'data'}", f"--out={tmp / 'D'}",
                                                        "--tokenizer=train-bpe:300", "--bpe_sample_mb=0"],
                                      t("--bpe_sample_mb=0.0: must be > 0 (the MB of text the BPE trains on)"),
                                      [tmp / "D"]),
        "train --peak_tflops=nan": ("train", [*TINY, "--peak_tflops=nan", f"--workdir={W}"],
                                    t("--peak_tflops=nan: must be a number >= 0 (0: the datasheet's or the measured "
                                      "peak)"), [W]),
        "train --audit_mfu=2": ("train", [*TINY, "--audit", "--audit_mfu=2", f"--workdir={W}"],
                                t("--audit_mfu=2.0: must be in (0, 1] (the MFU assumed)"), [W]),
        "train --hosts=0": ("train", [*TINY, "--audit", "--hosts=0", f"--workdir={W}"], t("--hosts=0: must be >= 1"),
                            [W]),
        "plan --top=0": ("train.plan", ["--config=experiments/tiny.py", "--top=0"],
                         t("--top=0: must be >= 1 (rows of the ranked table)"), []),
        "plan --mtbf_hours=-5": ("train.plan", ["--config=experiments/tiny.py", "--mtbf_hours=-5"],
                                 t("--mtbf_hours=-5.0: must be a number >= 0 (0: no cadence)"), []),
        "plan --restart_s=-1": ("train.plan", ["--config=experiments/tiny.py", "--restart_s=-1"],
                                t("--restart_s=-1.0: must be a number >= 0 (seconds)"), []),
        "a safetensors header of garbage": ("train", ["--config=experiments/llama3_tiny.py", "--config.mesh.data=-1",
                                                      f"--config.checkpoint.restore_from=hf:{garbage}",
                                                      f"--workdir={W}"],
                                             rf"checkpoint.restore_from='hf:{t(str(garbage))}': .*/model.safetensors: "
                                             r"not a readable safetensors file \(ValueError\)", [W]),
        "a DATADIR without its tokenizer.json": ("train", [*tokens, f"--config.data.path={no_tokenizer}"],
                                                 rf"data.path='{t(str(no_tokenizer))}': .*/tokenizer.json is missing; "
                                                 r"run train.prepare again with --overwrite", [W]),
        "prepare on a damaged .jsonl.zst": ("train.prepare", [f"--input={zst}", f"--out={tmp / 'D'}"],
                                            rf"{t(str(zst))}: cannot read it \(zstd decompress error: .*\)",
                                            [tmp / "D"]),
        "prepare on a saved dataset without the split": ("train.prepare", [f"--input=hf:{saved}:test",
                                                                           f"--out={tmp / 'D'}"],
                                                         rf"--input=hf:{t(str(saved))}:test: no split 'test' \(it has "
                                                         r"train\); write hf:DIR:SPLIT", [tmp / "D"]),
        "prepare on an empty file": ("train.prepare", [f"--input={tmp / 'empty.txt'}", f"--out={tmp / 'D'}"],
                                     t("--input: the corpus has no training documents (1 files); add text"),
                                     [tmp / "D"]),
        "plan.auto with train.global_batch_size=0": ("train", ["--config=experiments/tiny.py",
                                                               "--config.plan.auto=True",
                                                               "--config.train.global_batch_size=0",
                                                               f"--workdir={W}"],
                                                     t("train.global_batch_size=0: must be a positive number"), [W]),
        "eval unwritable --json": ("train.eval", [f"--workdir={trained}", "--tasks=x", f"--json={blocked}"],
                                   rf"--json={t(str(blocked))}: cannot write there .*", [blocked]),
        "eval --json a directory": ("train.eval", [f"--workdir={trained}", "--tasks=x", f"--json={tmp}"],
                                    rf"--json={t(str(tmp))}: exists and is a directory; give a path to a file", []),
        **{f"{module} {arg}": (f"experiments.{module}", [arg], line, []) for module, arg, line in EXPERIMENTS},
        "a held-out split shorter than a row": ("train", [*TINY, f"--config.data.path={tmp / 'small'}",
                                                         "--config.data.eval_percent=1",
                                                         f"--config.data.cache_dir={tmp / 'cache'}", f"--workdir={W}"],
                                                "data.path=.*: the held-out split of text has \\d+ tokens, fewer than "
                                                r"one row of 65; use more data \(or a larger data.eval_percent\) or a "
                                                r"shorter model.seq_len", [W]),
        "train --audit --topology=nonexistent": ("train", [*TINY, "--audit", "--topology=nonexistent",
                                                            f"--workdir={W}"], r"--topology=nonexistent: .*", [W]),
        "plot_schedule unwritable --out": ("experiments.plot_schedule", [f"--out={blocked}/s.png"],
                                           rf"--out={t(str(blocked))}/s.png: the directory .* does not exist; .*",
                                           [blocked]),
        "plot_schedule --schedule=zz": ("experiments.plot_schedule", ["--schedule=zz", f"--out={tmp / 's.png'}"],
                                        r"pipeline.schedule='zz': unknown schedule; use one of .*", [tmp / "s.png"]),
        "sft_demo_data unwritable --out": ("experiments.sft_demo_data", [f"--out={blocked}"],
                                           rf"--out={t(str(blocked))}: cannot write there .*", [blocked]),
        "chaos_goodput --mtbf_s=abc": ("experiments.chaos_goodput", ["--mtbf_s=abc"],
                                       t("argument --mtbf_s: invalid float value: 'abc'"), []),
        "launch with a bad setting": ("train.launch", ["--", *TINY, "--config.train.steps=-1", f"--workdir={W}"],
                                      t("train.steps=-1: must be a positive number"), [W]),
        "a run whose config.json was deleted": ("train", [f"--workdir={tmp / 'no-config'}"],
                                                t(f"--workdir={tmp / 'no-config'}: its config.json is missing, though "
                                                  f"checkpoints/ is there; restore the file, or give the --config "
                                                  f"the run trained with"), [tmp / "no-config" / ".lock"]),
        "sample with a prompt longer than the context": ("train.sample", [
            f"--workdir={trained}", "--prompt_tokens=" + ",".join(["1"] * 70), "--num_cpu_devices=1",
            "--config.mesh.data=1"], t("--prompt: 70 tokens, longer than the 64 the model was trained on "
                                       "(model.seq_len); shorten it"), []),
        "sample with a prompt and new tokens over the context": ("train.sample", [
            f"--workdir={trained}", "--prompt_tokens=1,2,3", "--max_new_tokens=100000", "--num_cpu_devices=1",
            "--config.mesh.data=1"], t("--max_new_tokens=100000: the prompt and new tokens (100003) exceed the 64 "
                                       "positions the model takes (model.seq_len, within model.max_positions); "
                                       "lower it to 61 or less, or shorten the prompt"), []),
        "plan --hosts=0": ("train.plan", ["--config=experiments/tiny.py", "--hosts=0"], t("--hosts=0: must be >= 1"),
                           []),
        "plan unwritable --json": ("train.plan", ["--config=experiments/tiny.py", f"--json={blocked}"],
                                   rf"--json={t(str(blocked))}: cannot write there .*", [blocked]),
        "launch on a workdir in use": ("train.launch", ["--", *TINY, f"--workdir={busy}"],
                                       rf"--workdir={t(str(busy))} is in use by another run \(host \S+, pid "
                                       rf"{os.getpid()}, started \S+, 1 process\(es\), heartbeat \d+s ago\); .*",
                                       []),
        "launch --num_processes=0": ("train.launch", ["--num_processes=0", "--", *TINY, f"--workdir={W}"],
                                     t("--num_processes=0: must be >= 1"), [W]),
        "launch --min_processes too high": ("train.launch", ["--min_processes=3", "--", *TINY, f"--workdir={W}"],
                                            t("--min_processes=3: must be <= --num_processes=2"), [W]),
        "launch --num_processes=-1": ("train.launch", ["--num_processes=-1", "--", *TINY, f"--workdir={W}"],
                                      t("--num_processes=-1: must be >= 1"), [W]),
        "launch train.rl on fewer processes": ("train.launch", ["--module=train.rl", "--min_processes=1", "--",
                                                                "--config=experiments/rl_tiny.py", f"--workdir={W}"],
                                               t("--min_processes=1: a restart on fewer processes lets the planner "
                                                 "lay the run out, which train.rl does not (its layout is mesh.*); "
                                                 "leave it out"), [W]),
        "train.rl with a group of 1": ("train.rl", ["--config=experiments/rl_tiny.py", "--config.rl.group_size=1",
                                                    f"--workdir={W}"],
                                       t("rl.group_size=1: use a whole number >= 2 (a group of 1 has no advantage: "
                                         "each completion is scored against the others of its prompt)"), [W]),
        "train.rl with a prompts file of a bad line": ("train.rl", ["--config=experiments/rl_tiny.py",
                                                                    f"--config.rl.prompts={tmp / 'small' / 'a.txt'}",
                                                                    f"--workdir={W}"],
                                                       rf"rl.prompts={t(str(tmp / 'small' / 'a.txt'))}:1: not a line "
                                                       rf"of UTF-8 JSON; fix or remove it", [W]),
        "train on an RL experiment": ("train", ["--config=experiments/rl_tiny.py", f"--workdir={W}"],
                                      t("rl.prompts='experiments/data/arithmetic.jsonl': this is a "
                                        "reinforcement-learning run; start it with python -m train.rl"), [W]),
        "bench --iters=0": ("mesh.bench", ["--iters=0"], t("--iters=0: must be >= 1"), []),
        "bench --iters=abc": ("mesh.bench", ["--iters=abc"],
                              t("--iters=abc: invalid literal for int() with base 10: 'abc'"), []),
        "bench --collectives=foo": ("mesh.bench", ["--collectives=foo"],
                                    r"--collectives=foo: unknown; use some of all_reduce, .*", []),
        "bench --min_bytes=1": ("mesh.bench", ["--min_bytes=1"],
                                t("--min_bytes=1 --max_bytes=1048576: need 4 <= min_bytes <= max_bytes"), []),
        "bench unwritable --fit output": ("mesh.bench", ["--fit", f"--topology_out={blocked}/local.json"],
                                          rf"--topology_out={t(str(blocked))}/local.json: cannot write there .*",
                                          [blocked]),
    }


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    full = _full_device(tmp)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog) and never answers
    cases = {name: (*case, None) for name, case in _cases(tmp).items()}
    cases |= _user_path(tmp, silent.getsockname()[1], full)
    (tmp / "busy").mkdir()
    with silent, WorkdirLock(tmp / "busy") as held:
        held.acquire(print)
        results = run_many([(module, args, stdout) for module, args, _, _, stdout in cases.values()])
    if full is not None:
        assert stat.S_ISCHR(full.stat().st_mode)  # written to, never replaced
    return {name: (case, result) for (name, case), result in zip(cases.items(), results)}


def test_every_bad_input_is_one_line_exit_2_and_writes_nothing(outcomes):
    failures = []
    for name, ((_module, _args, pattern, absent, _stdout), (status, _out, err)) in outcomes.items():
        line = err.strip()
        ok = status == exit_codes.USER_ERROR and re.fullmatch(f"error: {pattern}", line) is not None
        left = [str(p) for p in absent if p.exists()]
        if not ok or left:
            failures.append(f"{name}: status {status}, stderr {err.strip()[-600:]!r}, left behind {left}")
    assert not failures, "\n".join(failures)



def _export_inputs():
    """The tiny Llama (a family with a Hugging Face adapter) and zero parameters of its shapes."""
    config = tiny_config()
    config.model.preset = "llama3-tiny"
    cfg = config_lib.resolve(config, 1).model
    return cfg, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), models.abstract_params(cfg)[0])


def test_export_keeps_a_users_out_tmp_and_leaves_nothing_when_writing_fails(tmp_path, monkeypatch):
    """train.export_hf --out=X once deleted a user's X.tmp (its temporary folder had that name); a failed write
    (a full disk) left its temporary folder behind."""
    cfg, params = _export_inputs()
    (tmp_path / "hf.tmp").mkdir()
    (tmp_path / "hf.tmp" / "mine.txt").write_text("mine")
    hf_export.write(tmp_path / "hf", cfg, params, "float32")
    assert (tmp_path / "hf.tmp" / "mine.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf.tmp"]
    assert (tmp_path / "hf" / "model.safetensors").is_file() and not hf_export.foreign_files(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text("{}")
    hf_export.write(tmp_path / "hf", cfg, params, "float32")  # --overwrite: an earlier export replaced whole
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf.tmp"]

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(safetensors_io, "write", full)
    with pytest.raises(OSError):
        hf_export.write(tmp_path / "again", cfg, params, "float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf.tmp"]


def test_a_damaged_goodput_json_is_a_record_lost_not_a_stop(tmp_path, capsys):
    (tmp_path / "goodput.json").write_text('{"attempts": [{"wall_s": 1.0}')
    assert goodput.Goodput(tmp_path).attempts == []
    assert f"warning: {tmp_path / 'goodput.json'} is damaged" in capsys.readouterr().err


def test_a_run_that_never_saved_takes_a_corrected_setting(tmp_path):
    """A bad value that compiled (config.json written) but never reached a checkpoint does not lock the workdir."""
    saved = {"optimizer": {"lr": 1e9}, "train": {"seed": 0}}
    fixed = {"optimizer": {"lr": 3e-3}, "train": {"seed": 0}}
    assert phases.changes(saved, fixed, tmp_path, saved_state=False) == {"optimizer.lr": [1e9, 3e-3]}
    with pytest.raises(exit_codes.ConfigError, match="cannot change between phases"):
        phases.changes(saved, fixed, tmp_path, saved_state=True)


@pytest.mark.parametrize("env,line", [
    ({"WANDB_MODE": "bogus"}, "WANDB_MODE=bogus: use online, offline or disabled (train.loggers=wandb)"),
    ({}, "train.loggers=wandb: no W&B API key (WANDB_API_KEY, or ~/.netrc for api.wandb.ai); run `wandb login`, "
         "or set WANDB_MODE=offline to keep the run on disk"),
    ({"WANDB_MODE": "offline"}, None)])
def test_wandb_without_a_key_or_with_a_bad_mode_is_one_line_before_any_work(env, line, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if line is None:
        metrics.check_wandb()
        return
    with pytest.raises(exit_codes.ConfigError) as raised:
        metrics.check_wandb()
    assert str(raised.value) == line


def test_host_memory_counts_only_the_address_space_ulimit_leaves(monkeypatch):
    """Under `ulimit -v` an allocation past the limit aborts the process inside XLA: the memory checks must see
    the limit, less what the process has mapped already."""
    mapped = hardware._mapped_bytes()
    assert mapped > 0
    monkeypatch.setattr(hardware.resource, "getrlimit", lambda _: (mapped + (3 << 30), hardware.resource.RLIM_INFINITY))
    assert hardware.host_memory() == pytest.approx(3 << 30, rel=0.05)


def test_prepare_onto_a_full_disk_stops_before_tokenizing(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("text " * 1000)
    monkeypatch.setattr(prepare.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1 << 30, 1 << 30, 100))
    monkeypatch.setattr(prepare, "_write", lambda *a: pytest.fail("tokenized onto a full disk"))
    with pytest.raises(prepare.PrepareError, match=r"--out=.*/D: 0.0 MB free there, and the tokens of 0.0 MB of "
                                                   r"input need 0.0 MB or more; free space there or choose"):
        prepare.prepare([str(tmp_path / "a.txt")], str(tmp_path / "D"), "bytes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_eval_results_keep_a_symlink_and_never_replace_a_device(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    (tmp_path / "link.json").symlink_to(real)
    results.write(tmp_path / "link.json", {"a": 1})
    assert (tmp_path / "link.json").is_symlink() and json.loads(real.read_text()) == {"a": 1}
    null = tmp_path / "null"
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # like /dev/null
    except OSError:
        pytest.skip("no device nodes here")
    results.write(null, {"a": 1})
    assert stat.S_ISCHR(null.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "null", "real.json"]

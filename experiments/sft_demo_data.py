"""Data for the README's fine-tuning example: conversations in which the assistant repeats the word the user
gives (a chat JSONL for `train.prepare --format=chat`) and a local lm-evaluation-harness task asking the same as
multiple choice, its prompts rendered in the default chat template (train/data/chat.py), so that a model can be
scored before and after fine-tuning. Repeating is a skill, not a fact: a small model learns it in minutes.

    python -m experiments.sft_demo_data --out=demo    # demo/chats.jsonl, demo/tasks/repeat.yaml + repeat.jsonl

experiments/data/chats.jsonl, the README's conversations, is the chats.jsonl of `--conversations=400` (seed 0).
"""
from __future__ import annotations

import json
import pathlib
import random
import sys

from mesh.errors import UserError, check_writable
from train import cli

TASK = """# Repeat the word, as multiple choice; prompts in the default chat template (experiments/sft_demo_data.py).
task: repeat
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: choices
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


WORDS = ("apple", "river", "stone", "cloud", "tiger", "paper", "glass", "music", "garden", "winter", "silver",
         "forest", "candle", "bridge", "orange", "planet", "shadow", "pencil", "rocket", "valley", "copper",
         "meadow", "thunder", "harbor")


def question(word: str) -> str:
    return f"Repeat after me: {word}"


def conversations(count: int, rng: random.Random) -> list[dict]:
    return [{"messages": [{"role": "user", "content": question(word)}, {"role": "assistant", "content": word}]}
            for word in (rng.choice(WORDS) for _ in range(count))]


def task_rows(rng: random.Random) -> list[dict]:
    """Every word four times, each time with two other words as the wrong choices, in a shuffled order."""
    rows = []
    for word in WORDS * 4:
        choices = [word, *rng.sample([w for w in WORDS if w != word], 2)]
        rng.shuffle(choices)
        prompt = f"<|im_start|>user\n{question(word)}<|im_end|>\n<|im_start|>assistant\n"
        rows.append({"prompt": prompt, "choices": choices, "label": choices.index(word)})
    return rows


def main() -> None:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder to write chats.jsonl and tasks/ into")
    p.add_argument("--conversations", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out, rng = pathlib.Path(args.out), random.Random(args.seed)
    try:
        check_writable("--out", args.out, "directory", parents=True)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    (out / "tasks").mkdir(parents=True, exist_ok=True)
    with open(out / "chats.jsonl", "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in conversations(args.conversations, rng))
    data = out / "tasks" / "repeat.jsonl"
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in task_rows(rng))
    (out / "tasks" / "repeat.yaml").write_text(TASK.format(data=data.resolve()))
    print(f"wrote {out / 'chats.jsonl'} ({args.conversations} conversations) and {out / 'tasks'} (task repeat, "
          f"{4 * len(WORDS)} questions)")


if __name__ == "__main__":
    main()

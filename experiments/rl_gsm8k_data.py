"""GSM8K's training split (Hugging Face `openai/gsm8k`, `main`) as rl.prompts: one chat prompt a line asking for the
final answer in \\boxed{}, with that answer (the number after `####`) for rl.reward=exact_answer.

    python -m experiments.rl_gsm8k_data --out=data/gsm8k.jsonl [--limit=N]
"""
from __future__ import annotations

import json
import pathlib

from mesh.errors import UserError, check_writable
from train import cli
from train.runtime import extras

INSTRUCTION = "Solve the problem, then give the final answer as \\boxed{N}."


def records(rows, limit: int = 0):
    for i, row in enumerate(rows):
        if limit and i >= limit:
            return
        answer = row["answer"].split("####")[-1].strip().replace(",", "")
        yield {"messages": [{"role": "user", "content": f"{row['question']}\n{INSTRUCTION}"}], "answer": answer}


def main(argv=None) -> None:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/gsm8k.jsonl", help="the JSONL file to write")
    parser.add_argument("--limit", type=int, default=0, help="at most this many problems (0: all 7,473)")
    args = parser.parse_args(argv)
    try:
        check_writable("--out", args.out, parents=True)
        datasets = extras.load("datasets", "python -m experiments.rl_gsm8k_data")
    except UserError as error:
        cli.fail(str(error))
    rows = datasets.load_dataset("openai/gsm8k", "main", split="train")
    out = pathlib.Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for record in records(rows, args.limit):
            f.write(json.dumps(record) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""`python -m train.eval --workdir=DIR --tasks=T1,T2 [--num_fewshot=N --limit=N --batch_size=N
--include_path=DIR --step=N --json=FILE --num_cpu_devices=N]`: lm-evaluation-harness tasks on a run's checkpoint,
on the run's mesh (`--config.mesh.*` overrides it). Results: DIR/eval/step_N.json, a table, the run's loggers."""
from __future__ import annotations

import importlib
import pathlib
import sys

import jax
from absl import app, flags, logging

from mesh import use_cpu_devices
from mesh.layout import AXES
from train import cli, exit_codes
from train.config import experiment as run_config
from train.config.experiment import base_config
from train.eval import load, results
from train.eval.options import Options, check, parse_tasks
from train.runtime import extras, hub

FLAGS = flags.FLAGS
WHAT = "python -m train.eval"


def define_flags() -> None:
    """Defined only when run as a command, so tests can import `evaluate` beside other tools' flags."""
    cli.config_dict("config", base_config(), "Only --config.mesh.* overrides are read.")
    flags.DEFINE_string("workdir", None, "The training run's directory.", required=True)
    flags.DEFINE_string("tasks", None, "Task names, comma-separated (lm_eval's registry or --include_path).")
    flags.DEFINE_integer("num_fewshot", None, "Few-shot examples per prompt (default: each task's own).")
    flags.DEFINE_integer("limit", None, "At most this many examples per task (for a quick look).")
    flags.DEFINE_integer("batch_size", 16, "Requests per batch; every batch is padded to this size.")
    flags.DEFINE_string("include_path", None, "A folder of task YAML files (local datasets, offline use).")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
    flags.DEFINE_string("json", None, "Also write the results to this file.")
    flags.DEFINE_integer("num_cpu_devices", 8, "Virtual devices when the platform is CPU.")


def options_from_flags() -> Options:
    mesh = {name: FLAGS.config.mesh[name] for name in AXES
            if any(arg.startswith(f"--config.mesh.{name}=") for arg in sys.argv)}
    return Options(pathlib.Path(FLAGS.workdir).expanduser(), parse_tasks(FLAGS.tasks), FLAGS.num_fewshot,
                   FLAGS.limit, FLAGS.batch_size, FLAGS.include_path, FLAGS.step, FLAGS.json, mesh)


def evaluate(options: Options, echo=print) -> dict:
    """Run the tasks; write DIR/eval/step_N.json (and options.json_path) and log the scores. Every mistake
    the user can make is raised before the checkpoint is read and before anything is written."""
    check(options)
    run_config.load_run_config(options.workdir)
    run_config.run_checkpoints(options.workdir, options.step)
    extras.check("lm_eval", WHAT)
    hub.go_offline_if_unreachable()  # before lm_eval imports datasets: offline, a registry task fails at once
    harness = importlib.import_module("train.eval.harness")  # imports lm_eval, now known to be installed
    manager = harness.task_manager(options.tasks, options.include_path)
    generates = harness.check_data(manager, options.tasks)
    run = load.load_run(options.workdir, options.step, options.batch_size, options.mesh, options.num_devices)
    harness.check_generation(generates, run.scorer.cfg.seq_len)
    lm = harness.SpmdLM(run=run)
    out = harness.evaluate(lm, manager, options.tasks, options.num_fewshot, options.limit)
    if jax.process_index() == 0:  # every process of a multi-process run computed the same results
        content = results.record(out, run.step, options.tasks, options.num_fewshot, options.limit)
        results.write(options.workdir / "eval" / f"step_{run.step}.json", content)
        if options.json_path:
            results.write(pathlib.Path(options.json_path).expanduser(), content)
        echo(f"step {run.step}\n{harness.table(out)}")
    results.log(options.workdir, run.config, run.step, results.scalars(out))
    return out


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)  # Orbax's info lines would bury the table
    options = options_from_flags()
    if FLAGS.num_cpu_devices < 1:
        raise app.UsageError(f"--num_cpu_devices={FLAGS.num_cpu_devices}: must be >= 1")
    use_cpu_devices(FLAGS.num_cpu_devices)
    evaluate(options)
    return exit_codes.OK

"""The run's model as an lm-evaluation-harness model (`spmdtrain` in lm_eval's registry), scoring as lm_eval's
`hf` model does: a context's trailing spaces move to the continuation, an empty context becomes the BOS (else
EOS) token, too-long inputs are cut from the left, generation stops at `until` (and EOS) or max_gen_toks."""
from __future__ import annotations

import pathlib

import lm_eval
import lm_eval.models  # noqa: F401  (lm_eval registers its own models only into an empty registry: first)
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.tasks import TaskManager

from mesh.layout import AXES
from train.eval import load
from train.eval.options import EvalError
from train.runtime import hub
from train.serve.sampling import SamplingParams

DEFAULT_MAX_GEN_TOKS = 256  # lm_eval's own default
LM_EVAL_ARGS = {"device", "max_batch_size"}  # what lm_eval adds to every model's model_args; the mesh places us


@register_model("spmdtrain")
class SpmdLM(TemplateLM):
    """Built around a loaded run, or by lm_eval from model_args `workdir=DIR[,step=N,batch_size=N,max_gen_toks=N,
    num_devices=N]` plus mesh sizes (`data=2,tensor=2`) overriding the run's, in a process that imported this."""

    def __init__(self, workdir: str | None = None, step: int | None = None, batch_size: int | str = 16,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, num_devices: int | None = None,
                 run: load.LoadedRun | None = None, **kwargs):
        super().__init__()
        if run is None:
            if workdir is None:
                raise EvalError("the spmdtrain model needs model_args workdir=DIR (a training run's directory)")
            size = int(batch_size) if str(batch_size).isdigit() else 16  # lm_eval's "auto": the default
            unknown = sorted(set(kwargs) - set(AXES) - LM_EVAL_ARGS)
            if unknown:
                raise EvalError(f"the spmdtrain model has no model_args {unknown[0]!r}; it takes workdir, step, "
                                f"batch_size, max_gen_toks, num_devices and mesh sizes ({', '.join(AXES)})")
            mesh = {name: int(value) for name, value in kwargs.items() if name in AXES}
            run = load.load_run(pathlib.Path(workdir).expanduser(), None if step is None else int(step), size,
                                mesh, None if num_devices is None else int(num_devices))
        self.run, self.scorer, self.codec = run, run.scorer, run.codec
        self.max_length, self.max_gen_toks = run.scorer.cfg.seq_len, int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        return self.codec.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.codec.bos_id if self.codec.bos_id is not None else self.codec.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.codec.encode(string)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context ids, continuation ids) each."""
        rows = [(ctx + cont)[-(self.max_length + 1):] for _, ctx, cont in requests]
        return self.scorer.loglikelihood(rows, [min(len(cont), len(row) - 1)
                                                for (_, _, cont), row in zip(requests, rows)])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-likelihood, in windows of the model's length each scoring new tokens only."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logp
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests grouped by their generation settings; each group's prompts generated in padded batches."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        out = [""] * len(requests)
        for members in groups.values():
            texts = self._generate_group([requests[i].args[0] for i in members], dict(requests[members[0]].args[1]))
            for i, text in zip(members, texts):
                out[i] = text
        return out

    def _generate_group(self, contexts: list[str], kwargs: dict) -> list[str]:
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        eos_text = self.codec.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        until += [eos_text] if eos_text not in until else []
        max_gen = int(kwargs.get("max_gen_toks", kwargs.get("max_new_tokens", self.max_gen_toks)))
        check_room(max_gen, self.max_length)
        keep = self.max_length - max_gen  # room for the new tokens inside the model's length, as lm_eval's hf
        prompts = [self.tok_encode(c)[-keep:] or [self.prefix_token_id] for c in contexts]
        greedy = not kwargs.get("do_sample", False) or float(kwargs.get("temperature", 0.0)) == 0.0
        sampling = SamplingParams() if greedy else SamplingParams(temperature=float(kwargs["temperature"]),
                                                                  top_k=int(kwargs.get("top_k") or 0),
                                                                  top_p=float(kwargs.get("top_p") or 1.0))

        def stopped(_, new: list[int]) -> bool:
            return self.eot_token_id in new or any(s in self.codec.decode(new) for s in until)

        return [self._text(new, until) for new in self.scorer.generate(prompts, max_gen, sampling, stopped)]

    def _text(self, new: list[int], until: list[str]) -> str:
        """The new tokens before the first EOS as text (special tokens dropped), cut at the first stop string."""
        new = new[:new.index(self.eot_token_id)] if self.eot_token_id in new else new
        vocab = self.codec.tokenizer.get_vocab_size()
        text = self.codec.tokenizer.decode([t for t in new if t < vocab], skip_special_tokens=True)
        for stop in until:
            text = text.split(stop)[0] if stop else text
        return text


def task_manager(names: tuple[str, ...], include_path: str | None) -> TaskManager:
    """lm_eval's task index with `include_path`'s tasks; a name in neither is one line. The built-in index
    (about 14k YAML files) is skipped when every task is local, and a name that no built-in YAML even mentions
    is refused without building it."""
    local: list[str] = []
    if include_path:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if all(n in manager.all_tasks for n in names):
            return manager
        local = manager.all_tasks
    builtin = [p.read_text(errors="ignore") for p in (pathlib.Path(lm_eval.__file__).parent / "tasks").rglob("*.yaml")]
    _refuse([n for n in names if n not in local and not any(n in text for text in builtin)], include_path)
    manager = TaskManager(include_path=include_path)
    _refuse([n for n in names if n not in manager.all_tasks], include_path)
    return manager


def check_data(manager: TaskManager, names: tuple[str, ...]) -> dict[str, int]:
    """Load each task (and its dataset) once before the checkpoint is read, so a dataset that cannot be reached
    offline is one line, not a traceback after the restore; lm_eval loads it again from the `datasets` cache.
    Returns the max_gen_toks of each generation task (check_generation compares them with the model)."""
    generates: dict[str, int] = {}
    for name in names:
        try:
            loaded = manager.load([name])["tasks"]
        except Exception as e:  # noqa: BLE001  (datasets raises ConnectionError, FileNotFoundError and its own kinds)
            cause = " ".join(str(e).split()) or type(e).__name__
            offline = f"; {hub.note()}" if hub.note() else ""
            raise EvalError(f"--tasks: the data of task {name!r} cannot be loaded ({cause}){offline}; offline, give "
                            f"a local task over local files with --include_path, or fill the Hugging Face datasets "
                            f"cache first") from None
        for task_name, task in loaded.items():
            config = getattr(task, "config", None)
            if getattr(config, "output_type", None) == "generate_until":
                kwargs = config.generation_kwargs or {}
                generates[task_name] = int(kwargs.get("max_gen_toks", kwargs.get("max_new_tokens",
                                                                                  DEFAULT_MAX_GEN_TOKS)))
    return generates


def check_generation(generates: dict[str, int], seq_len: int) -> None:
    """Every generation task of check_data leaves room for its prompt (before any request runs)."""
    for name, max_gen in generates.items():
        check_room(max_gen, seq_len, name)


def check_room(max_gen: int, seq_len: int, task: str | None = None) -> None:
    """`max_gen` new tokens leave at least one position of the model's `seq_len` for the prompt."""
    if max_gen >= seq_len:
        who = f"--tasks: task {task!r} asks" if task else "a task asks"
        raise EvalError(f"{who} for max_gen_toks={max_gen}, which leaves no context within the model's "
                        f"seq_len={seq_len}; lower the task's max_gen_toks (generation_kwargs)")


def _refuse(unknown: list[str], include_path: str | None) -> None:
    if unknown:
        where = f" or in --include_path={include_path}" if include_path else ""
        raise EvalError(f"--tasks: no task {unknown[0]!r} in lm_eval's registry{where}; `lm_eval ls tasks` lists "
                        f"the registry's, --include_path adds a folder of task YAML files")


def evaluate(lm: SpmdLM, manager: TaskManager, names: tuple[str, ...], num_fewshot: int | None,
             limit: int | None) -> dict:
    """lm_eval's simple_evaluate of `names`; its result dict, per-example records under "samples"."""
    return lm_eval.simple_evaluate(model=lm, tasks=list(names), num_fewshot=num_fewshot, limit=limit,
                                   task_manager=manager, log_samples=True, verbosity="WARNING")


def table(results: dict) -> str:
    """The results as lm_eval prints them: one row per task, filter and metric."""
    return lm_utils.make_table(results)

"""Many command lines of the project's tools, each run in a forked child of one warm interpreter: the imports (JAX,
Orbax, Flax: seconds on a loaded 2-core machine) are paid once, and each command line then costs what it does up to
its first check. For the tests of what a command does before any work (a bad input: one line, exit 2)."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT

# Run by a fresh interpreter. It imports no module that defines absl flags (the tools' entry modules do, and
# each child imports its tool afresh), never starts a JAX backend, then forks one child per command line.
_DRIVER = r"""
import json, os, runpy, sys, tempfile, traceback
import jax, numpy, orbax.checkpoint, tokenizers  # noqa: F401  (the shared, slow imports)
import train.loop.runner  # noqa: F401
cases, results = json.loads(sys.stdin.read()), []
for module, args, stdout in cases:
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(stdout, os.O_WRONLY) if stdout else out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.argv = [module, *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    out.seek(0)
    err.seek(0)
    results.append([os.waitstatus_to_exitcode(status), out.read(), err.read()])
print(json.dumps(results))
"""


def run_many(cases: list[tuple], timeout: float = 600) -> list[tuple[int, str, str]]:
    """[(exit status, stdout, stderr)] of `python -m MODULE ARGS` for each (MODULE, ARGS) or (MODULE, ARGS, FILE),
    in order; with FILE the command's stdout goes there (a device node, say) instead of being captured."""
    cases = [(module, args, (rest or [None])[0]) for module, args, *rest in cases]
    done = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps([[m, a, str(o) if o else None]
                                                                            for m, a, o in cases]),
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(r) for r in json.loads(done.stdout.strip().splitlines()[-1])]

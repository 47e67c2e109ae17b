"""The servers bench_serve starts itself to measure: train.serve (speculation off and on) and transformers' server
(--peer), each on 127.0.0.1 until the block ends; their error output goes to a temporary file (a pipe nobody
reads would fill and stall them), whose end is shown if one exits early."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time

import httpx


@contextlib.contextmanager
def started(cmd: list[str], port: int, what: str, wait_s: float):
    """`cmd` run until the block ends (SIGTERM, then SIGKILL after 60 s); the URL once its /health answers."""
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errors, text=True)
        try:
            deadline = time.monotonic() + wait_s
            while True:
                if proc.poll() is not None:
                    errors.seek(0)
                    raise SystemExit(f"error: {what}: the server exited: {errors.read()[-500:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise SystemExit(f"error: {what}: the server did not answer /health within {wait_s:g} s")
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()  # train.serve drains on SIGTERM
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
            if proc.poll() is None:
                proc.kill()


def our_server(cmd: list[str], port: int):
    """train.serve as `cmd` gives it (compiling a larger model's steps takes minutes on CPU)."""
    return started(cmd, port, " ".join(cmd[2:4]), 900.0)


def transformers_server(model_dir: str, port: int):
    """`transformers serve --continuous-batching` on 127.0.0.1:port with `model_dir` preloaded."""
    exe = os.path.join(os.path.dirname(sys.executable), "transformers")
    return started([exe, "serve", "--continuous-batching", "--host", "127.0.0.1", "--port", str(port), "--device",
                    "cpu" if not _has_cuda() else "auto", model_dir], port, "--peer=transformers", 300.0)


def _has_cuda() -> bool:
    with contextlib.suppress(ImportError):
        import torch
        return torch.cuda.is_available()
    return False

"""`python -m train.serve (--workdir=DIR [--step=N] | --hf=DIR) [--host=127.0.0.1] [--port=8000]
[--served_model_name=NAME] [--api_key=KEY] [--drain_seconds=N] [--config.serve.*=...]`: the OpenAI-compatible
server (train/serve/server.py) over a run's checkpoint or a Hugging Face directory. Flags and directories are
checked before anything loads; SIGTERM drains (new requests 503, running ones finish), then exit 0."""
from __future__ import annotations

import json
import pathlib
import signal
import socket
import sys
import threading

from absl import app, flags, logging

from mesh import use_cpu_devices
from mesh.layout import AXES
from train import cli, exit_codes
from train.config.experiment import ConfigError, base_config
from train.runtime import extras

FLAGS = flags.FLAGS
SWITCH_INTERVAL_S = 0.0002  # sys.setswitchinterval of the server process (Python's default: 0.005)


def define_flags() -> None:
    cli.config_dict("config", base_config(), "Only --config.serve.* and --config.mesh.* overrides are read.")
    flags.DEFINE_string("workdir", None, "A training run's directory (its newest checkpoint unless --step).")
    flags.DEFINE_integer("step", None, "The checkpoint step to serve (with --workdir).")
    flags.DEFINE_string("hf", None, "A Hugging Face model directory (save_pretrained or train.export_hf).")
    flags.DEFINE_string("host", "127.0.0.1", "The address to listen on (0.0.0.0: every interface).")
    flags.DEFINE_integer("port", 8000, "The port to listen on.")
    flags.DEFINE_string("served_model_name", "", "The model's name in requests and /v1/models (default: the "
                        "directory's name).")
    flags.DEFINE_string("api_key", "", "When set, /v1/* requests need `Authorization: Bearer KEY` (else 401).")
    flags.DEFINE_float("drain_seconds", 30.0, "On SIGTERM, how long running requests may take to finish.")
    flags.DEFINE_integer("num_cpu_devices", 8, "Virtual devices when the platform is CPU (one serves unless "
                         "--config.mesh.* asks for more).")


def overrides(section: str) -> dict:
    """The --config.SECTION.* flags given on the command line."""
    given = {arg.lstrip("-").split("=", 1)[0].split(".")[2] for arg in sys.argv
             if arg.lstrip("-").startswith(f"config.{section}.")}
    return {name: FLAGS.config[section][name] for name in given}


def check_flags() -> pathlib.Path:
    """The source directory, checked; a one-line error before anything loads."""
    if (FLAGS.workdir is None) == (FLAGS.hf is None):
        raise ConfigError("give exactly one of --workdir=DIR (a training run) and --hf=DIR (a Hugging Face model)")
    if FLAGS.step is not None and FLAGS.hf is not None:
        raise ConfigError("--step: only with --workdir (a Hugging Face directory holds one set of weights)")
    if not 0 <= FLAGS.port < 65536:
        raise ConfigError(f"--port={FLAGS.port}: use a port in [0, 65535]")
    if FLAGS.drain_seconds < 0:
        raise ConfigError(f"--drain_seconds={FLAGS.drain_seconds}: use seconds >= 0")
    if FLAGS.num_cpu_devices < 1:
        raise ConfigError(f"--num_cpu_devices={FLAGS.num_cpu_devices}: use a whole number >= 1")
    check_address(FLAGS.host, FLAGS.port)
    for package in ("fastapi", "uvicorn", "prometheus_client", "jinja2"):
        extras.check(package, "python -m train.serve")
    name = "workdir" if FLAGS.workdir is not None else "hf"
    path = pathlib.Path(FLAGS[name].value).expanduser()
    if not path.is_dir() or not any(path.iterdir()):
        raise ConfigError(f"--{name}={path}: no such directory, or it is empty; give "
                          + ("a training run's directory" if name == "workdir" else "a directory written by "
                             "save_pretrained or python -m train.export_hf"))
    needed = "config.json"
    if not (path / needed).is_file():
        raise ConfigError(f"--{name}={path}: no {needed} there; give "
                          + ("a training run's directory" if name == "workdir" else "a Hugging Face model directory"))
    if name == "workdir" and not (path / "checkpoints").is_dir():
        raise ConfigError(f"--workdir={path}: no checkpoints/ there; give the directory of a training run")
    return path


def check_address(host: str, port: int) -> None:
    """--host resolves and --port is free there: bound once and let go, before minutes of loading."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"--host={host}: cannot resolve it ({e}); give an address such as 127.0.0.1 or "
                          f"0.0.0.0") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise ConfigError(f"--port={port}: cannot listen on {host}:{port} ({e.strerror}); stop what holds it "
                              f"or choose another port") from None


def load(path: pathlib.Path):
    """The Served model of --workdir or --hf, its engine built (compiled) on the run's serve.* settings."""
    import dataclasses

    import jax

    from models import paged
    from train import placed as placed_lib
    from train.config.experiment import resolve
    from train.data import chat
    from train.data import tokenizer as tok_lib
    from train.hf import serving as hf_serving
    from train.serve import replicas, runner, speculative
    from train.serve.server import Served

    mesh = overrides("mesh")
    one = not mesh and jax.default_backend() == "cpu"  # on CPU one device serves unless a mesh is asked for
    mesh, devices = ({a: 1 for a in AXES}, 1) if one else (mesh or None, jax.device_count())
    if FLAGS.workdir is not None:
        config = placed_lib.decoding_config(path, mesh)
        renderer_spec = chat_spec(config)
    else:
        config = hf_serving.config_for(base_config(), path, mesh)
        renderer_spec = config.checkpoint.restore_from if (path / tok_lib.FILE).is_file() else "bytes"
    config.serve.update(overrides("serve"))
    plan = resolve(config, devices)
    speculative.check_settings(plan.serve, plan.model)  # before the weights are read
    runner.check_pool(plan.model, plan.serve, paged.max_context(plan.model))
    placed = placed_lib.of_plan(plan, devices)
    if FLAGS.workdir is not None:
        placed = dataclasses.replace(placed_lib.restore(placed, path, FLAGS.step), codec=tok_lib.load_run_codec(path))
    else:
        placed = dataclasses.replace(placed_lib.from_hf(placed, config.checkpoint.restore_from),
                                     codec=hf_serving.codec(path))
    engine = replicas.build(placed, plan.serve)
    name = FLAGS.served_model_name or path.resolve().name
    # The engine decodes on its own per-layer copy of the weights: the stacked params are let go.
    return Served(dataclasses.replace(placed, params=None), engine, name, chat.Renderer(renderer_spec))


def chat_spec(config) -> str:
    """The --tokenizer a run's DATADIR was prepared with (its meta.json's recipe), whose chat template
    `train.prepare --format=chat` renders with; 'bytes' (the default template) otherwise."""
    path = pathlib.Path(config.data.path or "").expanduser() / "meta.json"
    if config.data.source != "tokens" or not path.is_file():
        return "bytes"
    try:
        return json.loads(path.read_text()).get("recipe", {}).get("tokenizer", "bytes")
    except ValueError:
        return "bytes"


def serve(served, host: str, port: int, api_key: str, drain_seconds: float) -> int:
    import uvicorn

    from train.serve.server import create_app
    # The engine's thread waits for the GIL after each step while the event loop streams tokens: Python's default
    # 5 ms switch interval made a tiny model's 1 ms step take 3 ms in the server.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app = create_app(served, api_key)
    service = app.state.service

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM: drain, then stop; a second signal stops at once
            if sig == signal.SIGTERM and not service.draining:
                def drain():
                    running = len(service.loop.request_ids())
                    print(f"SIGTERM: draining {running} request(s) for up to {drain_seconds:g} s (new ones get "
                          f"503)", flush=True)
                    finished = service.drain(drain_seconds)
                    print("stopped: " + ("every request finished" if finished else
                                         f"{service.aborted} request(s) aborted at the deadline"), flush=True)
                    self.should_exit = True
                threading.Thread(target=drain, daemon=True).start()
                return
            self.should_exit = True
            self.force_exit = self.force_exit or sig == signal.SIGINT and service.draining

    print(f"serving {served.name} on http://{host}:{port}/v1 (max context {served.engine.max_context}, "
          f"{served.engine.num_pages} KV pages of {served.engine.settings.page_size} tokens, "
          f"{served.engine.replicas} replica(s))", flush=True)
    Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                          timeout_graceful_shutdown=max(1, int(drain_seconds)))).run()
    service.close()
    return exit_codes.OK


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    path = check_flags()
    use_cpu_devices(FLAGS.num_cpu_devices)
    logging.set_verbosity(logging.WARNING)
    return serve(load(path), FLAGS.host, FLAGS.port, FLAGS.api_key, FLAGS.drain_seconds)

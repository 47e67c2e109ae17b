"""The command line of every `python -m train.*` tool fails the way the config does: one line
`error: ...` on stderr naming the flag or setting (with ml_collections' suggestion), exit status 2.

Use it in place of absl's app.run and config_flags.DEFINE_config_file:

    _CONFIG = cli.config_file("config", "experiments/default.py", "Experiment config file.")
    # or cli.config_dict("config", base_config(), "...") for a built-in config that flags override
    ...
    if __name__ == "__main__":
        cli.run(main)   # main(argv) -> exit status (None means 0)

It covers a misspelled override (`--config.model.presett=x`), an override of the wrong type, a missing
or failing config file, an unknown flag, a missing required flag, absl's UsageError and every UserError
(mesh/errors.py) a tool raises; this is the one place that turns a user's mistake into exit status 2.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from typing import Any, Callable, NoReturn

from absl import app, flags
from ml_collections import config_flags

from mesh.errors import UserError
from train import exit_codes

_CONFIG_FLAGS: list[Any] = []


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(exit_codes.USER_ERROR)


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the scripts that use it, failing as the commands do: one `error:` line, exit 2, no usage text."""

    def error(self, message: str) -> NoReturn:
        fail(message)


def _last_line(text: str) -> str:
    """Errors wrapped by absl or ml_collections carry a traceback or a list of attempts: keep the cause."""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    last = lines[-1] if lines else str(text)
    return re.sub(r"^\w+(Error|Exception): ", "", last) if "Traceback" in str(text) else last


def _override_arg(name: str, key: str, argv: list[str]) -> str:
    """The command-line argument that overrides config key `key` (the first that mentions it)."""
    for arg in argv:
        flag = arg.lstrip("-").split("=", 1)[0]
        if flag.startswith(f"{name}.") and key in flag.split(".")[1:]:
            return flag
    return f"{name}.{key}"


def key_error_message(name: str, error: BaseException, argv: list[str]) -> str:
    """`--config.model.presett=x` -> '--config.model.presett: no such setting "presett"; did you mean "preset"?'."""
    text = str(error.args[0] if error.args else error).strip("'\"")
    text = text.replace("\\n", "\n").replace("\\'", "'")
    lines = [line.strip().strip("'\"") for line in text.splitlines() if line.strip()]
    key = lines[0].strip("'\"") if lines else "?"
    hint = re.search(r'Did you mean "([^"]+)"', text)
    suggestion = (f'; did you mean "{hint.group(1)}"?' if hint
                  else "; see train/config/experiment.py base_config for every key")
    return f'--{_override_arg(name, key, argv)}: no such setting "{key}"{suggestion}'


def _config_load_message(name: str, error: BaseException, path: str | None = None) -> str:
    cause = getattr(error, "_error", error)
    if path is None:
        path = getattr(flags.FLAGS[name], "config_filename", "") if name in flags.FLAGS else ""
    if "No such file" in str(cause) or "empty string" in str(cause):
        return f"--{name}={path}: no such config file; give an experiment file such as experiments/default.py"
    return f"--{name}={path}: {_last_line(str(cause))}"


def _define(name: str, define: Callable[[], Any]) -> Any:
    """Run a config_flags DEFINE_*; its override errors (raised while defining, when the command line names no
    config file or the config is a dict) become one line and exit 2."""
    try:
        holder = define()
    except (KeyError, AttributeError) as e:
        fail(key_error_message(name, e, sys.argv))
    except (ValueError, TypeError, OSError) as e:
        fail(f"--{name}: {_last_line(str(e))}")
    _CONFIG_FLAGS.append((name, holder))
    return holder


def config_file(name: str, default: str, help_text: str) -> Any:
    """config_flags.DEFINE_config_file with one-line, exit-2 errors."""
    return _define(name, lambda: config_flags.DEFINE_config_file(name, default, help_text))


def config_dict(name: str, default: Any, help_text: str) -> Any:
    """config_flags.DEFINE_config_dict (a built-in ConfigDict that `--name.key=value` overrides), same errors."""
    return _define(name, lambda: config_flags.DEFINE_config_dict(name, default, help_text))


def flag_error_message(error: flags.Error) -> str:
    text = _last_line(str(error)) if "Traceback" in str(error) else " ".join(str(error).split())
    required = re.match(r"flag --(\w+)=None: Flag --\w+ must have a value other than None", text)
    if required:
        return f"--{required.group(1)} is required; pass --{required.group(1)}=VALUE"
    return re.sub(r"^flag ", "", text)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with every error as one line and exit 2; the config files are loaded here too."""
    try:
        rest = flags.FLAGS(argv)
    except flags.Error as e:
        fail(flag_error_message(e))
    except (KeyError, AttributeError) as e:
        if "has no attribute 'get_config'" in str(e):
            name, path = _config_file_named(argv)
            fail(f"--{name}={path}: the file has no get_config(); an experiment file defines get_config() returning "
                 f"its ConfigDict (see experiments/tiny.py)")
        name = next((n for n, _ in _CONFIG_FLAGS if any(a.lstrip("-").startswith(f"{n}.") for a in argv)), "config")
        fail(key_error_message(name, e, argv))
    except SyntaxError as e:  # the experiment file is Python the user wrote
        name, path = _config_file_named(argv)
        fail(f"--{name}={path}: {type(e).__name__} at line {e.lineno}: {e.msg}")
    except OSError as e:  # an override read a config file that failed to load
        name, path = _config_file_named(argv)
        fail(_config_load_message(name, e, path))
    except Exception as e:  # noqa: BLE001  (absl raises flags.Error only: anything else came from get_config())
        name, path = _config_file_named(argv)
        fail(f"--{name}={path}: its get_config() raised {type(e).__name__}: {_last_line(str(e)) or '(no message)'}")
    for name, holder in _CONFIG_FLAGS:
        try:
            holder.value.keys()  # a config that failed to load raises its stored error on first access
        except OSError as e:
            fail(_config_load_message(name, e))
    return rest


def _config_file_named(argv: list[str]) -> tuple[str, str]:
    """(flag name, file) of the config file flag the command line gives (the first), for a file that fails to load."""
    for name, _ in _CONFIG_FLAGS:
        for arg in argv:
            if arg.lstrip("-").startswith(f"{name}="):
                return name, arg.split("=", 1)[1]
    name = _CONFIG_FLAGS[0][0] if _CONFIG_FLAGS else "config"
    return name, getattr(flags.FLAGS[name], "config_filename", "") if name in flags.FLAGS else ""


def adopt_command_flags(main: Callable[..., Any]) -> None:
    """absl's --help lists only the main module's key flags: make key to it the flags of the module that defines
    `main` (train/prepare/__main__.py runs train/prepare/command.py's) and the config flags defined here for it."""
    command = flags.FLAGS.flags_by_module_dict().get(getattr(main, "__module__", ""), [])
    for flag in command + [flags.FLAGS[name] for name, _ in _CONFIG_FLAGS]:
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)


class _Stdout:
    """sys.stdout, remembering a write or flush that failed (a full disk, /dev/full, a closed pipe), so that error
    becomes one line rather than a traceback; then it is swapped for os.devnull, so the interpreter's last flush at
    exit cannot print one after the line."""

    def __init__(self, stream: Any):
        self.stream, self.failed = stream, None

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as e:
            self.failed = e
            raise

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            self.failed = e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _stdout_failed(error: OSError) -> bool:
    out = sys.stdout
    if not isinstance(out, _Stdout) or out.failed is not error:
        return False
    sys.stdout = open(os.devnull, "w")  # kept open until the process exits
    return True


def run(main: Callable[[list[str]], int | None]) -> NoReturn:
    """app.run(main) with one-line, exit-2 errors for flags, config files and every UserError, and the
    documented exit status of every other expected failure (train/exit_codes.py)."""
    adopt_command_flags(main)
    sys.stdout = _Stdout(sys.stdout)

    def guarded(argv: list[str]) -> int:
        try:
            status = main(argv) or 0
            sys.stdout.flush()  # a full or closed stdout fails here, inside the guard, rather than at exit
            return status
        except (app.UsageError, UserError) as e:
            fail(str(e))
        except OSError as e:
            if not _stdout_failed(e):
                raise
            fail(f"the output cannot be written to stdout ({e.strerror or e}); redirect it to a writable file")
        except Exception as e:  # noqa: BLE001  (anything else is re-raised: a crash keeps its traceback)
            status = exit_codes.status_of(e)  # expected failures end with their documented status
            if status is None:
                raise
            # The line is the last word: a failed save's abandoned write tasks, collected at shutdown, would
            # log their exceptions again after it ("Task exception was never retrieved").
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)
            print(e if isinstance(e, exit_codes.Stop) else f"error: {e}", file=sys.stderr, flush=True)
            return status

    app.run(lambda argv: sys.exit(guarded(argv)), flags_parser=parse_flags)

"""The base of every error a user can cause (a setting, a flag, a file), kept in the lowest package so every
package can derive from it; `train.cli.run` turns one into a single `error:` line and exit status 2."""
import os
import pathlib
import tempfile


class UserError(ValueError):
    """A mistake the user can fix; the message is one line that names the setting and the fix.

    A ValueError, so code that catches bad values keeps catching it."""


def check_writable(flag: str, path: str, what: str = "file", parents: bool = False) -> None:
    """Raise a UserError unless `path` (a file or directory to create or replace) can be written: its parent
    (with `parents`, its nearest existing ancestor: missing folders are made) is a directory that takes a new
    entry (a probe file, made and removed: permission bits say nothing on read-only mounts, /proc or for root), and
    the path itself, if it exists, is of the right kind: a directory, or a regular file (a device, a pipe or a
    directory is never replaced by an output). Checked before the work that produces it, so a long run never ends
    on an unwritable output; nothing is left behind."""
    target = pathlib.Path(path).expanduser()
    if not target.parent.exists() and not parents:
        raise UserError(f"{flag}={path}: the directory {target.parent} does not exist; create it or choose "
                        f"another path")
    if target.exists() and (target.is_dir() if what == "directory" else target.is_file()) is False:
        kind = "not a directory" if what == "directory" else "a directory" if target.is_dir() else "not a regular file"
        raise UserError(f"{flag}={path}: exists and is {kind}; give a path to a {what}")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not _takes_files(parent) or (target.exists() and not os.access(target, os.W_OK)):
        raise UserError(f"{flag}={path}: cannot write there ({parent} is not a writable directory); "
                        f"choose a writable path")


def _takes_files(directory: pathlib.Path) -> bool:
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def probe_directory(path: pathlib.Path, tag: str) -> None:
    """Create `path` if needed and write and remove a probe file in it (named by `tag`, so processes sharing it do
    not collide): the test that a directory really takes files, which permission bits alone do not prove on
    read-only mounts or full disks. Raises OSError; the caller names the setting."""
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".write-test-{tag}"
    probe.write_text("ok")
    probe.unlink()

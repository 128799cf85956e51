"""Small file helpers shared by the long jobs: atomic JSON writes, file checksums, outputs kept apart from inputs,
and --force / --overwrite replacing only the files a command writes."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Callable


def atomic_write(path: str, write) -> str:
    """Write a file atomically: `write(f)` fills a temporary sibling (binary), fsync, then rename, so a kill leaves
    the old file or the new one, never a torn one (nor a stray temporary file after an error)."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        usual_permissions(tmp)                    # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_text_atomic(path: str, text: str) -> str:
    """A text file (UTF-8), atomically (atomic_write)."""
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def write_json(path: str, obj) -> None:
    """Write JSON atomically (write_text_atomic)."""
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def existing_ancestor(path: str) -> str:
    """The nearest of path's folders above it that exists (where a file or folder made at path would go)."""
    above = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(above):
        above = os.path.dirname(above)
    return above


def current_umask() -> int:
    """The process umask (reading it means setting it, so it is set straight back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def usual_permissions(path: str) -> None:
    """Give a file (0666) or folder (0777) what the umask allows, as a plain open/mkdir would: mkstemp, mkdtemp
    and safetensors' save_file create 0600/0700 ones, which a process running as another user cannot read."""
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~current_umask())


def _flag_paths(paths: dict):
    """(flag, path) pairs of {flag: path, list of paths, or None}."""
    for flag, value in paths.items():
        for path in ([value] if isinstance(value, (str, os.PathLike)) else value or ()):
            yield flag, str(path)


def _overlap(out: str, inp: str) -> str | None:
    """How the resolved path `out` lies relative to the resolved path `inp`, or None when apart."""
    if out == inp:
        return "is the same path as"
    common = os.path.commonpath([out, inp])
    return "contains" if common == out else "is inside" if common == inp else None


def check_apart(outputs: dict, inputs: dict, error: type | None = None) -> None:
    """No output of a command is, contains or sits inside one of its inputs (paths resolved through symlinks):
    replacing the output (--force, --overwrite) would delete the input, and writing it would change the input under
    the command. outputs, inputs: {flag: path, list of paths, or None}; inputs not on disk (hub ids) are skipped.
    Every command with an --out checks this first, before it reads anything. error: the UserError subclass raised."""
    from sglang_eagle3.errors import UserError
    for in_flag, inp in _flag_paths(inputs):
        if not os.path.exists(inp):
            continue
        for out_flag, out in _flag_paths(outputs):
            relation = _overlap(os.path.realpath(out), os.path.realpath(inp))
            if relation:
                raise (error or UserError)(f"{out_flag} {out} {relation} {in_flag} {inp}: an output must not be, "
                                           f"contain or sit inside an input of the same command; choose another "
                                           f"{out_flag}")


def move_in(staging: str, out: str, owned: Callable[[str], bool]) -> list[str]:
    """Move a finished staging folder's files into the existing folder `out`, replacing only what the command writes:
    the staged names and out's files that `owned(name)` claims (stale files of the same kind). Every other file of
    `out` stays; their names are returned. The replaced files are moved aside first and removed only once every new
    file is in place; a failure puts them back (and the new files back into staging)."""
    new = sorted(os.listdir(staging))
    replaced = [n for n in sorted(os.listdir(out)) if n in new or owned(n)]
    aside = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.old-",
                             dir=os.path.dirname(os.path.abspath(out)))
    moved, placed = [], []
    try:
        for name in replaced:
            os.replace(os.path.join(out, name), os.path.join(aside, name))
            moved.append(name)
        for name in new:
            os.replace(os.path.join(staging, name), os.path.join(out, name))
            placed.append(name)
    except BaseException:
        for name in placed:
            os.replace(os.path.join(out, name), os.path.join(staging, name))
        for name in moved:
            os.replace(os.path.join(aside, name), os.path.join(out, name))
        shutil.rmtree(aside, ignore_errors=True)
        raise
    shutil.rmtree(aside)
    return sorted(set(os.listdir(out)) - set(new))


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def append_jsonl(f, rows: list) -> None:
    """Append rows to an open text file and fsync: a kill loses at most the line being written."""
    f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    f.flush()
    os.fsync(f.fileno())


def read_jsonl_resumable(path: str, check, what: str) -> list:
    """Rows of a jsonl file written by append_jsonl, each passed through check(row) (raises KeyError / TypeError /
    ValueError / IndexError for a row that does not belong). A torn last line (a kill mid-write) is cut off the file;
    a bad line before the last is a UserError naming the file and the byte offset."""
    from sglang_eagle3.errors import UserError
    rows, good = [], 0
    if not os.path.exists(path):
        return rows
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break   # no newline: torn write
        try:
            row = json.loads(data[pos:nl])
            check(row)
        except (ValueError, KeyError, TypeError, IndexError):
            if data.find(b"\n", nl + 1) >= 0:
                raise UserError(f"{path}: line at byte {pos} is not {what}; delete the file to start over") from None
            break
        rows.append(row)
        pos = good = nl + 1
    if good < len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
    return rows


@contextmanager
def exclusive_writer(path: str):
    """Hold an exclusive lock on `path` (created, with its folder, if missing) while a long job appends to it;
    a second run on the same file stops with a one-line error instead of interleaving rows."""
    import fcntl

    from sglang_eagle3.errors import UserError
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UserError(f"{path} is being written by another run") from None
        yield

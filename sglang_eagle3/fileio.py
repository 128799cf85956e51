"""Small file helpers shared by the long jobs: atomic JSON writes and file checksums."""
from __future__ import annotations

import hashlib
import json
import os


def write_json(path: str, obj) -> None:
    """Write JSON atomically: a temporary sibling, fsync, then rename (no torn file after a kill)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def current_umask() -> int:
    """The process umask (reading it means setting it, so it is set straight back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def usual_permissions(path: str) -> None:
    """Give a file (0666) or folder (0777) what the umask allows, as a plain open/mkdir would: mkstemp, mkdtemp
    and safetensors' save_file create 0600/0700 ones, which a process running as another user cannot read."""
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~current_umask())


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()

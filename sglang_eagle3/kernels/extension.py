"""The C++ extension (csrc/): built once per machine into the cache, loaded on first use, and what it can do here.

`load()` is the only place the package loads it; kernels/decode.py and kernels/training.py call it and fall back
to their PyTorch twins when it is off or missing (`set_mode("off")`, EAGLE3_KERNELS=off, no compiler: `status()`
says why). `python -m sglang_eagle3.kernels.extension` builds it and prints that status.

Which few-row bf16 products the build has follows the CPU (it is compiled with -march=native): 'amx' (tile
kernel), 'avx512_bf16' (dot products), 'avx512f' (AVX-512F without BF16: bf16 weights widened to fp32 in 512-bit
registers), 'avx2' (the same on 256-bit AVX2 + FMA); a build holds every one its instruction set allows, and
PackedLinears use the first of few_row_kernels() unless told otherwise (using_few_row, using_amx, EAGLE3_FEW_ROW=
avx2 etc.: side-by-side benchmarks and tests). EAGLE3_KERNEL_ISA=avx512f|avx2 builds for that lesser instruction
set instead (what a host without AMX / AVX-512 BF16 runs, on a host that has them).
"""
from __future__ import annotations

import hashlib
import os
import threading
from typing import Optional

import torch

from sglang_eagle3.paths import cache_dir

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# bindings first; then decode (linears: AVX-512 BF16 and AVX2, AVX-512F, AMX tiles; attention, element-wise ops,
# whole layers, trees) and training; + ops.h (declarations), simd.h (vector helpers)
SOURCES = ("bindings.cpp", "linear.cpp", "linear_avx512f.cpp", "amx_linear.cpp", "attention.cpp", "elementwise.cpp",
           "layers.cpp", "tree_ops.cpp", "train_ops.cpp")
# EAGLE3_KERNEL_ISA: build for a lesser x86 instruction set than the host's (the flags switch the others off)
ISA_FLAGS = {
    "native": [],
    "avx512f": ["-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8", "-mno-avx512fp16"],
    "avx2": ["-mno-avx512f", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"],
}

_lock = threading.Lock()
_ext = None
_ext_error: Optional[str] = None
_mode = os.environ.get("EAGLE3_KERNELS", "auto")      # auto | off
_amx = os.environ.get("EAGLE3_AMX", "auto")          # auto | off: the AMX tile kernel where the CPU has it
_few_row = os.environ.get("EAGLE3_FEW_ROW", "auto")  # auto | one of few_row_kernels(): the kernel PackedLinears use


# ---- mode ------------------------------------------------------------------------------------------
def set_mode(mode: str) -> None:
    global _mode
    if mode not in ("auto", "off"):
        raise ValueError(f"kernel mode must be 'auto' or 'off', got {mode!r}")
    _mode = mode


def mode() -> str:
    return _mode


class using:
    """with extension.using("off"): ... - run a block in a kernel mode (benchmarks, tests)."""

    def __init__(self, new: str):
        self.new = new

    def __enter__(self):
        self.old = _mode
        set_mode(self.new)

    def __exit__(self, *exc):
        set_mode(self.old)


class using_amx:
    """with extension.using_amx(False): models built inside use the AVX-512 BF16 kernel (side-by-side
    benchmarks)."""

    def __init__(self, on: bool):
        self.new = "auto" if on else "off"

    def __enter__(self):
        global _amx
        self.old, _amx = _amx, self.new

    def __exit__(self, *exc):
        global _amx
        _amx = self.old


class using_few_row:
    """with extension.using_few_row("avx2"): models built inside use that few-row kernel ("auto": the default),
    one of few_row_kernels() (side-by-side benchmarks, tests)."""

    def __init__(self, kernel: str):
        if kernel != "auto" and kernel not in few_row_kernels():
            raise ValueError(f"few-row kernel {kernel!r}: this build has {', '.join(few_row_kernels()) or 'none'}")
        self.new = kernel

    def __enter__(self):
        global _few_row
        self.old, _few_row = _few_row, self.new

    def __exit__(self, *exc):
        global _few_row
        _few_row = self.old


# ---- the host ------------------------------------------------------------------------------------------
def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), '' where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def kernel_isa() -> str:
    """The instruction set the extension is built for: EAGLE3_KERNEL_ISA (native | avx512f | avx2), default native."""
    isa = os.environ.get("EAGLE3_KERNEL_ISA", "native")
    if isa not in ISA_FLAGS:
        raise ValueError(f"EAGLE3_KERNEL_ISA={isa!r}: choose one of {', '.join(ISA_FLAGS)}")
    return isa


def cpu_has_bf16() -> bool:
    """The CPU computes in bf16 natively (AVX-512 BF16 or AMX) and the build may use it. Without it PyTorch's bf16
    matmuls are emulated: 3-6x slower than fp32 at a decode step's few rows, ~100x on large products (a 2048^3
    product: 114 s vs 0.6 s on a 2-core AVX2 EPYC)."""
    flags = cpu_flags()
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and kernel_isa() == "native"


# ---- build and load ----------------------------------------------------------------------------------
def build_dir() -> str:
    """Per torch version, CPU feature set, target instruction set, checkout and kernel sources: -march=native code built
    on one host never runs on another (a cache copied to a CPU without AMX), an edited header rebuilds (torch hashes
    only sources), and two checkouts of the package do not rebuild each other's copy in turn."""
    h = hashlib.sha1((cpu_flags() + kernel_isa() + CSRC).encode())    # two checkouts: two builds, no thrashing
    for name in sorted(os.listdir(CSRC)):
        with open(os.path.join(CSRC, name), "rb") as f:
            h.update(name.encode() + f.read())
    return os.path.join(cache_dir(), "torch_extensions", f"torch{torch.__version__.split('+')[0]}-{h.hexdigest()[:12]}")


def load(build: bool = True):
    """The compiled extension, or None (mode off, no compiler, build failure: see status())."""
    global _ext, _ext_error
    if _mode == "off":
        return None
    if _ext is not None or _ext_error is not None or not build:
        return _ext
    with _lock:
        if _ext is None and _ext_error is None:
            try:
                from torch.utils.cpp_extension import load as build_and_load
                os.makedirs(build_dir(), exist_ok=True)
                _ext = build_and_load(name="sglang_eagle3_cpu_ops", sources=[os.path.join(CSRC, f) for f in SOURCES],
                                      build_directory=build_dir(), verbose=False,
                                      extra_cflags=["-O3", "-march=native", *ISA_FLAGS[kernel_isa()], "-fopenmp"],
                                      extra_ldflags=["-fopenmp"])
            except Exception as e:   # a missing compiler or headers: fall back to the PyTorch twins
                _ext_error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return _ext


# ---- what the build can do -----------------------------------------------------------------------------
def few_row_isa() -> str:
    """The build's default vector few-row bf16 kernel (linear_bf16): 'avx512_bf16', 'avx512f', 'avx2' (bf16 weights
    widened to fp32 in registers) or '' (none)."""
    ext = load()
    return ext.few_row_isa() if ext is not None else ""


def few_row_kernels() -> list[str]:
    """Every few-row kernel this machine can run with this build, the fastest first: 'amx' (where usable), then the
    vector ones (an AMX host's native build: amx, avx512_bf16, avx512f, avx2; an AVX-512F build: avx512f, avx2)."""
    ext = load()
    if ext is None:
        return []
    return (["amx"] if ext.amx_usable() else []) + list(ext.few_row_kernels())


def amx_usable() -> bool:
    """This machine can run csrc's AMX tile kernel: an AMX CPU, the OS granting tile data, a build with it."""
    ext = load()
    return ext is not None and ext.amx_usable()


def amx_active() -> bool:
    """PackedLinears built now use csrc's AMX tile kernel (usable here, and not turned off). Its bf16 decodes follow
    fp32 as closely as the AVX-512 kernel's, PyTorch's and transformers' (bench/bench_fidelity.py: 53, 51, 47, 52
    misses in 2,460 steps, all where fp32's two best logits lie within 0.26)."""
    return _amx != "off" and amx_usable()


def few_row_kernel() -> Optional[str]:
    """The few-row kernel PackedLinears built now use: 'amx', 'avx512_bf16', 'avx512f', 'avx2', or None (no
    extension). The one chosen by using_few_row / EAGLE3_FEW_ROW, else AMX where active, else the build's default."""
    if load() is None:
        return None
    if _few_row != "auto":
        if _few_row not in few_row_kernels():
            raise ValueError(f"EAGLE3_FEW_ROW={_few_row!r}: this build has {', '.join(few_row_kernels()) or 'none'}")
        return _few_row
    return "amx" if amx_active() else few_row_isa() or None


def status() -> dict:
    ext = load()
    return {"mode": _mode, "extension": ext is not None, "extension_error": _ext_error, "isa": kernel_isa(),
            "few_row_kernel": few_row_kernel() if ext is not None else None, "few_row_kernels": few_row_kernels()}


if __name__ == "__main__":
    s = status()
    print("C++ kernels:", f"built (few-row linears: {s['few_row_kernel']})" if s["extension"] else s["extension_error"])

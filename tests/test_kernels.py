"""The kernel boundary: the C++ extension builds wherever a compiler is, every op the package uses is bound, and
nothing outside sglang_eagle3/kernels/ calls the extension's ops itself."""
from __future__ import annotations

import ast
import os
import shutil

import pytest

from sglang_eagle3.kernels import extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOUND_OPS = {"pack_bf16", "linear_bf16", "few_row_isa", "pack_amx", "amx_usable", "layer_step", "draft_layer",
             "tree_attention", "qkv_attention", "rms_norm", "add_rms_norm", "silu_and_mul", "topk_logprobs",
             "build_tree", "accept_greedy", "accept_sampling", "soft_ce_forward", "soft_ce_backward",
             "target_distribution"}


def test_the_extension_builds_where_a_compiler_is():
    """A missing source or symbol must fail here, not fall back to the PyTorch twins without a word (every
    kernel-equality test would then compare the twins with themselves)."""
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler on this machine: the PyTorch twins run")
    ext = extension.load()
    assert ext is not None, extension.status()["extension_error"]
    assert BOUND_OPS <= set(dir(ext))
    assert extension.status()["few_row_kernel"] in ("amx", "avx512_bf16", "avx512f", "avx2")


def test_every_source_file_is_built():
    on_disk = {f for f in os.listdir(extension.CSRC) if f.endswith(".cpp")}
    assert on_disk == set(extension.SOURCES)


def test_only_the_kernels_package_calls_the_extensions_ops():
    """`extension.load().op(...)` appears only under sglang_eagle3/kernels/ (decode.py, training.py)."""
    offenders = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "sglang_eagle3")):
        if os.sep + "kernels" in dirpath:
            continue
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.Attribute) and node.attr in BOUND_OPS and isinstance(node.value, ast.Call) \
                        and getattr(node.value.func, "attr", "") == "load":
                    offenders.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} .{node.attr}")
    assert not offenders, offenders


def test_kernel_isa_names_a_build_for_a_lesser_instruction_set(monkeypatch):
    monkeypatch.setenv("EAGLE3_KERNEL_ISA", "avx2")
    assert extension.kernel_isa() == "avx2" and not extension.cpu_has_bf16()
    monkeypatch.setenv("EAGLE3_KERNEL_ISA", "sse")
    with pytest.raises(ValueError, match="EAGLE3_KERNEL_ISA='sse'"):
        extension.kernel_isa()

"""The kernel boundary: the C++ extension builds wherever a compiler is, every op the package uses is bound, and
nothing outside sglang_eagle3/kernels/ calls the extension's ops itself."""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys

import pytest

from sglang_eagle3.kernels import extension

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BOUND_OPS = {"pack_bf16", "linear_bf16", "few_row_isa", "few_row_kernels", "pack_amx", "amx_usable", "LayerWeights",
             "layer_step", "draft_layer", "tree_attention", "qkv_attention", "rms_norm", "add_rms_norm", "silu_and_mul",
             "topk_logprobs", "build_tree", "accept_greedy", "accept_sampling", "soft_ce_forward", "soft_ce_backward",
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


# the bit-exactness tests of test_target.py that an AVX-512F build without BF16 must pass with its own code paths
AVX512F_BUILD_TESTS = ("attends_as_the_one_token_step or static_attention or (packed_linear_paths_agree and "
                       "(avx512f or avx2)) or same_bits or fused_layer_step or rows_verify")


def test_an_avx512f_build_passes_the_bit_exactness_tests():
    """The build a Skylake-SP / Cascade Lake / Ice Lake Xeon runs (AVX-512F, no AVX-512 BF16, no AMX), made here
    with EAGLE3_KERNEL_ISA=avx512f: its default few-row kernel is the AVX-512F one, and its tree attention (fp32
    scores on 512-bit vectors, not the BF16 dot products a native build of this host takes) and linears pass the
    bit-exactness tests: a verified token attends as the one-token step, a row's result does not depend on the
    rows beside it. Run in a fresh process (the build is per instruction set); none of them may skip."""
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler on this machine")
    if "avx512f" not in extension.cpu_flags().split():
        pytest.skip("this CPU has no AVX-512F")
    env = {**os.environ, "EAGLE3_KERNEL_ISA": "avx512f"}
    env.pop("EAGLE3_FEW_ROW", None)
    probe = subprocess.run([sys.executable, "-c", "import json; from sglang_eagle3.kernels import extension as e; "
                            "print(json.dumps([e.few_row_kernels(), e.few_row_kernel(), e.cpu_has_bf16()]))"],
                           env=env, capture_output=True, text=True, timeout=900)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert json.loads(probe.stdout.strip().splitlines()[-1]) == [["avx512f", "avx2"], "avx512f", False]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", AVX512F_BUILD_TESTS,
                          os.path.join(ROOT, "tests", "models", "test_target.py")], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=1800)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary and "deselected" in summary, summary

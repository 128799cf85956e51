"""CPU fast paths for the decode step, each with a plain-PyTorch twin that gives the same result.

- `PackedLinear`: a linear layer whose bf16 weight is reordered once into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, the prepacking inductor's freezing pass uses). One-token
  matrix-vector products then read weights at ~40 GB/s on 2 AVX-512 BF16 cores instead of ~17 GB/s for
  `F.linear` (bench_decode measures both); results are bit-identical in bf16.
- `csrc/cpu_ops.cpp` (a torch C++ extension, compiled once into the cache): tree attention straight over
  the row-indexed KV pool (no gather, no slicing copies, each row attends over its own length), RMSNorm,
  residual add + RMSNorm, SiLU * up; and for training, TTT's soft cross-entropy and the target's
  distribution over the draft vocabulary (one pass per row; dispatched from soft_ce.py, twins there).
- `csrc/tree_ops.cpp`: the draft tree's bookkeeping as one call each (tree.build_draft_tree, the per-level
  `topk_logprobs`, verify.accept_greedy_logits): at batch 1 those small tensor ops cost more than the draft's
  levels themselves.

`set_mode("off")` (or EAGLE3_KERNELS=off) uses the PyTorch twins everywhere: the eager reference.
If the extension cannot be built (no compiler), the twins are used and `status()` says why.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

import torch
import torch.nn.functional as F

_lock = threading.Lock()
_ext = None
_ext_error: Optional[str] = None
_mode = os.environ.get("EAGLE3_KERNELS", "auto")      # auto | off


def set_mode(mode: str) -> None:
    global _mode
    if mode not in ("auto", "off"):
        raise ValueError(f"kernel mode must be 'auto' or 'off', got {mode!r}")
    _mode = mode


def mode() -> str:
    return _mode


class using:
    """with kernels.using("off"): ... - run a block in a kernel mode (benchmarks, tests)."""

    def __init__(self, new: str):
        self.new = new

    def __enter__(self):
        self.old = _mode
        set_mode(self.new)

    def __exit__(self, *exc):
        set_mode(self.old)


CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = ("cpu_ops.cpp", "amx_linear.cpp", "layers.cpp", "tree_ops.cpp")        # + ops.h, their shared declarations


def build_dir() -> str:
    """Per torch version, CPU feature set and kernel sources: -march=native code built on one host never runs on
    another (a cache copied to a CPU without AMX), and an edited header rebuilds (torch hashes only sources)."""
    import hashlib
    from .testbed import cache_dir
    h = hashlib.sha1(cpu_flags().encode())
    for name in sorted(os.listdir(CSRC)):
        with open(os.path.join(CSRC, name), "rb") as f:
            h.update(name.encode() + f.read())
    return os.path.join(cache_dir(), "torch_extensions", f"torch{torch.__version__.split('+')[0]}-{h.hexdigest()[:12]}")


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def extension(build: bool = True):
    """The compiled extension, or None (mode off, no compiler, build failure: see status())."""
    global _ext, _ext_error
    if _mode == "off":
        return None
    if _ext is not None or _ext_error is not None or not build:
        return _ext
    with _lock:
        if _ext is None and _ext_error is None:
            try:
                from torch.utils.cpp_extension import load
                os.makedirs(build_dir(), exist_ok=True)
                _ext = load(name="sglang_eagle3_cpu_ops", sources=[os.path.join(CSRC, f) for f in SOURCES],
                            build_directory=build_dir(),
                            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                            verbose=False)
            except Exception as e:   # a missing compiler or headers: fall back to the PyTorch twins
                _ext_error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return _ext


def status() -> dict:
    ext = extension()
    return {"mode": _mode, "extension": ext is not None, "extension_error": _ext_error,
            "packed_linear": _mode != "off" and packing_supported(torch.bfloat16),
            "few_row_kernel": ("amx" if amx_active() else few_row_isa() or None) if ext is not None else None}


def few_row_isa() -> str:
    """What csrc's few-row bf16 kernel (linear_bf16) was built with: 'avx512_bf16', 'avx2' (AVX2 + FMA: bf16
    weights widened to fp32 in registers) or '' (none)."""
    ext = extension()
    return ext.few_row_isa() if ext is not None else ""


# ---- linear ----------------------------------------------------------------------------------------
def packing_supported(dtype: torch.dtype) -> bool:
    """oneDNN bf16 prepacking pays on CPUs with AVX-512 BF16 (or AMX); fp32 stays on F.linear (the
    reference path: prepacked fp32 matmuls reorder the sums)."""
    if dtype != torch.bfloat16 or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return torch.backends.mkldnn.is_available() and cpu_has_bf16()


def cpu_has_bf16() -> bool:
    """The CPU computes in bf16 natively (AVX-512 BF16 or AMX). Without it PyTorch's bf16 matmuls are emulated:
    3-6x slower than fp32 at a decode step's few rows, ~100x on large products (a 2048^3 product: 114 s vs 0.6 s
    on a 2-core AVX2 EPYC)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


SMALL_M = 32       # rows up to which csrc's AVX-512 BF16 kernel beats oneDNN (more: prefill; steps pass any_rows)
ALL_ROWS = 1 << 62  # AVX2 without native bf16: csrc's kernel serves every product (oneDNN's bf16 is emulated there)
SMALL_M_AMX = 128  # the same for its AMX tile kernel
# auto (default) | off: the AMX tile kernel where the CPU has it. Its bf16 decodes follow fp32 as closely as the
# AVX-512 kernel's, PyTorch's and transformers' (bench/bench_fidelity.py: 53, 51, 47, 52 misses in 2,460 steps, all
# where fp32's two best logits lie within 0.26); its one-token step costs what the AVX-512 kernel's does, and a verify
# of 8 tokens 1.16x a one-token step against the AVX-512 kernel's 1.56x (bench_decode --parts step, alternated).
_amx = os.environ.get("EAGLE3_AMX", "auto")


def amx_usable() -> bool:
    """This machine can run csrc's AMX tile kernel: an AMX CPU, the OS granting tile data, a build with it."""
    ext = extension()
    return ext is not None and ext.amx_usable()


def amx_active() -> bool:
    """PackedLinears built now use csrc's AMX tile kernel (usable here, and not turned off)."""
    return _amx != "off" and amx_usable()


class using_amx:
    """with kernels.using_amx(False): models built inside use the AVX-512 BF16 kernel (side-by-side benchmarks)."""

    def __init__(self, on: bool):
        self.new = "auto" if on else "off"

    def __enter__(self):
        global _amx
        self.old, _amx = _amx, self.new

    def __exit__(self, *exc):
        global _amx
        _amx = self.old


def small_m(packed: Optional[torch.Tensor] = None) -> int:
    """Rows up to which the few-row kernel (of this packed weight; default: the one built now) serves a product."""
    amx = packed.dim() == 6 if packed is not None else amx_active()
    if amx:
        return SMALL_M_AMX
    return ALL_ROWS if few_row_isa() == "avx2" else SMALL_M


class PackedLinear:
    """y = x @ W^T + b with W [N, K], decided when built (set_mode / using_amx before loading a model):
    bf16 on a CPU with AMX (unless EAGLE3_AMX=off): up to SMALL_M_AMX rows, csrc's tile kernel (amx_linear.cpp: 16 rows cost what one
    does); with AVX-512 BF16 only: up to SMALL_M rows, csrc's dot-product kernel (45-70 GB/s at one row on 2 cores,
    but bound by its dot products from ~4 rows on). Either way over weights packed for it, and a row's result does
    not depend on how many rows come with it;
    more rows (prefill), oneDNN over its own prepacked copy (2x the weight memory, for the faster prefill).
    any_rows=True (the target's decode and verify forwards) keeps every row count on the few-row kernel: a
    verified token's logits then come from the sums a one-token step computes, however many rows a batch of trees
    has (oneDNN's sums for a row depend on the product's shape, which broke greedy equality at batch 8 with
    8-token trees).
    bf16 on an AVX2 CPU without native bf16: csrc's kernel for every row count (bf16 weights widened in registers,
    fp32 FMAs: decode reads half fp32's bytes; PyTorch's emulated bf16 products run 3-100x slower), no other copy.
    Otherwise F.linear on the weight itself."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, pack: Optional[bool] = None):
        weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.out_features, self.in_features = weight.shape
        avx2 = (pack is None and _mode != "off" and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
                and not cpu_has_bf16() and few_row_isa() == "avx2")
        if pack is None:
            pack = _mode != "off" and weight.device.type == "cpu" and packing_supported(weight.dtype)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1) if pack else None
        ext = extension() if pack or avx2 else None
        if ext is not None and amx_active():
            self.small = ext.pack_amx(weight)
        else:
            self.small = ext.pack_bf16(weight) if ext is not None and few_row_isa() else None
        self.small_m = small_m(self.small) if self.small is not None else 0
        self.bias32 = None if self.bias is None else self.bias.float()
        self.weight = None if pack or avx2 else weight  # no unpacked copy when packed

    def __call__(self, x: torch.Tensor, any_rows: bool = False) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.packed is None:                         # AVX2: the few-row kernel is the only copy of the weight
            y = extension().linear_bf16(x2.to(torch.bfloat16), self.small, self.out_features, self.bias32).to(x.dtype)
        elif self.small is not None and x2.dtype == torch.bfloat16 and (any_rows or x2.shape[0] <= self.small_m):
            y = extension().linear_bf16(x2, self.small, self.out_features, self.bias32)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.view(*shape[:-1], self.out_features)


# ---- element-wise -----------------------------------------------------------------------------------
_EXT_DTYPES = (torch.float32, torch.bfloat16)


def _use_ext(*tensors) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() and t.dtype == tensors[0].dtype for t in tensors) \
        and tensors[0].dtype in _EXT_DTYPES


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), the first maximum on ties. On CPU torch's bf16 argmax is 3-5x slower than max(-1) (same
    indices: the first maximum), and a cast to fp32 first costs a copy of x; fp32 argmax is the faster one."""
    return x.max(-1).indices if x.dtype == torch.bfloat16 else x.argmax(-1)


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of log_softmax(logits.float()) over the last dim (fp32 [..., k], larger first) and their
    indices. On CPU one pass of the extension (ties: the smaller index first); elsewhere the PyTorch ops."""
    ext = extension()
    if ext is not None and logits.device.type == "cpu" and logits.dtype in _EXT_DTYPES:
        vals, ids = ext.topk_logprobs(logits, k)
        return vals, ids
    return topk_logprobs_ref(logits, k)


def topk_logprobs_ref(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    vals, ids = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
    return vals, ids


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ext = extension()
    if ext is not None and _use_ext(x, weight):
        return ext.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += residual (in place: x is the residual stream); returns rms_norm(x)."""
    ext = extension()
    if ext is not None and _use_ext(x, residual, weight):
        return ext.add_rms_norm(x, residual, weight, eps)
    x.add_(residual)
    return rms_norm_ref(x, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    ext = extension()
    if ext is not None and _use_ext(gate_up):
        return ext.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- attention ---------------------------------------------------------------------------------------
def tree_attention(q, k_new, v_new, k_cache, v_cache, rows, lens, write_start, new_mask, scale: float):
    """Store k_new/v_new [B, nKV, T, D] at slots write_start[b] + t of pool rows rows[b], then attend.

    q [B, nH, T, D]; k_cache/v_cache [R, nKV, S, D] (one layer of the pool); rows, lens, write_start [B] int64
    (lens = committed slots, all visible); new_mask [B, T, F] bool: query t sees uncommitted slot lens + f.
    -> [B, nH, T, D].
    """
    ext = extension()
    if ext is not None and _use_ext(k_cache, v_cache) and q.dtype == k_cache.dtype:
        return ext.tree_attention(q.contiguous(), k_new.contiguous(), v_new.contiguous(), k_cache, v_cache,
                                  rows, lens, write_start, new_mask.contiguous(), scale)
    if k_cache.is_cuda:
        return tree_attention_static(q, k_new, v_new, k_cache, v_cache, rows, lens, write_start, new_mask, scale)
    return tree_attention_ref(q, k_new, v_new, k_cache, v_cache, rows, lens, write_start, new_mask, scale)


def qkv_attention(qkv, cos, sin, num_heads: int, num_kv_heads: int, k_cache, v_cache, rows, lens, write_start,
                  new_mask, scale: float):
    """Rotary embedding of q and k fused with tree_attention, straight from the fused projection.

    qkv [B, T, (nH + 2 nKV) * D]; cos, sin [B, T, D] (transformers' rotary embedding, in qkv's dtype).
    -> [B, T, nH * D], ready for o_proj."""
    ext = extension()
    if ext is not None and _use_ext(qkv, cos, sin, k_cache, v_cache):
        return ext.qkv_attention(qkv, cos, sin, num_heads, num_kv_heads, k_cache, v_cache, rows, lens, write_start,
                                 new_mask.contiguous(), scale)
    return qkv_attention_ref(qkv, cos, sin, num_heads, num_kv_heads, k_cache, v_cache, rows, lens, write_start,
                             new_mask, scale, attention=tree_attention_static if k_cache.is_cuda else None)


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int):
    """[B, T, (nH + 2 nKV) * D] -> q [B, T, nH, D], k, v [B, T, nKV, D] (views)."""
    B, T, W = qkv.shape
    D = W // (num_heads + 2 * num_kv_heads)
    q = qkv[..., :num_heads * D].view(B, T, num_heads, D)
    k = qkv[..., num_heads * D:(num_heads + num_kv_heads) * D].view(B, T, num_kv_heads, D)
    v = qkv[..., (num_heads + num_kv_heads) * D:].view(B, T, num_kv_heads, D)
    return q, k, v


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, D]; cos, sin [B, 1, T, D] -> x * cos + rotate_half(x) * sin (transformers' formula)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def qkv_attention_ref(qkv, cos, sin, num_heads, num_kv_heads, k_cache, v_cache, rows, lens, write_start, new_mask,
                      scale, attention=None):
    B, T, _ = qkv.shape
    q, k, v = (x.transpose(1, 2) for x in split_heads(qkv, num_heads, num_kv_heads))
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    o = (attention or tree_attention_ref)(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, k_cache, v_cache, rows, lens,
                           write_start, new_mask, scale)
    return o.transpose(1, 2).reshape(B, T, -1)


def tree_attention_static(q, k_new, v_new, k_cache, v_cache, rows, lens, write_start, new_mask, scale: float):
    """tree_attention with shapes that depend only on the pool (no host sync): every row attends over the whole
    KV window with a mask from its length, through SDPA. What CUDA graphs capture on GPUs."""
    B, nH, T, D = q.shape
    S, F_ = k_cache.shape[2], new_mask.shape[2]
    slot = write_start.view(B, 1) + torch.arange(T, device=q.device).view(1, T)            # [B, T]
    r = rows.view(B, 1).expand(B, T)
    k_cache[r, :, slot] = k_new.transpose(1, 2)
    v_cache[r, :, slot] = v_new.transpose(1, 2)
    rel = torch.arange(S, device=q.device).view(1, 1, S) - lens.view(B, 1, 1)               # slot - committed
    seen = torch.gather(new_mask, 2, rel.clamp(0, max(F_ - 1, 0)).expand(B, T, S)) & (rel >= 0) & (rel < F_)
    mask = ((rel < 0) | seen).unsqueeze(1)                                                  # [B, 1, T, S]
    return F.scaled_dot_product_attention(q, k_cache[rows], v_cache[rows], attn_mask=mask, scale=scale,
                                          enable_gqa=True)


def tree_attention_ref(q, k_new, v_new, k_cache, v_cache, rows, lens, write_start, new_mask, scale: float):
    B, nH, T, D = q.shape
    nKV, F_ = k_cache.shape[1], new_mask.shape[2]
    slot = write_start.view(B, 1) + torch.arange(T, device=q.device).view(1, T)            # [B, T]
    r = rows.view(B, 1).expand(B, T)
    k_cache[r, :, slot] = k_new.transpose(1, 2)
    v_cache[r, :, slot] = v_new.transpose(1, 2)
    S = int((lens + F_).max())
    k, v = k_cache[rows, :, :S], v_cache[rows, :, :S]                                          # [B, nKV, S, D]
    pos = torch.arange(S, device=q.device).view(1, 1, S)
    rel = pos - lens.view(B, 1, 1)
    seen = torch.gather(new_mask, 2, rel.clamp(0, max(F_ - 1, 0)).expand(B, T, S)) if F_ else \
        torch.zeros(B, T, S, dtype=torch.bool, device=q.device)
    mask = (rel < 0) | (seen & (rel < F_))                                                      # [B, T, S]
    g = nH // nKV
    scores = torch.matmul(q.float().reshape(B, nKV, g * T, D), k.float().transpose(-1, -2)).view(B, nKV, g, T, S)
    scores = scores.mul_(scale).masked_fill_(~mask.view(B, 1, 1, T, S), float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(B, nKV, g * T, S)
    return torch.matmul(probs, v.float()).view(B, nH, T, D).to(q.dtype)

"""bench_decode: what decides speculative decoding speed on this machine (the parts are in bench/decode.py).

    python bench/bench_decode.py [--target testbed] [--draft checkpoints/smollm2-135m-eagle3] [--n 6]
        [--parts speed,step,trees,profile,compile,divergence,contention] [--out results/bench_decode.json]

Writes JSON (partial results survive a kill), a Markdown report with the targets marked met / not met, and a PNG
(tokens/s per runtime, verify cost vs tree size, break-even vs measured acceptance).
"""
from __future__ import annotations

import argparse

import torch

from sglang_eagle3.bench import decode as D
from sglang_eagle3.bench import run_cli
from sglang_eagle3.bench.contention import LOADS as CONTENTION_LOADS
from sglang_eagle3.bench.decode_report import plot, render
from sglang_eagle3.bench.report import run_metadata, sibling, write_json_atomic, write_text_atomic
from sglang_eagle3.engine.settings import add_dtype_arg, load_profile, resolve_dtype
from sglang_eagle3.engine.speculation import SpecConfig
from sglang_eagle3.kernels import extension
from sglang_eagle3.models.testbed import resolve_target
from sglang_eagle3.paths import data_dir, shipped_draft

PARTS = ("speed", "step", "trees", "profile", "llamacpp", "compile", "divergence", "contention")
FALLBACK_DEMO_TREE = SpecConfig(3, 2, 6)


def demo_tree(draft) -> SpecConfig:
    """The tree the engine uses by default at batch 1: the draft's tuned profile entry (the fastest tree measured
    where vanilla won), else 3/2/6."""
    prof = load_profile(None, draft)[0] if draft else None
    return (prof.measured_tree(1) if prof else None) or FALLBACK_DEMO_TREE


def parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="testbed")
    ap.add_argument("--draft", default=None, help="trained draft for the tree part (default: the shipped one)")
    ap.add_argument("--data", default=data_dir())
    add_dtype_arg(ap)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the GPU path: CUDA graphs vs eager)")
    ap.add_argument("--n", type=int, default=6, help="MT-bench first turns for the speed part (batch 1)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--parts", default="speed,step,trees,profile,llamacpp",
                    help=f"comma-separated of {', '.join(PARTS)} (compile takes minutes; divergence is a count)")
    ap.add_argument("--context", type=int, default=256, help="cached tokens before the timed forwards")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--tree-sizes", default="1,2,4,6,8,16,32")
    ap.add_argument("--trees", default="1,1,2;2,1,3;3,1,4;3,2,6;4,2,8;5,4,16",
                    help="num_steps,topk,num_draft_tokens;... for the tree part (3,2,6 is the demo tree)")
    ap.add_argument("--tree-prompts", type=int, default=4, help="MT-bench prompts per tree shape")
    ap.add_argument("--profile-batches", default="1,8")
    ap.add_argument("--divergence-prompts", type=int, default=100)
    ap.add_argument("--divergence-tokens", type=int, default=64)
    ap.add_argument("--divergence-batch", type=int, default=8)
    ap.add_argument("--loads", default=",".join(CONTENTION_LOADS),
                    help=f"contention part: comma-separated of {', '.join(CONTENTION_LOADS)} (idle first: the others "
                         "are reported as shares of it)")
    ap.add_argument("--contention-prompts", type=int, default=4, help="MT-bench prompts per load")
    ap.add_argument("--out", default="results/bench_decode.json")
    return ap


def run(argv=None) -> int:
    from sglang_eagle3.errors import UserError, check_at_least, flags_of
    a = parser().parse_args(argv)
    a.dtype = resolve_dtype(a.dtype, a.device)
    parts = a.parts.split(",")
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise UserError(f"--parts {','.join(bad)}: choose from {', '.join(PARTS)}")
    loads = a.loads.split(",")
    bad = [x for x in loads if x not in CONTENTION_LOADS]
    if "contention" in parts and (bad or loads[0] != "idle"):
        raise UserError(f"--loads {a.loads}: " + (f"choose from {', '.join(CONTENTION_LOADS)}" if bad else
                                                  "start with idle (the other loads are shares of it)"))
    check_at_least(1, flags_of(a, "n", "max_new_tokens", "repeats", "tree_prompts", "contention_prompts"))
    torch.set_num_threads(a.threads)
    target = resolve_target(a.target)
    draft = a.draft or shipped_draft()
    prompts, mixed = D.eval_prompts(a.data, max(a.n, a.tree_prompts, a.contention_prompts), a.divergence_prompts)
    demo = demo_tree(draft)
    res = {"meta": {**run_metadata(), "target": target, "draft": draft, "dtype": a.dtype, "device": a.device,
                    "threads": a.threads, "demo_tree": [demo.num_steps, demo.topk, demo.num_draft_tokens],
                    "args": vars(a)}}
    rt = D.Runtimes(target, a.dtype, a.device) if set(parts) - {"divergence", "llamacpp"} else None
    if rt is not None:
        res["extension"] = {"built": rt.extension_ready, "load_s": rt.extension_load_s, **extension.status()}

    def save():
        write_json_atomic(a.out, res)
    if "speed" in parts:
        res["speed"] = D.bench_speed(rt, prompts[:a.n], a.max_new_tokens)
        save()
    if "step" in parts:
        res["step"] = D.bench_step(rt, a.context, [int(x) for x in a.tree_sizes.split(",")], a.repeats)
        save()
    if "trees" in parts and draft:
        trees = D.parse_trees(a.trees)
        if demo.key not in {t.key for t in trees}:
            trees.append(demo)
        res["trees"] = D.bench_trees(rt, draft, a.dtype, prompts[:a.tree_prompts], trees, a.max_new_tokens)
        save()
    if "profile" in parts:
        res["profile"] = D.bench_profile(rt, draft, a.dtype, prompts[0], demo,
                                         [int(x) for x in a.profile_batches.split(",")])
        save()
    if "llamacpp" in parts:
        from sglang_eagle3.bench.llamacpp import vanilla_decode_tps
        res["llamacpp"] = vanilla_decode_tps(target, a.threads, a.max_new_tokens)
        save()
    if "compile" in parts:
        res["compile"] = D.bench_compile(rt, a.context)
        save()
    if "contention" in parts:
        from sglang_eagle3.bench.contention import bench_contention
        from sglang_eagle3.engine.loader import load_draft
        from sglang_eagle3.engine.settings import DTYPES
        spec_draft = load_draft(draft, DTYPES[a.dtype]) if draft else None
        with extension.using("auto"):
            res["contention"] = bench_contention(rt.fused, spec_draft, demo, target, a.dtype,
                                                 prompts[:a.contention_prompts], a.max_new_tokens, a.context,
                                                 a.repeats, loads)
        save()
    if "divergence" in parts and a.dtype != "float32":
        res["divergence"] = D.divergence(target, draft, a.dtype, mixed, a.divergence_tokens, a.divergence_batch)
        save()
    text = render(res, a)
    print(text)
    write_text_atomic(sibling(a.out, ".md"), text + "\n")
    plot(res, sibling(a.out, ".png"))
    print(f"\nwrote {a.out}, {sibling(a.out, '.md')}, {sibling(a.out, '.png')}")
    return 0


def main(argv=None) -> int:
    return run_cli("bench_decode", run, argv)

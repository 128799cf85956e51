"""bench_decode's report: the Markdown text with each target marked met / not met, and the PNG."""
from __future__ import annotations

from sglang_eagle3.bench import decode as D
from sglang_eagle3.bench.contention import LOAD_TEXT
from sglang_eagle3.bench.report import format_table, save_figure, subplots

# fused-avx512 / fused-amx on AMX CPUs, fused-avx2 on AVX-512F CPUs without BF16: the few-row kernel fused does not use
STEP_RUNTIMES = ("eager", "fused", "fused-avx512", "fused-amx", "fused-avx2")


def _ms(x):
    return f"{x * 1e3:.1f}"


def render(res, a) -> str:
    out, checks = [], []
    m = res["meta"]
    out.append(f"Target {m['target']}, {m['dtype']}, batch 1, {m['threads']} threads. eager = plain PyTorch "
               f"(--compile off); fused = prepacked oneDNN linears + C++ kernels (default); on CPUs with AMX, "
               f"fused-avx512 / fused-amx (AMX CPUs), fused-avx2 (AVX-512F without BF16) = the same with the "
               f"few-row kernel the default does not use.")
    if "extension" in res:
        e = res["extension"]
        out.append(f"C++ extension: {'built' if e['built'] else 'NOT built: ' + str(e['extension_error'])}"
                   f"{' (few-row linears: ' + str(e.get('few_row_kernel')) + ')' if e['built'] else ''}, "
                   f"loaded in {e['load_s']:.2f} s (compiled once into the cache at install; ~20 s the first time)")
    s = res.get("speed")
    if s:
        med = s["median_tokens_per_s"]
        rows = [[name, f"{med[name]:.1f}"] for name in ("transformers", "eager", "fused")]
        lc = res.get("llamacpp") or {}
        if lc.get("tokens_per_s"):
            rows.append(["llama.cpp (llama-bench tg)", f"{lc['tokens_per_s']:.1f}"])
        out += ["", f"Decode tokens/s, median over {s['prompts']} MT-bench prompts, {s['max_new_tokens']} new tokens "
                    f"(alternated per prompt)", format_table(["runtime", "tokens/s"], rows),
                f"fused / transformers {s['ratio_fused_over_transformers']:.2f}x, eager / transformers "
                f"{s['ratio_eager_over_transformers']:.2f}x, fused / eager {s['ratio_fused_over_eager']:.2f}x; "
                f"fused identical to transformers on {s['identical']['fused_vs_transformers']}/{s['prompts']}, "
                f"to eager on {s['identical']['fused_vs_eager']}/{s['prompts']} prompts (bf16 near-ties can differ)"]
        checks.append(("vanilla >= 2.5x transformers' generate", s["ratio_fused_over_transformers"] >= 2.5,
                       f"{s['ratio_fused_over_transformers']:.2f}x"))
        if lc.get("tokens_per_s"):
            r = med["fused"] / lc["tokens_per_s"]
            checks.append(("vanilla >= 0.6x llama.cpp's decode", r >= 0.6, f"{r:.2f}x ({med['fused']:.1f} vs "
                                                                             f"{lc['tokens_per_s']:.1f} tok/s)"))
        elif lc:
            out.append(f"llama.cpp: {lc.get('skipped')}")
    st = res.get("step")
    if st:
        rows = [[n, _ms(st[n]["step_s"]), f"{st['weight_bytes'] / 1e6:.0f}", f"{st['read_bandwidth_gbs']:.1f}",
                 _ms(st["floor_s"]), f"{st[n]['step_over_floor']:.2f}x"] for n in STEP_RUNTIMES if n in st]
        out += ["", f"One decode step at context {st['context']} vs its memory floor (weight bytes / read bandwidth)",
                format_table(["runtime", "step ms", "weight MB", "read GB/s", "floor ms", "step / floor"], rows)]
        sizes = list(st["fused"]["verify_relative"])
        rows = [[n] + [f"{st[n]['verify_relative'][T]:.2f}" for T in sizes] for n in STEP_RUNTIMES if n in st]
        out += ["", "Verify forward over T tokens, cost relative to T = 1",
                format_table(["runtime"] + [f"T={T}" for T in sizes], rows)]
        if "peak_gflops" in st:
            out += ["", _gflops_line(st)]
        checks.append(("decode step <= 2x its floor", st["fused"]["step_over_floor"] <= 2.0,
                       f"{st['fused']['step_over_floor']:.2f}x"))
        if "8" in st["fused"]["verify_relative"]:
            v8 = st["fused"]["verify_relative"]["8"]
            checks.append(("verify of 8 tokens <= 1.3x a 1-token step", v8 <= 1.3, f"{v8:.2f}x"))
    tr = res.get("trees")
    if tr:
        rows = []
        for r in tr["trees"]:
            t = r["tree"]
            rows.append([f"{t['num_steps']}/{t['topk']}/{t['num_draft_tokens']}", f"{r['draft_over_step']:.2f}",
                         f"{r['verify_over_step']:.2f}", f"{r['draft_over_verify']:.2f}",
                         f"{r['breakeven_accept_length']:.2f}", f"{r['accept_length']:.2f}",
                         f"{r['predicted_speedup']:.2f}x", f"{r['measured_speedup']:.2f}x"])
        out += ["", f"Tree shapes with draft {tr['draft']} ({tr['prompts']} MT-bench prompts, {tr['max_new_tokens']} "
                    f"tokens; per decode step, relative to one vanilla step of {_ms(tr['vanilla_step_s'])} ms)",
                format_table(["steps/topk/tokens", "draft", "verify", "draft/verify", "break-even τ", "τ reached",
                              "τ / break-even", "measured speed-up"], rows)]
        dt = m.get("demo_tree") or [3, 2, 6]
        demo = next((r for r in tr["trees"] if [r["tree"]["num_steps"], r["tree"]["topk"],
                                                r["tree"]["num_draft_tokens"]] == dt), None)
        name = "/".join(map(str, dt))
        if demo:
            checks.append((f"drafting the demo tree ({name}) <= 30% of one verify", demo["draft_over_verify"] <= 0.3,
                           f"{100 * demo['draft_over_verify']:.0f}%"))
            checks.append((f"break-even τ <= 1.4 for the demo tree ({name})", demo["breakeven_accept_length"] <= 1.4,
                           f"{demo['breakeven_accept_length']:.2f}"))
    pr = res.get("profile")
    if pr:
        keys = list(pr)
        phases = [p for p in D.PHASES if any(p in pr[k]["phases_ms"] for k in keys)]
        rows = [[k, _ms(pr[k]["step_ms"] / 1e3)] + [f"{pr[k]['phases_ms'].get(p, 0):.2f}" for p in phases]
                for k in keys]
        out += ["", f"Where a step's time goes (ms per step, torch.profiler; tree "
                    f"{'/'.join(map(str, m.get('demo_tree') or [3, 2, 6]))})",
                format_table(["runtime/step/batch", "step ms"] + phases, rows)]
    cp = res.get("compile")
    if cp:
        out += ["", f"torch.compile of a plain decode step ({cp['mode']}): {_ms(cp['step_s'])} ms per step after "
                    f"{cp['compile_and_warmup_s']:.0f} s of compiling and warm-up, vs {_ms(cp['fused_step_s'])} ms for "
                    f"the fused step ({cp['compiled_over_fused']:.2f}x): "
                    + ("the fused kernels are kept." if cp["compiled_over_fused"] >= 1 else
                       "torch.compile is faster here.")]
    dv = res.get("divergence")
    if dv:
        out += ["", f"{dv['dtype']}: speculative vs vanilla greedy outputs differ on {dv['differ']}/{dv['prompts']} "
                    f"prompts ({dv['per_100']:.1f} per 100, {dv['tokens_each']} tokens each; numerical near-ties)"]
    ct = res.get("contention")
    if ct:
        out += ["", *_contention_lines(ct)]
        checks += _contention_checks(ct)
    if checks:
        out += ["", "Targets", format_table(["target", "met", "measured"],
                                            [[n, "yes" if ok else "NO", v] for n, ok, v in checks])]
    return "\n".join(out)


def _contention_lines(ct) -> list[str]:
    rows = []
    for load, r in ct["loads"].items():
        rows.append([LOAD_TEXT.get(load, load), f"{r['vanilla_tokens_per_s']:.1f}", f"{100 * r['vanilla_share']:.0f}%",
                     f"{r['speculative_tokens_per_s']:.1f}", f"{100 * r['speculative_share']:.0f}%",
                     f"{r['speedup']:.2f}x", _ms(r["verify8_s"]), f"{100 * r['verify8_share']:.0f}%", str(r["threads"]),
                     f"{r['other_cores']:.2f}", f"{r['identical_to_idle']['vanilla']}+"
                                                f"{r['identical_to_idle']['speculative']}/{2 * ct['prompts']}"])
    lines = []
    off = ct.get("idle_governor_on_over_off")
    if off:
        idle = ct["loads"]["idle"]
        lines.append(f"Idle, the governor's own cost (alternated per prompt): vanilla "
                     f"{idle['vanilla_tokens_per_s']:.1f} on vs {idle['vanilla_tokens_per_s_governor_off']:.1f} tok/s "
                     f"off ({off['vanilla']:.3f}x), speculative {idle['speculative_tokens_per_s']:.1f} vs "
                     f"{idle['speculative_tokens_per_s_governor_off']:.1f} ({off['speculative']:.3f}x)")
    return [f"Beside other processes (batch 1, {ct['prompts']} MT-bench prompts, {ct['max_new_tokens']} tokens; "
            f"{ct['cores']} cores; thread governor {'on' if ct['governor'] else 'off'}). share = speed / idle speed; "
            f"others' cores = CPU the other processes took, as the governor read it last (idle: what else ran)",
            format_table(["beside", "vanilla tok/s", "share", "speculative tok/s", "share", "speed-up",
                          "verify(8) ms", "share", "threads", "others' cores", "outputs = idle"], rows), *lines]


def _contention_checks(ct) -> list:
    out = []
    off = ct.get("idle_governor_on_over_off")
    if off:
        worst = min(off.values())
        out.append(("idle speed with the governor within 3% of without", worst >= 0.97, f"{worst:.3f}x"))
    for load, r in ct["loads"].items():
        floor = 0.45 if load == "loop" else 0.25
        if load == "idle":
            continue
        worst = min(r["vanilla_share"], r["speculative_share"])
        out.append((f"beside {LOAD_TEXT.get(load, load)}: vanilla and speculative keep >= {floor:.0%} of idle",
                    worst >= floor, f"{100 * r['vanilla_share']:.0f}% / {100 * r['speculative_share']:.0f}%"))
    return out


def _gflops_line(st) -> str:
    """Achieved GFLOP/s of the widest verify measured (8 tokens where measured) per runtime, against the peak."""
    T = "8" if "8" in st["fused"]["verify_gflops"] else list(st["fused"]["verify_gflops"])[-1]
    per = ", ".join(f"{n} ({st[n].get('few_row_kernel') or 'PyTorch'}) {st[n]['verify_gflops'][T]:.0f}"
                    for n in STEP_RUNTIMES if n in st and "verify_gflops" in st[n])
    return (f"{T}-token verify ({st['forward_flops'][T] / 1e9:.2f} GFLOP), achieved GFLOP/s: {per}; this host's "
            f"measured peak {st['peak_gflops']:.0f} GFLOP/s ({st.get('peak_note', 'fp32 matmul')})")


def plot(res, path):
    ct = res.get("contention")
    fig, axes = subplots(1, 4 if ct else 3, figsize=(21 if ct else 16, 4.2))
    if ct:
        loads = list(ct["loads"])
        x = list(range(len(loads)))
        for j, (key, label) in enumerate((("vanilla_share", "vanilla"), ("speculative_share", "speculative"),
                                          ("verify8_share", "8-token verify"))):
            axes[3].bar([i + (j - 1) * 0.27 for i in x], [100 * ct["loads"][k][key] for k in loads], 0.27, label=label)
        axes[3].axhline(50, color="grey", lw=0.8, ls="--")
        axes[3].set_xticks(x, loads)
        axes[3].set(ylabel="% of idle speed", title="Beside other busy processes")
        axes[3].legend()
    s = res.get("speed")
    if s:
        names = ["transformers", "eager", "fused"]
        vals = [s["median_tokens_per_s"][n] for n in names]
        if (res.get("llamacpp") or {}).get("tokens_per_s"):
            names.append("llama.cpp")
            vals.append(res["llamacpp"]["tokens_per_s"])
        axes[0].bar(names, vals)
        axes[0].set(ylabel="tokens/s (median)", title="Vanilla decode, batch 1")
    st = res.get("step")
    if st:
        for n in (n for n in STEP_RUNTIMES if n in st):
            sizes = [int(T) for T in st[n]["verify_relative"]]
            axes[1].plot(sizes, list(st[n]["verify_relative"].values()), marker="o", label=n)
        axes[1].set(xscale="log", xlabel="tokens in the verify forward", ylabel="cost / one-token forward",
                    title="Verify cost vs tree size")
        axes[1].legend()
    tr = res.get("trees")
    if tr:
        labels = [f"{r['tree']['num_steps']}/{r['tree']['topk']}/{r['tree']['num_draft_tokens']}" for r in tr["trees"]]
        x = list(range(len(labels)))
        axes[2].bar([i - 0.2 for i in x], [r["breakeven_accept_length"] for r in tr["trees"]], 0.4,
                    label="break-even τ")
        axes[2].bar([i + 0.2 for i in x], [r["accept_length"] for r in tr["trees"]], 0.4, label="τ reached")
        axes[2].set_xticks(x, labels)
        axes[2].set(xlabel="num_steps/topk/num_draft_tokens", ylabel="tokens per target forward",
                    title="Break-even vs reached acceptance")
        axes[2].legend()
    save_figure(fig, path)

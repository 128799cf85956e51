"""`eagle3 check-draft`: will this EAGLE-3 draft folder load and run correctly next to this target?

Reads any supported layout (ours/SGLang, SpecForge exports, the released yuhuili/EAGLE3-* layout,
vLLM's speculators layout) through `formats`, then checks names, shapes, dtypes, the d2t/t2d vocabulary
map, and the config against the target's config.json. `check_draft(draft_dir, target)` returns the
findings so the launcher (or an SGLang plugin) can refuse a bad draft before a GPU is touched.

The checks against the target live in `check_target`; the findings and their severities in `findings`
(ERROR = SGLang/vLLM would fail to load it or would silently run wrong numbers; WARN = it runs, but something
deserves a look).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

import torch

from sglang_eagle3.errors import UserError
from sglang_eagle3.formats import files, layouts, speculators
from sglang_eagle3.formats.check_target import check_aux_ids, eagle_config, target_findings
from sglang_eagle3.formats.files import TargetError, load_target_config
from sglang_eagle3.formats.findings import ERROR, OK, WARN, Finding, Report, format_table, has_errors, positive_int
from sglang_eagle3.models.config import ConfigError, Eagle3Config, check_draft_folder, folder_kind, rope_settings

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "draft_vocab_size",
                 "num_hidden_layers")
OPTIONAL_INT_KEYS = ("num_key_value_heads", "head_dim", "target_hidden_size")


def _check_config(r: Report, c: dict, keys: dict, fmt: str) -> bool:
    """Config-only checks; returns True when the keys that shapes depend on are usable."""
    where = lambda k: keys.get(k, k)  # noqa: E731
    missing = [k for k in REQUIRED_KEYS if c.get(k) is None]
    if fmt != "speculators" and not c.get("architectures"):
        missing.append("architectures")
    for k in missing:
        why = {"num_hidden_layers": " (transformers' LlamaConfig then defaults to 32 layers and SGLang would "
                                    "build 31 extra layers with random weights)",
               "draft_vocab_size": " (SGLang's LlamaForCausalLMEagle3 reads config.draft_vocab_size and "
                                   "fails without it)",
               "architectures": " (SGLang picks the model class from it)"}.get(k, "")
        r.add(ERROR, "config keys", f"missing config key {where(k)}{why}")
    bad = [k for k in REQUIRED_KEYS if k not in missing and not positive_int(c[k])]
    bad += [k for k in OPTIONAL_INT_KEYS if c.get(k) is not None and not positive_int(c[k])]
    for k in bad:
        r.add(ERROR, "config keys", f"{where(k)}={c[k]!r} is not a positive integer")
    if not missing and not bad:
        r.add(OK, "config keys", "all required keys present")
        _check_loaders(r, c)
    arch = layouts.first_architecture(c)
    if fmt == "sglang" and arch:
        r.add(OK, "architectures", f"{arch} (SGLang's EAGLE-3 draft class)")
    elif fmt == "eagle-official":
        r.add(WARN, "architectures", f"{arch}: the released EAGLE-3 layout; SGLang versions whose ModelConfig "
                                     "remaps a draft's LlamaForCausalLM load it as LlamaForCausalLMEagle3, others "
                                     "need that name (`eagle3 import` writes it)")
        for flag in ("fc_norm", "norm_output"):
            if c.get(flag):
                r.add(ERROR, flag, f"{flag}=true (EAGLE-3.1): the authors' EAGLE-3 code cannot run it and ignores "
                                   "the flag; serve it in SGLang or vLLM instead")
    if c.get("num_hidden_layers") not in (None, 1) and "num_hidden_layers" not in bad:
        r.add(ERROR, "num_hidden_layers", f"{where('num_hidden_layers')}={c['num_hidden_layers']}: an EAGLE-3 draft "
                                          "has exactly one decoder layer")
    elif c.get("num_hidden_layers") == 1:
        r.add(OK, "num_hidden_layers", "1")
    if c.get("hidden_act", "silu") != "silu":
        r.add(ERROR, "hidden_act", f"{where('hidden_act')}={c['hidden_act']!r}; the draft layer is SiLU-gated")
    if c.get("model_type", "llama") != "llama":
        r.add(WARN, "model_type", f"{where('model_type')}={c['model_type']!r}, expected 'llama'")
    if c.get("rms_norm_eps") is None:
        r.add(WARN, "rms_norm_eps", f"missing config key {where('rms_norm_eps')}: loaders fall back to "
                                    "LlamaConfig's 1e-6, which may not be what the draft was trained with")
    heads, kv = c.get("num_attention_heads"), c.get("num_key_value_heads") or c.get("num_attention_heads")
    if positive_int(heads) and positive_int(kv) and heads % kv:
        r.add(ERROR, "attention heads", f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    V, Vd = c.get("vocab_size"), c.get("draft_vocab_size")
    if positive_int(V) and positive_int(Vd) and Vd > V:
        r.add(ERROR, "draft_vocab_size", f"{where('draft_vocab_size')}={Vd} exceeds {where('vocab_size')}={V}")
    if c.get("eagle_config") is not None and not isinstance(c["eagle_config"], dict):
        r.add(ERROR, "eagle_config", f"eagle_config={c['eagle_config']!r} is not an object")
    if eagle_config(c).get("use_aux_hidden_state") is False:
        r.add(ERROR, "eagle_config", "eagle_config.use_aux_hidden_state=false: the draft would not read the "
                                     "target's low/mid/high features (that is EAGLE-1/2, not EAGLE-3)")
    tie = c.get("tie_word_embeddings", False)
    if tie:
        r.add(ERROR, "tie_word_embeddings", f"{where('tie_word_embeddings')}=true: SGLang then uses the target "
              "embedding as the draft's lm_head and ignores lm_head.weight; set it to false")
    else:
        r.add(OK, "tie_word_embeddings", "false: the draft's own lm_head.weight is used")
    return not missing and not bad


def _check_loaders(r: Report, c: dict) -> None:
    """The attention shape and RoPE as the loaders check them: the draft config's own checks and transformers'
    LlamaConfig (SGLang and vLLM read a draft's config.json with it; our RoPE is built through it)."""
    heads = c["num_attention_heads"]
    try:
        Eagle3Config(hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"], num_attention_heads=heads,
                     num_key_value_heads=heads, head_dim=c.get("head_dim"), vocab_size=c["vocab_size"],   # kv: above
                     draft_vocab_size=1, target_hidden_size=c["hidden_size"], aux_layer_ids=[0],
                     max_position_embeddings=c.get("max_position_embeddings") or 8192,
                     **rope_settings(c, "config.json")).llama_config("config.json")
    except ConfigError as e:
        r.add(ERROR, "loaders", str(e).removeprefix("config.json: "))
        return
    r.add(OK, "loaders", "transformers' LlamaConfig accepts the attention shape and RoPE")


def expected_shapes(c: dict) -> dict[str, tuple]:
    H, I, nH, V = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["vocab_size"]
    nKV = c.get("num_key_value_heads") or nH
    D = c.get("head_dim") or H // nH
    Ht = c.get("target_hidden_size") or H
    m = "midlayer."
    return {
        "fc.weight": (H, 3 * Ht),                       # SGLang and vLLM build fc for exactly 3 target layers
        m + "hidden_norm.weight": (H,), m + "input_layernorm.weight": (H,),
        m + "self_attn.q_proj.weight": (nH * D, 2 * H), m + "self_attn.k_proj.weight": (nKV * D, 2 * H),
        m + "self_attn.v_proj.weight": (nKV * D, 2 * H), m + "self_attn.o_proj.weight": (H, nH * D),
        m + "post_attention_layernorm.weight": (H,),
        m + "mlp.gate_proj.weight": (I, H), m + "mlp.up_proj.weight": (I, H), m + "mlp.down_proj.weight": (H, I),
        "norm.weight": (H,), "lm_head.weight": (c["draft_vocab_size"], H),
        "d2t": (c["draft_vocab_size"],), "t2d": (V,),
        **{f"fc_norm.{i}.weight": (Ht,) for i in range(3 if _fc_norm(c) else 0)},    # EAGLE-3.1
    }


def _fc_norm(c: dict) -> bool:
    return bool(c.get("fc_norm") or c.get("use_aux_norm"))


def _check_tensors(r: Report, c: dict, tensors: dict, names: dict, variant: set, torch_dtype) -> None:
    name = lambda k: names.get(k, k)  # noqa: E731
    expected = expected_shapes(c)
    optional = {"embed_tokens.weight": (c["vocab_size"], c["hidden_size"])}
    missing = [k for k in expected if k not in tensors and k not in ("d2t", "t2d")]
    extra = [k for k in tensors if k not in expected and k not in optional and names.get(k, k) not in variant]
    for k in missing:
        r.add(ERROR, "tensor names", f"missing tensor {name(k)} (expected shape {list(expected[k])})")
    for k in extra:
        r.add(ERROR, "tensor names", f"unexpected tensor {name(k)} {list(tensors[k].shape)}: no loader slot for it "
                                     "(SGLang skips it silently, vLLM refuses)")
    if not missing and not extra:
        r.add(OK, "tensor names", f"{len(tensors)} tensors, none missing or unexpected")
    shape_errors = 0
    for k, shape in {**expected, **optional}.items():
        if k in tensors and tuple(tensors[k].shape) != shape:
            shape_errors += 1
            r.add(ERROR, "tensor shapes", f"tensor {name(k)} has shape {list(tensors[k].shape)}, config.json implies "
                                          f"{list(shape)} (hidden_size={c['hidden_size']}, "
                                          f"intermediate_size={c['intermediate_size']}, vocab_size={c['vocab_size']}, "
                                          f"draft_vocab_size={c['draft_vocab_size']})")
    if not shape_errors:
        r.add(OK, "tensor shapes", "every tensor matches config.json")
    if "embed_tokens.weight" in tensors:
        r.add(OK, "embed_tokens", f"{name('embed_tokens.weight')} present; SGLang and this toolkit use the "
                                  "target's embedding instead")
    _check_dtypes(r, tensors, name, torch_dtype)
    _check_trained(r, tensors)


def _check_trained(r: Report, tensors: dict) -> None:
    """A freshly initialised draft (init-draft, or an export of step 0) serves at acceptance length ~1."""
    norms = [v for k, v in tensors.items() if k.endswith("norm.weight") and v.is_floating_point()]
    if norms and all(bool((v.float() == 1).all()) for v in norms):
        r.add(WARN, "trained", f"all {len(norms)} RMSNorm weights are exactly 1, their initial value: this draft "
                               "looks untrained (random weights accept ~nothing)")


def _check_dtypes(r: Report, tensors: dict, name, torch_dtype) -> None:
    floats: dict[torch.dtype, int] = {}
    ok = True
    for k, t in tensors.items():
        if k in ("d2t", "t2d"):
            continue
        if t.dtype not in FLOAT_DTYPES:
            ok = False
            r.add(ERROR, "dtype", f"tensor {name(k)} is {str(t.dtype).replace('torch.', '')}; draft weights must be "
                                  "float16, bfloat16 or float32")
            continue
        floats[t.dtype] = floats.get(t.dtype, 0) + 1
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            ok = False
            r.add(ERROR, "finite values", f"tensor {name(k)} has {bad} NaN/Inf values (never trained or loaded?)")
    names_of = {str(d).replace("torch.", ""): n for d, n in floats.items()}
    if len(floats) > 1:
        r.add(WARN, "dtype", f"mixed float dtypes {names_of}; loaders cast to one dtype")
    elif floats and torch_dtype and names_of and next(iter(names_of)) != str(torch_dtype):
        r.add(WARN, "dtype", f"config torch_dtype={torch_dtype} but the weights are {next(iter(names_of))}")
    elif ok and floats:
        r.add(OK, "dtype", f"weights are {next(iter(names_of))}")


def _check_vocab_map(r: Report, c: dict, tensors: dict, names: dict) -> None:
    V, Vd = c["vocab_size"], c["draft_vocab_size"]
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    dn, tn = names.get("d2t", "d2t"), names.get("t2d", "t2d")
    ids = None
    if d2t is None:
        if Vd == V:
            r.add(WARN, "d2t", "absent: draft vocabulary = target vocabulary, identity map assumed (SGLang and "
                               "vLLM do the same); `eagle3 import` writes it explicitly")
        else:
            r.add(ERROR, "d2t", f"missing tensor d2t: draft_vocab_size={Vd} < vocab_size={V} needs the "
                                "draft->target token map (SGLang would treat draft ids as target ids)")
    elif d2t.is_floating_point() or d2t.dtype == torch.bool:
        r.add(ERROR, "d2t", f"tensor {dn} is {d2t.dtype}; expected int64 offsets (target = draft + d2t[draft])")
    elif d2t.shape == (Vd,):
        if d2t.dtype != torch.int64:
            r.add(WARN, "d2t", f"tensor {dn} is {d2t.dtype}, expected int64 (loaders widen it)")
        ids = torch.arange(Vd) + d2t.long()
        out = ((ids < 0) | (ids >= V)).nonzero().flatten()
        uniq, counts = ids.unique(return_counts=True)
        if len(out):
            i = int(out[0])
            r.add(ERROR, "d2t", f"{dn} maps {len(out)} draft ids outside the target vocabulary [0, {V}), e.g. draft id "
                                f"{i} -> {int(ids[i])} (d2t[{i}]={int(d2t[i])})")
            ids = None
        elif (counts > 1).any():
            dup = int(uniq[counts > 1][0])
            who = (ids == dup).nonzero().flatten().tolist()[:4]
            r.add(ERROR, "d2t", f"{dn} maps several draft ids {who} to the same target id {dup} "
                                f"({int((counts > 1).sum())} duplicated target ids)")
            ids = None
        else:
            r.add(OK, "d2t", f"{Vd} draft ids map to distinct target ids in [0, {V})")
    if t2d is None:
        if d2t is not None:
            r.add(WARN, "t2d", "absent: SGLang and vLLM never read t2d, but this toolkit's loader does; "
                               "`eagle3 import` rebuilds it from d2t")
        return
    if t2d.is_floating_point():
        r.add(ERROR, "t2d", f"tensor {tn} is {t2d.dtype}; expected bool")
        return
    if t2d.shape != (V,):
        return                                   # reported by the shape check
    if t2d.dtype != torch.bool:
        if ((t2d != 0) & (t2d != 1)).any():
            r.add(ERROR, "t2d", f"tensor {tn} ({t2d.dtype}) holds values other than 0/1; expected a bool mask")
            return
        r.add(WARN, "t2d", f"tensor {tn} is {t2d.dtype}, expected bool")
    mask = t2d.bool()
    marked = int(mask.sum())
    if marked != Vd:
        r.add(ERROR, "t2d", f"{tn} marks {marked} target tokens but draft_vocab_size={Vd}")
    elif ids is not None:
        from_d2t = torch.zeros(V, dtype=torch.bool)
        from_d2t[ids] = True
        diff = (from_d2t != mask).nonzero().flatten()
        if len(diff):
            x = int(diff[0])
            side = (f"d2t maps draft id {int((ids == x).nonzero()[0])} to it" if from_d2t[x]
                    else "no draft id maps to it")
            r.add(ERROR, "t2d", f"{tn} disagrees with {dn} on {len(diff)} target ids, e.g. target id {x}: "
                                f"t2d[{x}]={bool(mask[x])} but {side}")
        else:
            r.add(OK, "t2d", f"marks exactly the {Vd} target ids d2t maps to")
    else:
        r.add(OK, "t2d", f"marks {Vd} target tokens")


def check_draft(draft_dir: str, target=None) -> list[Finding]:
    """Validate an EAGLE-3 draft folder, optionally against a target (folder, hub id or config)."""
    r = Report()
    if not os.path.isdir(draft_dir):
        r.add(ERROR, "folder", f"{draft_dir}: not a directory")
        return r.findings
    kind, what = folder_kind(draft_dir)
    if kind == "target":
        r.add(ERROR, "format", f"{draft_dir} is a target model folder ({what}), not an EAGLE-3 draft")
        return r.findings
    raw = None
    try:
        raw = files.read_config(draft_dir)
    except files.FolderError as e:
        r.add(ERROR, "config.json", str(e))
    detected = layouts.detect_format(raw) if raw is not None else None
    if raw is not None and detected is None:
        r.add(ERROR, "format", f"architectures={raw.get('architectures')!r} and no speculators_config: not a known "
                               "EAGLE-3 draft layout (expected LlamaForCausalLMEagle3, LlamaForCausalLM or "
                               "speculators)")
    fmt = detected or "sglang"
    lay = layouts.layout(fmt)
    c = keys = None
    if raw is not None:
        c, keys, notes = lay.config_to_ours(raw)
        for status, check, detail in notes:
            r.add(status, check, detail)
    tensors = names = None
    try:
        state, weight_files = files.read_weights(draft_dir)
        tensors, names, notes = lay.tensors_to_ours(state)
        for status, check, detail in notes:
            r.add(status, check, detail)
        if detected:
            r.findings.insert(0, Finding("format", OK, f"{detected} layout, weights in {', '.join(weight_files)}"))
    except files.FolderError as e:
        r.add(ERROR, "weights", str(e))
    top = tc = None
    if target is not None:
        try:
            top, tc = load_target_config(target)
        except TargetError as e:
            r.add(ERROR, "target", str(e))
    else:
        r.add(WARN, "target", "no target given: vocabulary, hidden size and layer range were not checked against it")
    if c is None:
        return r.findings
    usable = _check_config(r, c, keys, detected)
    if usable and tensors is not None:
        variant = speculators.variant_tensors(raw) if fmt == "speculators" else set()
        names = {**{k: lay.file_name(k) for k in expected_shapes(c)}, **names}
        _check_tensors(r, c, tensors, names, variant, c.get("torch_dtype"))
        _check_vocab_map(r, c, tensors, names)
        if fmt == "eagle-official" and "embed_tokens.weight" not in tensors:
            r.add(ERROR, "embed_tokens", "no embed_tokens.weight: the authors' EAGLE-3 code loads this layout with "
                                         "strict=False and keeps a random embedding, so the draft runs at a much "
                                         "lower acceptance without an error (re-export with --target)")
    if tc is not None:
        target_findings(r, c, keys, tensors or {}, fmt, raw, top, tc)
    else:
        check_aux_ids(r, c, keys, None)
    return r.findings


def _cli(args) -> int:
    from sglang_eagle3.formats.gguf_file import gguf_draft_file, gguf_findings
    gguf = gguf_draft_file(args.draft)
    if gguf is not None:                        # an `export --format gguf` folder, or its draft.gguf
        findings = gguf_findings(gguf, args.target)
    elif os.path.isfile(args.draft):
        raise UserError(f"--draft {args.draft} is a file; expected a draft folder or a GGUF draft file")
    elif not os.path.isdir(args.draft):
        raise UserError(f"--draft {args.draft}: no such folder")
    else:
        check_draft_folder(args.draft, "--draft")
        findings = check_draft(args.draft, args.target)
    bad = has_errors(findings)
    if args.json:
        print(json.dumps({"draft": args.draft, "target": args.target, "ok": not bad,
                          "findings": [asdict(f) for f in findings]}, indent=2))
    else:
        print(format_table(findings))
        n = {s: sum(f.status == s for f in findings) for s in (OK, WARN, ERROR)}
        print(f"\n{'FAIL' if bad else 'PASS'}: {n[OK]} OK, {n[WARN]} WARN, {n[ERROR]} ERROR", file=sys.stderr)
    return 1 if bad else 0


def add_cli(sub) -> None:
    p = sub.add_parser("check-draft", help="validate an EAGLE-3 draft folder (ours/SGLang, SpecForge, official "
                                           "EAGLE-3, speculators) against its target")
    p.add_argument("--draft", required=True, help="draft folder, or a GGUF draft (`export --format gguf`'s folder or "
                                                  "its draft.gguf: its metadata only)")
    p.add_argument("--target", default=None, help="target HF folder or hub id (only its config.json is read)")
    p.add_argument("--json", action="store_true", help="print findings as JSON")
    p.set_defaults(func=_cli)

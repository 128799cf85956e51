"""`eagle3 export` and `eagle3 import`: convert draft folders between layouts (atomic, validated)."""
from __future__ import annotations

import os
import sys

from sglang_eagle3.errors import UserError, check_at_least, flags_of
from sglang_eagle3.fileio import check_apart
from sglang_eagle3.formats.convert import FolderError, export_draft, import_draft
from sglang_eagle3.formats.files import check_out
from sglang_eagle3.formats.layouts import FORMATS, FormatError
from sglang_eagle3.models.config import check_draft_folder


def _report(out: str, fmt: str, findings, notes) -> None:
    from sglang_eagle3.formats.check_draft import WARN
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    for f in findings:
        if f.status == WARN:
            print(f"warning: {f.check}: {f.detail}", file=sys.stderr)
    n_warn = sum(f.status == WARN for f in findings)
    print(f"wrote {out} ({fmt} layout; check-draft passed with {n_warn} warning(s))")


def _run(fn, *args, **kwargs):
    from sglang_eagle3.formats.files import TargetError
    try:
        return fn(*args, **kwargs)
    except (FolderError, FormatError, TargetError, FileExistsError) as e:
        raise UserError(str(e)) from None


def check_source(path: str, flag: str) -> None:
    """The folder a conversion reads: it exists and is a draft's, not a target model's."""
    if not os.path.isdir(path):
        raise UserError(f"{flag} {path}: no such folder")
    check_draft_folder(path, flag)


def check_export_args(args) -> None:
    """Every flag of `eagle3 export` and the folders it names, before anything is read or converted."""
    check_apart({"--out": args.out}, {"--draft": args.draft, "--target": args.target})
    check_source(args.draft, "--draft")
    if args.format in ("eagle-official", "gguf") and not args.target:
        raise UserError(f"--format {args.format} needs --target: " + (
            "the authors' loader reads the token embedding from the draft, so the export writes the target's"
            if args.format == "eagle-official" else "llama.cpp's converter reads the target's config and tokenizer"))
    if args.speculative_tokens is not None:
        if args.format != "speculators":
            raise UserError(f"--speculative-tokens is a speculators setting (vLLM's draft length); --format "
                            f"{args.format} has no place for it")
        check_at_least(1, flags_of(args, "speculative_tokens"))
    if args.format != "gguf":
        check_out(args.out, args.force)
    elif os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UserError(f"--out {args.out} is a file, not a folder (gguf writes draft.gguf and target.gguf into it)")


def _export(args) -> int:
    check_export_args(args)
    if args.format == "gguf":
        from sglang_eagle3.formats.gguf import GGUFExportError, export_gguf
        try:
            summary = export_gguf(args.draft, args.target, args.out, overwrite=args.force)
        except GGUFExportError as e:
            raise UserError(str(e)) from None
        print(f"wrote {summary['files'][0]} (eagle3, target_layers {summary['llamacpp_target_layers']} = inputs of "
              f"those layers, our ids {summary['our_layer_ids']}) and {summary['files'][1]}")
        return 0
    findings, notes = _run(export_draft, args.draft, args.format, args.out, target=args.target,
                           speculative_tokens=args.speculative_tokens or 3, overwrite=args.force)
    _report(args.out, args.format, findings, notes)
    return 0


def _import(args) -> int:
    check_apart({"--out": args.out}, {"--src": args.src, "--target": args.target})
    check_source(args.src, "--src")
    check_out(args.out, args.force)
    findings, notes = _run(import_draft, args.src, args.out, fmt=args.format, target=args.target,
                           overwrite=args.force)
    _report(args.out, "sglang", findings, notes)
    return 0


def add_cli(sub) -> None:
    p = sub.add_parser("export", help="write a draft in another layout (sglang, eagle-official, speculators)")
    p.add_argument("--draft", required=True, help="draft folder (any supported layout)")
    p.add_argument("--format", required=True, choices=FORMATS + ("gguf",),
                   help="gguf: llama.cpp's draft.gguf (eagle3) and target.gguf, by the pinned llama.cpp's converter")
    p.add_argument("--out", required=True, help="output folder (written atomically)")
    p.add_argument("--target", default=None, help="target HF folder or hub id: validates the result and fills "
                                                   "speculators_config.verifier")
    p.add_argument("--speculative-tokens", type=int, default=None,
                   help="speculators only: proposal_methods[0].speculative_tokens, vLLM's default draft length "
                        "(default 3)")
    p.add_argument("--force", action="store_true", help="write into an existing --out: its config.json and weights "
                                                        "(gguf: draft.gguf, target.gguf) are replaced, its other "
                                                        "files kept")
    p.set_defaults(func=_export)

    p = sub.add_parser("import", help="convert a draft (official EAGLE-3, SpecForge, speculators) into ours")
    p.add_argument("--src", required=True, help="draft folder to convert")
    p.add_argument("--format", default="auto", choices=("auto",) + FORMATS)
    p.add_argument("--out", required=True, help="output folder (written atomically)")
    p.add_argument("--target", default=None, help="target HF folder or hub id: validates the result and supplies "
                                                  "default aux layer ids when the source has none")
    p.add_argument("--force", action="store_true", help="write into an existing --out: its config.json and weights "
                                                        "are replaced, its other files kept")
    p.set_defaults(func=_import)

"""Loading what an engine decodes with: the target runtime, the draft folder, and the engine built from them."""
from __future__ import annotations

import os
from typing import Optional

from sglang_eagle3.engine.engine import SpeculativeEngine
from sglang_eagle3.engine.profile import SpecProfile
from sglang_eagle3.engine.settings import DTYPES, Settings, resolve_dtype
from sglang_eagle3.engine.speculation import Drafting, SpecConfig
from sglang_eagle3.errors import UserError
from sglang_eagle3.models.config import check_draft_folder
from sglang_eagle3.models.draft import CheckpointError, Eagle3DraftModel
from sglang_eagle3.models.target import TargetModel
from sglang_eagle3.models.testbed import resolve_target


def load_draft(path: str, dtype, device="cpu") -> Eagle3DraftModel:
    """A draft folder for the engine; unreadable files and invalid configs become one-line errors."""
    if not os.path.isdir(path):
        raise UserError(f"--draft {path}: no such folder")
    check_draft_folder(path, "--draft")
    try:
        return Eagle3DraftModel.from_pretrained(path, dtype=dtype, device=device)
    except (TypeError, ValueError, KeyError) as e:
        if isinstance(e, (CheckpointError, UserError)):
            raise
        raise UserError(f"--draft {path}: config.json is not a valid EAGLE-3 draft config ({type(e).__name__}: "
                        f"{e})") from None


def load_engine(target: Optional[str], draft: Optional[str], spec: Optional[SpecConfig] = None, dtype: str = "auto",
                device: str = "cpu", profile: Optional[SpecProfile] = None,
                drafting: Optional[Drafting] = None) -> SpeculativeEngine:
    """The target (a folder, hub id or 'testbed') and the draft (a folder, None or 'none': vanilla) in one engine."""
    dtype = resolve_dtype(dtype, device)
    target_path = resolve_target(target)
    draft_model = load_draft(draft, DTYPES[dtype], device) if draft and draft != "none" else None
    aux = draft_model.config.aux_layer_ids if draft_model is not None else None
    tm = TargetModel.from_pretrained(target_path, dtype=DTYPES[dtype], device=device, aux_layer_ids=aux)
    return SpeculativeEngine(tm, draft_model, spec, profile, drafting)


def engine_from_settings(target: Optional[str], settings: Settings, device: str = "cpu") -> SpeculativeEngine:
    """An engine that decodes what resolve_settings decided (its dtype, draft, tree and adaptive table)."""
    return load_engine(target, settings.draft, settings.engine_tree, settings.dtype, device, settings.profile,
                       settings.drafting)

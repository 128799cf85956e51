"""Loading what an engine decodes with: the target runtime, the draft folder, and the engine built from them."""
from __future__ import annotations

import os
from typing import Optional

from sglang_eagle3.engine.engine import SpeculativeEngine
from sglang_eagle3.engine.settings import DTYPES, Settings
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


def load_engine(target: Optional[str], settings: Settings) -> SpeculativeEngine:
    """The target (a folder, hub id or 'testbed') and settings.draft (None: vanilla) in one engine that decodes what
    resolve_settings decided: loaded in its dtype on its device, with its tree, adaptive table and drafting."""
    dtype, device = DTYPES[settings.dtype], settings.device
    target_path = resolve_target(target)
    draft_model = load_draft(settings.draft, dtype, device) if settings.draft else None
    aux = draft_model.config.aux_layer_ids if draft_model is not None else None
    tm = TargetModel.from_pretrained(target_path, dtype=dtype, device=device, aux_layer_ids=aux)
    return SpeculativeEngine(tm, draft_model, settings)

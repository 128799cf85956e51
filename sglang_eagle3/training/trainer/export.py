"""Export a draft from a training checkpoint (not only from the end of a run): learning curves, early stops.

    python -m sglang_eagle3.training.trainer.export RUN/checkpoints/step_0000500 OUT
"""
from __future__ import annotations

import json
import os
import sys

import torch

from sglang_eagle3.errors import debug_enabled, report, user_errors
from sglang_eagle3.models.config import Eagle3Config
from sglang_eagle3.models.draft import CheckpointError, Eagle3DraftModel
from sglang_eagle3.training.trainer.run_folder import STATE_FILE


def checkpoint_state(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """The draft's tensors from a plain-PyTorch (state.pt) or DeepSpeed (engine/*model_states.pt) checkpoint."""
    path = os.path.join(ckpt_dir, "state.pt")
    if os.path.isfile(path):
        model = torch.load(path, map_location="cpu", weights_only=False)["model"]
    else:
        engine = os.path.join(ckpt_dir, "engine")
        files = sorted(f for f in os.listdir(engine) if f.endswith("model_states.pt")) if os.path.isdir(engine) else []
        if not files:
            raise CheckpointError(f"{ckpt_dir}: neither state.pt nor a DeepSpeed engine/*model_states.pt")
        model = torch.load(os.path.join(engine, files[0]), map_location="cpu", weights_only=False)["module"]
    return {k[len("draft."):]: v for k, v in model.items() if k.startswith("draft.")}


def export_checkpoint(ckpt_dir: str, out: str) -> dict:
    """Write the checkpoint's draft as a SGLang-layout folder (bf16); returns the checkpoint's trainer state."""
    if not os.path.isfile(os.path.join(ckpt_dir, STATE_FILE)):
        raise CheckpointError(f"{ckpt_dir}: not a training checkpoint (no {STATE_FILE}; RUN/checkpoints/step_N is)")
    with open(os.path.join(ckpt_dir, STATE_FILE)) as f:
        state = json.load(f)
    draft = Eagle3DraftModel(Eagle3Config.from_dict(state["draft_config"], where=os.path.join(ckpt_dir, STATE_FILE)))
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in checkpoint_state(ckpt_dir).items()})
    draft.save_pretrained(out, dtype=torch.bfloat16)
    return state


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    try:
        st = export_checkpoint(*args)
    except user_errors() as e:
        if debug_enabled():
            raise
        return report("export", e)
    print(f"{args[1]} (step {st['step']}, {st.get('tokens_seen', 0):,} training tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

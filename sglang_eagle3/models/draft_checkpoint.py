"""A draft checkpoint on disk: writing it, reading and checking its tensors, and the checks an engine makes
when it loads one (finite weights, a consistent d2t/t2d map, a target it fits). `Eagle3DraftModel`'s
save_pretrained / from_pretrained / check_runtime / check_target call these.
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from sglang_eagle3.errors import UserError
from sglang_eagle3.fileio import usual_permissions


class CheckpointError(UserError, ValueError):
    """A draft checkpoint that does not match what it claims to be; the message names the tensor."""


def save_draft(model, directory: str, dtype: Optional[torch.dtype] = None) -> None:
    """model.safetensors (atomically) and config.json; floating tensors cast to dtype when given."""
    from safetensors.torch import save_file
    os.makedirs(directory, exist_ok=True)
    state = {}
    for k, v in model.state_dict().items():
        v = v.detach().cpu()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        state[k] = v.contiguous()
    cfg = model.config
    cfg.torch_dtype = str(dtype or model.fc.weight.dtype).replace("torch.", "")
    tmp = os.path.join(directory, "model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    usual_permissions(tmp)                        # safetensors writes 0600
    os.replace(tmp, os.path.join(directory, "model.safetensors"))
    cfg.save(directory)


def check_runtime(model) -> None:
    """The cheap checks check-draft makes, run when an engine loads the draft: finite weights and a
    consistent vocabulary map (a broken one would serve at acceptance length ~1 without a word)."""
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise CheckpointError(f"draft tensor {name} holds NaN or inf values")
    V, Vd = model.config.vocab_size, model.config.draft_vocab_size
    ids = torch.arange(Vd, device=model.d2t.device) + model.d2t
    if int(ids.min()) < 0 or int(ids.max()) >= V:
        raise CheckpointError(f"draft d2t maps draft ids outside the target vocabulary [0, {V})")
    if ids.unique().numel() != Vd:
        raise CheckpointError("draft d2t maps two draft ids to the same target token")
    if int(model.t2d.sum()) != Vd or not bool(model.t2d[ids].all()):
        raise CheckpointError("draft t2d does not mark exactly the target ids d2t maps to (d2t/t2d disagree: "
                              "a shifted or rebuilt vocabulary map)")


def check_target(model, target_config, aux_layer_ids: Optional[list[int]] = None) -> None:
    """Refuse a draft that cannot work with this target (vocab, hidden size, layer ids)."""
    tc = getattr(target_config, "text_config", target_config)
    c = model.config
    if c.vocab_size != tc.vocab_size:
        raise CheckpointError(f"draft vocab_size={c.vocab_size} but target vocab_size={tc.vocab_size} "
                              f"(t2d has {model.t2d.numel()} entries)")
    if c.target_hidden_size != tc.hidden_size:
        raise CheckpointError(f"draft target_hidden_size={c.target_hidden_size} (fc.weight "
                              f"{tuple(model.fc.weight.shape)}) but target hidden_size={tc.hidden_size}")
    if c.hidden_size != tc.hidden_size:
        raise CheckpointError(f"draft hidden_size={c.hidden_size} but the target's embedding is "
                              f"[{tc.vocab_size}, {tc.hidden_size}]; the draft reuses the target embedding")
    bad = [i for i in c.aux_layer_ids if not 0 <= i < tc.num_hidden_layers]
    if bad:   # id i = HF output_hidden_states[i + 1]; L - 1 (final normed state) only for the 'top' ablation
        raise CheckpointError(f"draft eagle_aux_hidden_state_layer_ids={c.aux_layer_ids} has ids {bad} outside "
                              f"0..{tc.num_hidden_layers - 1} for the target's {tc.num_hidden_layers} layers")
    if aux_layer_ids is not None and list(aux_layer_ids) != list(c.aux_layer_ids):
        raise CheckpointError(f"draft was trained on aux layers {c.aux_layer_ids} but the target runtime "
                              f"captures {list(aux_layer_ids)}")


def load_draft_state(directory: str, expected: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Read model.safetensors (or sharded *.safetensors) and check names and shapes against `expected`."""
    from safetensors.torch import load_file
    state: dict[str, torch.Tensor] = {}
    for path in draft_files(directory):
        with unreadable_as_checkpoint_error(path):
            state.update(load_file(path))
    state = own_tensors(state)
    check_tensors(directory, {k: tuple(v.shape) for k, v in state.items()}, expected, str(state["d2t"].dtype)
                  if "d2t" in state else None)
    state["d2t"] = state["d2t"].long()
    state["t2d"] = state["t2d"].bool()
    return state


def check_draft_headers(directory: str, expected: dict[str, tuple]) -> None:
    """What load_draft_state refuses, read from the safetensors headers alone (no tensor data is loaded): a file
    that is unreadable or shorter than its header says (truncated), missing or unexpected tensors, wrong shapes."""
    from safetensors import safe_open
    shapes, dtypes = {}, {}
    for path in draft_files(directory):
        with unreadable_as_checkpoint_error(path), safe_open(path, "pt") as f:
            for k in f.keys():
                part = f.get_slice(k)
                shapes[k], dtypes[k] = tuple(part.get_shape()), part.get_dtype()
    check_tensors(directory, own_tensors(shapes), expected, own_tensors(dtypes).get("d2t"))


def draft_files(directory: str) -> list[str]:
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors file")
    return [os.path.join(directory, f) for f in files]


@contextlib.contextmanager
def unreadable_as_checkpoint_error(path: str):
    try:
        yield
    except Exception as e:  # safetensors raises several types for a damaged header
        raise CheckpointError(f"{path}: unreadable safetensors file ({type(e).__name__}: {e})") from None


def own_tensors(state: dict) -> dict:
    """A checkpoint's entries under the draft's own names: some exports prefix them with "model." or carry the
    (frozen) target embedding."""
    state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
    state.pop("embed_tokens.weight", None)
    return state


def check_tensors(directory: str, shapes: dict[str, tuple], expected: dict[str, tuple], d2t_dtype) -> None:
    """The tensors' names and shapes against `expected`, and an integer d2t (d2t_dtype: torch's or the header's)."""
    missing = [k for k in expected if k not in shapes]
    extra = [k for k in shapes if k not in expected]
    if missing or extra:
        raise CheckpointError(f"{directory}: " + "; ".join(
            ([f"missing tensor {k} (expected shape {list(expected[k])})" for k in missing] +
             [f"unexpected tensor {k} (shape {list(shapes[k])})" for k in extra])))
    for k, shape in expected.items():
        if shapes[k] != shape:
            raise CheckpointError(f"{directory}: tensor {k} has shape {list(shapes[k])}, "
                                  f"config.json implies {list(shape)}")
    if d2t_dtype not in ("torch.int64", "torch.int32", "I64", "I32"):
        raise CheckpointError(f"{directory}: tensor d2t has dtype {d2t_dtype}, expected int64")

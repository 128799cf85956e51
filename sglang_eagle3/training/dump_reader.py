"""A finished hidden-state dump (the layout hidden_dump.py writes and documents): its file names, its format
version, and `HiddenStateDump`, which checks every shard against manifest.json and reads rows lazily from
memory-mapped safetensors shards."""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from sglang_eagle3.errors import UserError
from sglang_eagle3.fileio import file_sha256

MANIFEST, CONFIG = "manifest.json", "dump_config.json"
FORMAT_VERSION = 1


class DumpError(UserError):
    """A dump directory that is incomplete, corrupt or made with other settings; the message names the file."""


def read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise DumpError(f"{path}: not valid JSON ({e})") from None


class HiddenStateDump:
    """A finished dump: len(dump) rows; dump[i] -> {input_ids [n], loss_mask [n], aux_hidden_states [n, n_aux*H],
    last_hidden [n, H]} read lazily from memory-mapped shards."""

    def __init__(self, path: str, verify: str = "sha256", progress: bool = False, part: tuple[int, int] = (0, 1)):
        """verify: sha256 | size | none. part=(rank, world): hash only shards i % world == rank (every rank
        still checks every shard's size), so the ranks of a job share the hashing."""
        if verify not in ("sha256", "size", "none"):
            raise ValueError(f"verify must be sha256, size or none, got {verify!r}")
        self.path = path
        mpath = os.path.join(path, MANIFEST)
        if not os.path.isfile(mpath):
            hint = " (the dump is unfinished: rerun dump_hidden_states.py to resume it)" \
                if os.path.isfile(os.path.join(path, CONFIG)) else ""
            raise DumpError(f"{path}: no {MANIFEST}{hint}")
        self.manifest = m = read_json(mpath)
        if m.get("format_version") != FORMAT_VERSION:
            raise DumpError(f"{mpath}: format_version {m.get('format_version')}, this code reads {FORMAT_VERSION}")
        self.aux_layer_ids = list(m["aux_layer_ids"])
        self.hidden_size = int(m["target"]["hidden_size"])
        self.vocab_size = int(m["target"]["vocab_size"])
        from tqdm import tqdm
        for i, s in enumerate(tqdm(m["shards"], desc="verify dump", disable=not progress or verify != "sha256")):
            self._verify(s, verify if verify != "sha256" or i % part[1] == part[0] else "size")
        self._starts = np.array([s["row_start"] for s in m["shards"]] + [m["rows"]], dtype=np.int64)
        self._handles: dict[int, object] = {}
        self._offsets: dict[int, np.ndarray] = {}

    def _verify(self, s: dict, verify: str) -> None:
        f = os.path.join(self.path, s["file"])
        if not os.path.isfile(f):
            raise DumpError(f"{f}: shard listed in {MANIFEST} is missing")
        if verify == "none":
            return
        if os.path.getsize(f) != s["bytes"]:
            raise DumpError(f"{f}: {os.path.getsize(f)} bytes, {MANIFEST} says {s['bytes']} (truncated or replaced)")
        if verify == "sha256" and file_sha256(f) != s["sha256"]:
            raise DumpError(f"{f}: sha256 does not match {MANIFEST} (corrupt shard; delete it and its .json, "
                            "then rerun the dump to redo it)")

    def __len__(self) -> int:
        return int(self.manifest["rows"])

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["tokens"])

    def _open(self, k: int):
        if k not in self._handles:
            from safetensors import safe_open
            s = self.manifest["shards"][k]
            f = os.path.join(self.path, s["file"])
            h = safe_open(f, framework="pt")
            off = h.get_tensor("offsets").numpy()
            H, A = self.hidden_size, len(self.aux_layer_ids)
            want = {"offsets": (s["rows"] + 1,), "input_ids": (s["tokens"],), "loss_mask": (s["tokens"],),
                    "aux_hidden_states": (s["tokens"], A * H), "last_hidden": (s["tokens"], H)}
            for name, shape in want.items():
                got = tuple(h.get_slice(name).get_shape()) if name in h.keys() else None
                if got != shape:
                    raise DumpError(f"{f}: tensor {name} has shape {got}, {MANIFEST} implies {shape}")
            self._handles[k], self._offsets[k] = h, off
        return self._handles[k], self._offsets[k]

    def _locate(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for a dump of {len(self)} rows")
        k = int(np.searchsorted(self._starts, i, side="right") - 1)
        h, off = self._open(k)
        r = i - int(self._starts[k])
        return h, int(off[r]), int(off[r + 1])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.read(i)

    def read(self, i: int, aux: bool = True) -> dict[str, torch.Tensor]:
        """Row i; aux=False skips the (largest) aux features, e.g. for features="top"."""
        h, a, b = self._locate(i)
        row = {"input_ids": h.get_slice("input_ids")[a:b].long(), "loss_mask": h.get_slice("loss_mask")[a:b].long(),
               "last_hidden": h.get_slice("last_hidden")[a:b]}
        if aux:
            row["aux_hidden_states"] = h.get_slice("aux_hidden_states")[a:b]
        return row

    def token_row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, loss_mask) of row i without reading features."""
        h, a, b = self._locate(i)
        return h.get_slice("input_ids")[a:b].numpy(), h.get_slice("loss_mask")[a:b].numpy()

    def __getstate__(self):                       # picklable for DataLoader workers: reopen lazily
        d = dict(self.__dict__)
        d["_handles"], d["_offsets"] = {}, {}
        return d

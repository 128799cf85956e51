"""Offline training features: run the target over a tokenized dataset once and keep what the draft needs.

Per token we store the fused aux features (inputs of layers aux_layer_ids[i] + 1, [n_aux * H]), the last
hidden state *after the target's final norm* ([H]; target logits = lm_head(last_hidden), recomputed at train
time), the token id and the loss mask. Rows are grouped into shards of `rows_per_shard` consecutive rows:

  OUT/dump_config.json          settings + dataset fingerprint; a resumed run must match it
  OUT/shard_00000.safetensors   input_ids [N] int32, loss_mask [N] uint8, aux_hidden_states [N, n_aux*H],
                                last_hidden [N, H], offsets [rows+1] int64 (row r = offsets[r]:offsets[r+1])
  OUT/shard_00000.json          rows, tokens, bytes, sha256 of the shard (written after the shard)
  OUT/manifest.json             everything above for all shards; written once every shard exists

Shard i belongs to rank i % world_size, so any number of processes (or torchrun) split the work without
talking to each other; each file is written to a temporary name and renamed, so a killed run resumes by
skipping finished shards and redoing the rest. `HiddenStateDump` (dump_reader.py) reads a finished dump and checks
every shard against the manifest (size, and sha256 unless told otherwise). `reuse=[OLD]` (`--reuse`) copies the rows a
finished dump of the same target and settings already holds (found by their token ids), so a dataset that grew
costs a target pass over its new rows only.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from typing import Optional, Sequence

import numpy as np
import torch

from sglang_eagle3.errors import check_at_least
from sglang_eagle3.fileio import check_apart, existing_ancestor, file_sha256, usual_permissions, write_json
from sglang_eagle3.training.dump_reader import CONFIG, FORMAT_VERSION, MANIFEST, DumpError, HiddenStateDump, read_json

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---- token rows ------------------------------------------------------------------------------
def load_token_rows(path: str, max_rows: Optional[int] = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids [n] int64, loss_mask [n] uint8) per row from a `prepare-data` dir or a jsonl of
    {"input_ids": [...], "loss_mask": [...]}."""
    rows = []
    if os.path.isdir(path):
        from sglang_eagle3.training.data.build import iter_tokenized
        for ids, mask in iter_tokenized(path):
            if max_rows is not None and len(rows) >= max_rows:
                break
            rows.append((ids.astype(np.int64), mask.astype(np.uint8)))
    elif os.path.isfile(path):
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if max_rows is not None and len(rows) >= max_rows:
                    break
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    ids = np.asarray(row["input_ids"], dtype=np.int64)
                    mask = np.asarray(row.get("loss_mask", [1] * len(ids)), dtype=np.uint8)
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                    raise DumpError(f"{path}: line {number}: not a row of input_ids/loss_mask ({e!r})") from None
                if ids.ndim != 1 or ids.shape != mask.shape or ids.size < 2:
                    raise DumpError(f"{path}: line {number}: input_ids ({ids.size}) and loss_mask ({mask.size}) "
                                    "must be equal-length lists of >= 2 tokens")
                rows.append((ids, mask))
    else:
        raise DumpError(f"{path}: no such dataset (a `prepare-data` directory or a .jsonl of input_ids/loss_mask)")
    if not rows:
        raise DumpError(f"{path}: no rows")
    return rows


def rows_fingerprint(rows: Sequence[tuple[np.ndarray, np.ndarray]]) -> str:
    h = hashlib.sha256()
    for ids, mask in rows:
        h.update(np.int64(ids.size).tobytes())
        h.update(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(mask, dtype=np.uint8).tobytes())
    return h.hexdigest()


# ---- layout ----------------------------------------------------------------------------------
def shard_name(i: int) -> str:
    return f"shard_{i:05d}.safetensors"


def shard_ranges(num_rows: int, rows_per_shard: int) -> list[tuple[int, int]]:
    return [(s, min(s + rows_per_shard, num_rows)) for s in range(0, num_rows, rows_per_shard)]


def shards_of_rank(num_shards: int, rank: int, world_size: int) -> list[int]:
    if not 0 <= rank < world_size:
        raise DumpError(f"--rank {rank} must be in [0, --world-size {world_size})")
    return list(range(rank, num_shards, world_size))


def bytes_per_token(hidden_size: int, num_aux: int, dtype: torch.dtype) -> int:
    return (num_aux + 1) * hidden_size * torch.finfo(dtype).bits // 8 + 4 + 1


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000


def disk_estimate(num_tokens: int, hidden_size: int, num_aux: int, dtype: torch.dtype, out_dir: str) -> tuple[int, int]:
    """(estimated bytes of the whole dump, free bytes where it goes)."""
    return num_tokens * bytes_per_token(hidden_size, num_aux, dtype), free_bytes(out_dir)


def free_bytes(path: str) -> int:
    """Free bytes on the file system where path is (or would be made)."""
    return shutil.disk_usage(path if os.path.exists(path) else existing_ancestor(path)).free


# ---- writing ---------------------------------------------------------------------------------
def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped longest-first so that len(batch) * max_len <= batch_tokens (at least one row each)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


@torch.no_grad()
def compute_shard(target, rows, dtype: torch.dtype, batch_tokens: int, bar=None,
                  reuse: Optional["FeatureReuse"] = None) -> dict[str, torch.Tensor]:
    """Target features for a list of rows -> the shard's tensors (rows kept in order). Rows that `reuse`
    holds are copied from there; the target runs over the rest."""
    dev = target.device
    aux_out: list = [None] * len(rows)
    last_out: list = [None] * len(rows)
    for i, (ids, _) in enumerate(rows if reuse is not None else ()):
        hit = reuse.lookup(ids)
        if hit is not None:
            aux_out[i], last_out[i] = hit
            if bar is not None:
                bar.update(len(ids))
    todo = [i for i in range(len(rows)) if aux_out[i] is None]
    for batch in length_batches([len(rows[i][0]) for i in todo], batch_tokens):
        idx = [todo[j] for j in batch]
        T = len(rows[idx[0]][0])
        ids = torch.zeros(len(idx), T, dtype=torch.long)
        am = torch.zeros(len(idx), T, dtype=torch.long)
        for j, i in enumerate(idx):
            n = len(rows[i][0])
            ids[j, :n] = torch.from_numpy(rows[i][0])
            am[j, :n] = 1
        aux, last = target.features(ids.to(dev), am.to(dev))            # [b, T, n_aux*H], [b, T, H]
        for j, i in enumerate(idx):
            n = len(rows[i][0])
            aux_out[i] = aux[j, :n].to("cpu", dtype)
            last_out[i] = last[j, :n].to("cpu", dtype)
        if bar is not None:
            bar.update(int(am.sum()))
    lengths = torch.tensor([0] + [len(r[0]) for r in rows])
    return {
        "input_ids": torch.from_numpy(np.concatenate([r[0] for r in rows]).astype(np.int32)),
        "loss_mask": torch.from_numpy(np.concatenate([r[1] for r in rows]).astype(np.uint8)),
        "aux_hidden_states": torch.cat(aux_out).contiguous(),
        "last_hidden": torch.cat(last_out).contiguous(),
        "offsets": lengths.cumsum(0).long(),
    }


def write_shard(out_dir: str, i: int, tensors: dict, row_range: tuple[int, int]) -> dict:
    """Atomically write shard i and then its sidecar; returns the sidecar."""
    from safetensors.torch import save_file
    path = os.path.join(out_dir, shard_name(i))
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(tensors, tmp, metadata={"format": "pt"})     # one key: byte-identical files for equal data
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    usual_permissions(tmp)                                  # save_file makes 0600
    os.replace(tmp, path)
    info = {"file": shard_name(i), "row_start": row_range[0], "rows": row_range[1] - row_range[0],
            "tokens": int(tensors["input_ids"].numel()), "bytes": os.path.getsize(path), "sha256": file_sha256(path)}
    write_json(path[:-len(".safetensors")] + ".json", info)
    return info


def _shard_done(out_dir: str, i: int) -> Optional[dict]:
    path = os.path.join(out_dir, shard_name(i))
    side = path[:-len(".safetensors")] + ".json"
    if not (os.path.isfile(path) and os.path.isfile(side)):
        return None
    try:
        info = read_json(side)
    except DumpError:
        return None
    return info if info.get("bytes") == os.path.getsize(path) else None


def dump_settings(target, rows, dtype: torch.dtype, rows_per_shard: int, source: str) -> dict:
    cfg = target.hf_config
    return {
        "format_version": FORMAT_VERSION,
        "source": os.path.abspath(source) if os.path.exists(source) else source,
        "rows": len(rows), "tokens": int(sum(len(r[0]) for r in rows)), "rows_sha256": rows_fingerprint(rows),
        "rows_per_shard": rows_per_shard, "dtype": str(dtype).replace("torch.", ""),
        "target": {"name_or_path": getattr(cfg, "_name_or_path", None) or getattr(cfg, "name_or_path", None),
                   "model_type": cfg.model_type, "num_layers": target.num_layers,
                   "hidden_size": target.hidden_size, "vocab_size": target.vocab_size},
        "aux_layer_ids": list(target.aux_layer_ids),
        "last_hidden": "after_final_norm",
        "target_dtype": str(target.dtype).replace("torch.", ""),
    }


# settings a dump made before they were recorded lacks: such a dump is resumed (and reused) as it is
LATER_KEYS = ("target_dtype",)
# what makes two dumps' features interchangeable row for row (the rows themselves may differ)
FEATURE_KEYS = ("format_version", "dtype", "target", "aux_layer_ids", "last_hidden", "target_dtype")


def differing_settings(old: dict, new: dict, keys) -> list[str]:
    """Keys whose values differ between a recorded dump config and new settings (a LATER_KEYS key the old
    config lacks is not a difference)."""
    return [k for k in keys if old.get(k) != new[k] and not (k in LATER_KEYS and k not in old)]


def check_settings(out_dir: str, settings: dict) -> None:
    """Write dump_config.json, or make sure an existing one (a run being resumed) has the same settings."""
    path = os.path.join(out_dir, CONFIG)
    if os.path.isfile(path):
        old = read_json(path)
        diff = differing_settings(old, settings, [k for k in settings if k != "source"])
        if diff:
            raise DumpError(f"{path}: this dump was started with other settings ({', '.join(diff)}: "
                            f"{[old.get(k) for k in diff]} vs {[settings[k] for k in diff]}); "
                            "use another --out or --overwrite")
    else:
        write_json(path, settings)


def finalize(out_dir: str) -> Optional[dict]:
    """Write manifest.json if every shard is done; returns it (None while shards are missing)."""
    settings = read_json(os.path.join(out_dir, CONFIG))
    ranges = shard_ranges(settings["rows"], settings["rows_per_shard"])
    shards = []
    for i in range(len(ranges)):
        info = _shard_done(out_dir, i)
        if info is None:
            return None
        shards.append(info)
    manifest = {**settings, "num_aux": len(settings["aux_layer_ids"]), "shards": shards}
    if sum(s["tokens"] for s in shards) != settings["tokens"]:
        raise DumpError(f"{out_dir}: shards hold {sum(s['tokens'] for s in shards)} tokens, "
                        f"the dataset has {settings['tokens']}")
    write_json(os.path.join(out_dir, MANIFEST), manifest)
    return manifest


def check_dump_args(out_dir: str, rows_per_shard: int, batch_tokens: int, rank: int, world_size: int,
                    overwrite: bool, reuse: Sequence[str], source: str = "") -> None:
    """The settings of a dump, checked before the target loads (the command line) and again by dump_hidden_states.
    source: the --data being dumped (kept apart from --out, as every --reuse dump)."""
    check_apart({"--out": out_dir}, {"--data": source or None, "--reuse": list(reuse)}, DumpError)
    check_at_least(1, {"--rows-per-shard": rows_per_shard, "--batch-tokens": batch_tokens,
                       "--world-size": world_size}, DumpError)
    if not 0 <= rank < world_size:
        raise DumpError(f"--rank {rank} must be in [0, --world-size {world_size})")
    if overwrite and world_size > 1:
        raise DumpError("--overwrite with --world-size > 1 would race: delete the --out directory first")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise DumpError(f"--out {out_dir} is a file, not a folder")
    for r in reuse:
        if not os.path.isfile(os.path.join(r, MANIFEST)):
            raise DumpError(f"--reuse {r}: not a finished dump (no {MANIFEST})")


def dump_file(name: str) -> bool:
    """A file a dump writes (its config, manifest, shards, their sidecars and temporary files): what --overwrite
    removes from --out."""
    return name in (CONFIG, MANIFEST) or name.startswith("shard_")


def clear_dump(out_dir: str) -> list[str]:
    """Remove a dump's own files from out_dir; returns the names of the other files, which stay."""
    for name in os.listdir(out_dir):
        if dump_file(name):
            os.remove(os.path.join(out_dir, name))
    return sorted(os.listdir(out_dir))


def dump_hidden_states(target, rows, out_dir: str, *, source: str = "", rows_per_shard: int = 256,
                       batch_tokens: int = 8192, dtype: torch.dtype = torch.bfloat16, rank: int = 0,
                       world_size: int = 1, overwrite: bool = False, check_disk: bool = True,
                       progress: bool = True, reuse: Sequence[str] = (), log=print) -> Optional[dict]:
    """Dump this rank's shards (skipping finished ones); returns the manifest if the dump is now complete.
    reuse: finished dumps of the same target and settings whose rows are copied, not recomputed."""
    from tqdm import tqdm
    check_dump_args(out_dir, rows_per_shard, batch_tokens, rank, world_size, overwrite, reuse, source)
    if overwrite and os.path.isdir(out_dir):
        kept = clear_dump(out_dir)
        if kept:
            print(f"dump: --overwrite removed the dump in {out_dir}; kept {', '.join(kept)}", file=sys.stderr)
    os.makedirs(out_dir, exist_ok=True)
    settings = dump_settings(target, rows, dtype, rows_per_shard, source)
    ranges = shard_ranges(len(rows), rows_per_shard)
    mine = shards_of_rank(len(ranges), rank, world_size)
    num_aux = len(target.aux_layer_ids)
    need, free = disk_estimate(settings["tokens"], target.hidden_size, num_aux, dtype, out_dir)
    my_tokens = sum(len(rows[r][0]) for i in mine for r in range(*ranges[i]))
    log(f"dump: {len(rows)} rows, {settings['tokens']:,} tokens x ({num_aux}+1) x {target.hidden_size} "
        f"{settings['dtype']} -> ~{human_bytes(need)} in {len(ranges)} shards ({human_bytes(free)} free); "
        f"rank {rank}/{world_size}: {len(mine)} shards, {my_tokens:,} tokens")
    if check_disk and need > free:
        raise DumpError(f"{out_dir}: the dump needs ~{human_bytes(need)} but only {human_bytes(free)} are free "
                        "(pass --no-disk-check to try anyway)")
    check_settings(out_dir, settings)
    for name in os.listdir(out_dir):                  # leftovers of this rank's killed writes
        if ".tmp-" in name and name.startswith("shard_") and int(name[6:11]) % world_size == rank:
            os.remove(os.path.join(out_dir, name))
    todo = [i for i in mine if _shard_done(out_dir, i) is None]
    if len(todo) < len(mine):
        log(f"dump: rank {rank}: {len(mine) - len(todo)} shards already done, {len(todo)} to go")
    todo_tokens = sum(len(rows[r][0]) for i in todo for r in range(*ranges[i]))
    reused = FeatureReuse(reuse, settings) if reuse and todo else None
    if reused is not None:
        hits = sum(len(rows[r][0]) for i in todo for r in range(*ranges[i]) if reused.has(rows[r][0]))
        log(f"dump: {hits:,} of the {todo_tokens:,} tokens to go are copied from {', '.join(reuse)}; "
            f"the target runs over {todo_tokens - hits:,}")
    with tqdm(total=todo_tokens, unit=" tok", unit_scale=True, desc=f"dump rank {rank}", position=rank,
              disable=not progress) as bar:
        for i in todo:
            s, e = ranges[i]
            write_shard(out_dir, i, compute_shard(target, rows[s:e], dtype, batch_tokens, bar, reused), (s, e))
    manifest = finalize(out_dir)
    if manifest is None:
        log(f"dump: rank {rank} done; waiting for other ranks' shards before manifest.json is written")
    return manifest


def _row_key(ids: np.ndarray) -> bytes:
    return hashlib.sha1(np.ascontiguousarray(ids, dtype=np.int64).tobytes()).digest()


class FeatureReuse:
    """The rows of finished dumps, found by their token ids: features depend only on the ids (and the target
    and settings, which must match), so a dump of a grown dataset copies the rows it already has."""

    def __init__(self, paths: Sequence[str], settings: dict):
        self.dumps, self.index = [], {}
        for path in paths:
            try:
                dump = HiddenStateDump(path, verify="size")
            except DumpError as e:
                raise DumpError(f"--reuse {path}: not a finished dump ({e})") from None
            diff = differing_settings(dump.manifest, settings, FEATURE_KEYS)
            if diff:
                raise DumpError(f"--reuse {path}: made with other settings ({', '.join(diff)}: "
                                f"{[dump.manifest.get(k) for k in diff]} vs {[settings[k] for k in diff]})")
            for r in range(len(dump)):
                self.index.setdefault(_row_key(dump.token_row(r)[0]), (len(self.dumps), r))
            self.dumps.append(dump)

    def has(self, ids: np.ndarray) -> bool:
        return _row_key(ids) in self.index

    def lookup(self, ids: np.ndarray) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(aux_hidden_states [n, n_aux*H], last_hidden [n, H]) of a row with these ids, or None."""
        hit = self.index.get(_row_key(ids))
        if hit is None:
            return None
        row = self.dumps[hit[0]].read(hit[1])
        return row["aux_hidden_states"], row["last_hidden"]

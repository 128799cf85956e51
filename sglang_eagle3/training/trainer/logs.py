"""Training metrics: one JSON line per record (metrics.jsonl), TensorBoard scalars, and a PNG of the curves."""
from __future__ import annotations

import json
import math
import os
from typing import Optional

from sglang_eagle3.fileio import write_text_atomic

METRICS_FILE, PLOT_FILE = "metrics.jsonl", "training_curves.png"


def read_metrics(path: str) -> list[dict]:
    """Records of a metrics.jsonl; a line cut short by a kill is skipped."""
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


class MetricsLogger:
    """Rank 0 only. On resume from step s, records after s (written after that checkpoint) are dropped."""

    def __init__(self, out_dir: str, resume_step: int = 0, tensorboard: bool = True):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, METRICS_FILE)
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step] if resume_step else []
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.file = open(self.path, "a")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=resume_step or None)
            except ImportError:
                self.tb = None

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            split, step = record.get("split", "train"), record["step"]
            for k, v in record.items():
                if k not in ("step", "split") and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(f"{split}/{k}", v, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def plot_curves(metrics_path: str, out_png: str, title: Optional[str] = None) -> Optional[str]:
    """Train/eval loss and eval per-step accuracy + simulated acceptance length -> PNG (None if no data)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    train = [r for r in recs if r.get("split") == "train"]
    evals = [r for r in recs if r.get("split") == "eval"]
    if not train and not evals:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1)
    if evals:
        ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="eval")
    ax.set(xlabel="step", ylabel="TTT loss", title="loss")
    ax.legend()
    ax = axes[1]
    keys = sorted((k for k in (evals[-1] if evals else {}) if k.startswith("acc_")), key=lambda k: int(k[4:]))
    for k in keys:
        ax.plot([r["step"] for r in evals], [r[k] for r in evals], "o-", ms=3, label=k)
    ax.set(xlabel="step", ylabel="accuracy", title="eval accuracy per draft step", ylim=(0, 1))
    if keys:
        ax.legend(fontsize=7, ncol=2)
    ax = axes[2]
    if evals:
        ax.plot([r["step"] for r in evals], [r["accept_length"] for r in evals], "o-")
    ax.set(xlabel="step", ylabel="tokens / verify step", title="eval simulated acceptance length (chain)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = out_png + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out_png)
    return out_png

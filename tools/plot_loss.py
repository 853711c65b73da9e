#!/usr/bin/env python
"""Plot training loss (lines) and validation loss (markers) against iteration.

    python tools/plot_loss.py --log-json run_a.jsonl run_b.jsonl --out loss.png

Reads the ``--log-json`` files pretrain_gpt.py writes (one JSON object per iteration or
evaluation). A resumed run appends to the same file and may repeat iterations: the
last record of an iteration wins. Needs matplotlib (optional for the project).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def read_log(path: str) -> tuple[dict[int, float], dict[int, float]]:
    """({iteration: train loss}, {iteration: valid loss}); unreadable lines are skipped."""
    train, valid = {}, {}
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # e.g. a line cut short by a killed run
            if not isinstance(rec, dict) or "iteration" not in rec:
                continue
            if isinstance(rec.get("loss"), (int, float)):
                train[int(rec["iteration"])] = float(rec["loss"])
            if isinstance(rec.get("valid_loss"), (int, float)):
                valid[int(rec["iteration"])] = float(rec["valid_loss"])
    return train, valid


def plot(
    logs: list[str],
    out: str,
    title: str | None = None,
    log_y: bool = False,
    labels: list[str] | None = None,
) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "plot_loss.py: matplotlib is not installed (pip install matplotlib)"
        ) from None
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, path in enumerate(logs):
        name = labels[i] if labels and i < len(labels) else os.path.basename(path)
        train, valid = read_log(path)
        if not train and not valid:
            print(f"plot_loss.py: warning: {path} has no loss records", file=sys.stderr)
        color = f"C{i % 10}"
        if train:
            its = sorted(train)
            ax.plot(its, [train[t] for t in its], color=color, lw=1.2, label=f"{name} train")
        if valid:
            its = sorted(valid)
            ax.plot(
                its,
                [valid[t] for t in its],
                "o--",
                color=color,
                ms=4,
                lw=0.8,
                label=f"{name} valid",
            )
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats/token)")
    if log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or "training loss")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Plot loss curves from --log-json files")
    p.add_argument("--log-json", nargs="+", required=True, metavar="FILE")
    p.add_argument("--out", required=True, metavar="PNG")
    p.add_argument("--labels", nargs="+", help="legend names (default: the file names)")
    p.add_argument("--title")
    p.add_argument("--log-y", action="store_true", help="logarithmic loss axis")
    a = p.parse_args(argv)
    for path in a.log_json:
        if not os.path.exists(path):
            p.error(f"{path}: no such file")
    print(plot(a.log_json, a.out, a.title, a.log_y, a.labels))
    return 0


if __name__ == "__main__":
    sys.exit(main())

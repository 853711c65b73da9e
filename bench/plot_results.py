"""PNG plots from the benches' JSON; without matplotlib each function says so and returns False.

python bench/plot_results.py cpu-adam results_cpu_adam.json docs/cpu_adam_throughput.png
python bench/plot_results.py e2e results_e2e.json docs/e2e_tokens_per_sec.png
"""

from __future__ import annotations

import json
import sys


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        print("matplotlib is not installed: no plot written (pip install matplotlib)")
        return None


def plot_cpu_adam(report: dict, path: str) -> bool:
    """Mparams/s against size for each Adam row, with the stream_probe ceiling dashed."""
    plt = _pyplot()
    if plt is None:
        return False
    sizes = sorted(report["sizes"], key=float)
    series: dict[str, tuple[str, list, list]] = {}
    for n in sizes:
        for r in report["sizes"][n]["rows"]:
            if "skipped" in r:
                continue
            label, xs, ys = series.setdefault(r["key"], (r["label"], [], []))
            xs.append(float(n) / 1e6)
            ys.append(r["params_per_s"] / 1e6)
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, (label, xs, ys) in series.items():
        if key == "probe_fp32":
            ax.plot(xs, ys, "k--", lw=2, label="ceiling: stream_probe (same traffic, 28 B)")
        elif key.startswith("probe"):
            continue
        else:
            ax.plot(xs, ys, marker="o", label=label)
    m = report.get("meta", {})
    ax.set_xscale("log")
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel("Adam step throughput (Mparams/s, median)")
    ax.set_title(f"CPU Adam step, {m.get('threads', '?')} threads, SIMD {m.get('simd', '?')}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_e2e(report: dict, path: str) -> bool:
    """tokens/s bars per configuration (median), the DDP baseline's level as a line."""
    plt = _pyplot()
    if plt is None:
        return False
    cfgs = report["configs"]
    keys = list(cfgs)
    tps = [cfgs[k]["tokens_per_sec"] for k in keys]
    # the spread of the per-run medians as error bars
    lo = [
        cfgs[k]["tokens_per_sec"] * (1 - cfgs[k]["ms_median"] / max(cfgs[k]["ms_run_medians"]))
        for k in keys
    ]
    hi = [
        cfgs[k]["tokens_per_sec"] * (cfgs[k]["ms_median"] / min(cfgs[k]["ms_run_medians"]) - 1)
        for k in keys
    ]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = ["tab:gray" if k == "ddp" else "tab:blue" for k in keys]
    bars = ax.bar(range(len(keys)), tps, yerr=[lo, hi], color=colors, capsize=4)
    for b, k in zip(bars, keys):
        ax.text(
            b.get_x() + b.get_width() / 2,
            b.get_height() * 0.5,
            f"{cfgs[k]['tokens_per_sec']:.0f}\n{cfgs[k]['vs_ddp']:.3f}x DDP",
            ha="center",
            va="center",
            fontsize=8,
            color="white",
        )
    pair = report.get("pair")
    if pair:
        ax.text(
            0.99,
            0.02,
            f"paired run (iteration by iteration): (a)/(b) = {pair['ratio_median']:.3f}",
            transform=ax.transAxes,
            ha="right",
            va="bottom",
            fontsize=8,
            bbox=dict(facecolor="white", alpha=0.8, lw=0),
        )
    if "ddp" in cfgs:
        ax.axhline(cfgs["ddp"]["tokens_per_sec"], color="tab:gray", ls="--", lw=1)
    ax.set_xticks(range(len(keys)))

    def wrap(label):
        for sep in (" + ", ", ", " (", " --"):
            label = label.replace(sep, "\n" + sep.lstrip(", "))
        return label

    ax.set_xticklabels([wrap(cfgs[k]["label"]) for k in keys], fontsize=7)
    m, mod = report.get("meta", {}), report.get("model", {})
    ax.set_ylabel("tokens/s (median)")
    ax.set_title(
        f"GPT {mod.get('layers')}x{mod.get('hidden')}, seq {mod.get('seq')}, "
        f"{mod.get('precision')}, {m.get('nproc')} ranks x {m.get('threads_per_rank')} "
        f"thread(s), CPU only",
        fontsize=10,
    )
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] not in ("cpu-adam", "e2e"):
        print(__doc__)
        return 2
    kind, src, dst = argv
    with open(src) as f:
        report = json.load(f)
    ok = (plot_cpu_adam if kind == "cpu-adam" else plot_e2e)(report, dst)
    if ok:
        print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak host RSS of a short run with and without ``--save``.

Each variant is a fresh ``pretrain_gpt.py`` process (mock data, a 25.3M-parameter GPT on
the CPU, bf16, ``--cpu-offload``) that reports its own peak RSS (``getrusage`` max RSS) at
exit; the save happens once, at the last iteration. The table gives, per offload fraction
and stored form, how much the save raised the peak, against the rank's optimizer state as
a checkpoint holds it (fp32 master and moments: 12 B per owned element, read from the
run's own memory report) and per owned element. "compact" keeps the master as remainders
and both moments in 8 bits: the save converts them a chunk at a time, never whole.

  python bench/bench_save_memory.py [--fractions 0.5,1] [--forms fp32,compact] [--iters 2]
      [--max-ratio 0.25] [--layers 6 --hidden 512 --vocab 12288]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_flags(layers: int = 6, hidden: int = 512, vocab: int = 12288) -> list[str]:
    """The model's flags (the defaults: the 25.3M-parameter GPT of the table)."""
    return [
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", "8",
        "--seq-length", "128", "--vocab-size", str(vocab),
    ]  # fmt: skip


RUN = [
    "--device", "cpu", "--mock-data", "--bf16", "--cpu-offload",
    "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-4",
    "--eval-iters", "0", "--log-interval", "100",
]  # fmt: skip
# Runs pretrain_gpt.py as __main__ and prints this process's own peak RSS at exit.
WRAPPER = (
    "import resource, runpy, sys\n"
    "sys.argv = ['pretrain_gpt.py'] + sys.argv[1:]\n"
    "try:\n    runpy.run_path('pretrain_gpt.py', run_name='__main__')\n"
    "finally:\n    print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF)"
    ".ru_maxrss, flush=True)\n"
)


FORMS = {
    "fp32": [],
    "compact": [
        "--store-param-remainders",
        "--exp-avg-dtype",
        "8bit",
        "--exp-avg-sq-dtype",
        "8bit",
    ],
}


def peak_rss(fraction: str, iters: int, save: str | None, form: str = "fp32",
             model: list[str] | None = None) -> tuple[int, int]:  # fmt: skip
    """(peak RSS bytes, elements this rank owns) of one run in a fresh process."""
    argv = [*(model or model_flags()), *RUN, *FORMS[form], "--train-iters", str(iters)]
    argv += ["--optimizer-offload-fraction", fraction]
    if save:
        argv += ["--save", save, "--save-interval", str(iters)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    res = subprocess.run(
        [sys.executable, "-c", WRAPPER, *argv],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800,
    )  # fmt: skip
    if res.returncode != 0:
        sys.exit(f"bench_save_memory: run failed (F={fraction}, save={bool(save)}):\n"
                 + res.stderr[-2000:])  # fmt: skip
    rss = int(re.search(r"MAXRSS_KB (\d+)", res.stdout).group(1)) * 1024
    owned = int(re.search(r"owned (\d+) of", res.stdout).group(1))
    return rss, owned


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fractions", default="0.5,1")
    ap.add_argument("--forms", default="fp32,compact", help=f"of {','.join(FORMS)}")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--max-ratio", type=float, default=None, help="exit 1 above this ratio")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=12288)
    args = ap.parse_args(argv)
    model = model_flags(args.layers, args.hidden, args.vocab)
    mib = 2**20
    print(
        f"{'F':>4} {'form':>8} {'no save MiB':>12} {'save MiB':>9} {'+MiB':>7} "
        f"{'state MiB':>10} {'ratio':>6} {'B/param':>8}"
    )
    worst = 0.0
    for form in args.forms.split(","):
        for fraction in args.fractions.split(","):
            base, owned = peak_rss(fraction, args.iters, None, form, model)
            with tempfile.TemporaryDirectory() as tmp:
                ckpt = os.path.join(tmp, "ckpt")
                saved, _ = peak_rss(fraction, args.iters, ckpt, form, model)
            state = 12 * owned
            ratio = (saved - base) / state
            worst = max(worst, ratio)
            print(
                f"{fraction:>4} {form:>8} {base / mib:12.1f} {saved / mib:9.1f} "
                f"{(saved - base) / mib:+7.1f} {state / mib:10.1f} {ratio:6.3f} "
                f"{(saved - base) / owned:8.2f}"
            )
    if args.max_ratio is not None and worst > args.max_ratio:
        print(f"the save raised the peak by {worst:.3f} of the state (> {args.max_ratio})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

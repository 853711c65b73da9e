"""The step time with and without --overlap-cpu-optimizer, paired in one run.

One rank on the CPU, bf16 (``--dtype fp32`` too), through the real training path: the
flags parsed and resolved as pretrain_gpt.py does, the model and the optimizer built by
``training.build_model_and_optimizer``, each iteration one ``training.train_step``. The
model's compute runs on one core (``torch.set_num_threads(1)``) and the CPU Adam on the other
(``cpu_adam.set_num_threads(1)``; with the overlap the Adam runs on the reducer's host worker
thread while backward goes on).
Two runs from the same seed on the same batches, the synchronous one and the overlapped one,
take their iterations in turn (the order alternating), so a change of load hits both; their
losses must be bitwise equal. The default model (4 x 512, seq 8, micro-batch 1, buckets of
1M elements: 13) is sized so that the CPU Adam takes a large share of backward (0.6 of it on
a quiet 2-core Xeon: on the CPU backward also moves every gradient through the reducer);
the table says how long each took here.

The throughput model's prediction (planner/overlap_schedule.py) is made from this run's
own measured phases: forward and backward and the copies up of the synchronous run, the
speculative Adam's seconds on the overlapped run's worker, the bucket sizes of the layout;
it is printed beside the measured ratio. The last line is
``paired step-time ratio (overlap / sync): R``: the median over the iterations of each
iteration's overlapped step time over its synchronous one.

  python bench/bench_overlap.py [--layers 4] [--hidden 512] [--seq 8] [--micro-batch 1]
                                [--dtype bf16] [--iters 20] [--warmup 2]
                                [--bucket-size 1000000] [--json FILE]
"""

import argparse
import json
import os
import platform
import statistics
import time


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16", help="compute dtype")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations of each run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    ap.add_argument(
        "--bucket-size", type=int, default=1_000_000, help="elements per bucket (0: one layer)"
    )
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    for name in ("layers", "hidden", "seq", "vocab", "micro_batch", "iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.hidden % 64 and args.hidden >= 64:
        ap.error(f"--hidden must be a multiple of 64 (64 per head), got {args.hidden}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


ARGS = _args()
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
from phase_sections import Sections  # noqa: E402

from mp_offload.config import parse, resolve  # noqa: E402
from mp_offload.ops import cpu_adam  # noqa: E402
from mp_offload.planner.overlap_schedule import buckets, schedule  # noqa: E402
from mp_offload.runtime.distributed import init_distributed  # noqa: E402


def pretrain_flags(overlap: bool) -> list[str]:
    a = ARGS
    bucket = a.bucket_size or 12 * a.hidden * a.hidden + 13 * a.hidden  # one layer's params
    flags = [
        *("--num-layers", str(a.layers), "--hidden-size", str(a.hidden)),
        *("--num-attention-heads", str(max(1, a.hidden // 64)), "--seq-length", str(a.seq)),
        *("--max-position-embeddings", str(a.seq), "--vocab-size", str(a.vocab)),
        *("--micro-batch-size", str(a.micro_batch), "--global-batch-size", str(a.micro_batch)),
        *("--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--clip-grad", "0"),
        *("--cpu-offload", "--optimizer-offload-fraction", "1", "--device", "cpu"),
        *("--reduce-bucket-size", str(bucket), "--mock-data", "--tokenizer-type"),
        *("NullTokenizer", "--train-iters", str(a.warmup + a.iters), "--lr", "1e-4"),
    ]
    flags += ["--bf16"] if a.dtype == "bf16" else []
    return flags + (["--overlap-cpu-optimizer"] if overlap else [])


class Run:
    """One of the two runs: its model, optimizer and what each iteration measured."""

    def __init__(self, overlap: bool, device):
        from mp_offload.training import build_model_and_optimizer

        args, given = parse(pretrain_flags(overlap))
        self.args = resolve(args, 1, given)
        self.model, self.opt = build_model_and_optimizer(self.args, device)
        self.overlap, self.device = overlap, device
        self.phases = Sections()  # the optimizer's own phase hook: nothing patched
        self.opt.set_phase_timer(self.phases.section)
        self.rows: list[dict] = []
        self.losses: list[float] = []

    def iteration(self, tokens, timed: bool) -> None:
        from mp_offload import parallel_state as ps
        from mp_offload.training import train_step

        dp = ps.get_data_parallel_group()
        t0 = time.perf_counter()
        out = train_step(self.model, self.opt, iter([tokens]), 1, 1e-4, dp, self.device)
        step = time.perf_counter() - t0
        self.losses.append(out.loss)
        ph = self.phases.take()
        backward = ph.get("backward: autograd compute", 0.0)
        row = dict(step=step, backward=backward, optimizer=out.optimizer_ms / 1e3)
        row["forward"] = out.phases["phase_forward_backward_ms"] / 1e3 - row["backward"]
        if self.overlap:
            st = self.opt.schedule
            row["worker"] = st.record["host_worker_ms"] / 1e3
            row["hidden"] = st.record["host_hidden_ms"] / 1e3
            row["exposed"] = st.record["host_exposed_ms"] / 1e3
            row["replayed"] = st.record["replayed"]
        else:
            row["adam"] = ph.get("Adam (C++ CPU Adam, own slice)", 0.0)
            row["upload"] = ph.get("publish: copy up + clone", 0.0)
        if timed:
            self.rows.append(row)

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.rows)


def predicted_step(sync: Run, ovl: Run, compute: Run) -> float:
    """The overlapped step the model predicts: the synchronous step's measured time less
    its forward, backward, Adam and copies up, plus ``compute``'s forward and backward
    (``sync``: the compute alone; ``ovl``: as it ran beside the worker on this machine)
    and what the schedule leaves exposed when the worker's measured seconds per element
    and the copies up meet that backward."""
    chunks = [b.chunk for b in sync.opt.layout.buckets]
    n = sum(chunks)
    per = buckets(chunks, 0, 0.0, 0.0, ovl.median("worker") / n)
    # on the CPU the copies up are done when they return: the next forward runs behind none
    exposed = schedule(per, compute.median("backward")).exposed + sync.median("upload")
    rest = sum(sync.median(k) for k in ("forward", "backward", "adam", "upload"))
    return (
        sync.median("step")
        - rest
        + compute.median("forward")
        + compute.median("backward")
        + exposed
    )


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def report(sync: Run, ovl: Run, cores: int) -> dict:
    ratios = [o["step"] / s["step"] for s, o in zip(sync.rows, ovl.rows)]
    r = statistics.median(ratios)
    pred_step = predicted_step(sync, ovl, sync)
    pred_r = pred_step / sync.median("step")
    contended_r = predicted_step(sync, ovl, ovl) / sync.median("step")
    params = sum(p.numel() for p in sync.model.parameters())
    ms = lambda run, key: f"{run.median(key) * 1e3:9.1f}"  # noqa: E731
    print(
        f"bench_overlap: {params / 1e6:.2f}M parameters ({ARGS.layers} x {ARGS.hidden}, seq "
        f"{ARGS.seq}, micro-batch {ARGS.micro_batch}, {ARGS.dtype}), "
        f"{len(sync.opt.layout.buckets)} buckets, one rank; {cores} cores in the affinity "
        f"mask, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {cpu_model()}"
    )
    print(f"medians over {len(ratios)} paired iterations (ms):")
    print(f"{'':<10}{'step':>9}{'forward':>9}{'backward':>9}{'optim':>9}  host")
    print(
        f"{'sync':<10}{ms(sync, 'step')}{ms(sync, 'forward')}{ms(sync, 'backward')}"
        f"{ms(sync, 'optimizer')}  Adam {sync.median('adam') * 1e3:.1f}, copies up "
        f"{sync.median('upload') * 1e3:.1f}"
    )
    print(
        f"{'overlap':<10}{ms(ovl, 'step')}{ms(ovl, 'forward')}{ms(ovl, 'backward')}"
        f"{ms(ovl, 'optimizer')}  worker {ovl.median('worker') * 1e3:.1f} (of which hidden "
        f"{ovl.median('hidden') * 1e3:.1f}), exposed {ovl.median('exposed') * 1e3:.1f}; "
        f"{sum(row['replayed'] for row in ovl.rows)} replays"
    )
    adam_over_bwd = sync.median("adam") / sync.median("backward")
    # the overlap can take at most the Adam out of the step: the copies up still follow it
    bound = 1.0 - sync.median("adam") / sync.median("step")
    print(
        f"CPU Adam / backward (sync run): {adam_over_bwd:.2f}; the overlap hides at most the "
        f"Adam: R >= {bound:.3f} on these phases"
    )
    equal = sync.losses == ovl.losses
    print(f"losses bitwise equal: {equal} ({len(sync.losses)} iterations each)")
    print(
        f"throughput model on these phases: overlapped step {pred_step * 1e3:.1f} ms, "
        f"predicted R {pred_r:.3f} (measured / predicted {r / pred_r:.3f}); with the "
        f"backward as it ran beside the worker: R {contended_r:.3f} ({r / contended_r:.3f})"
    )
    print(f"paired step-time ratio (overlap / sync): {r:.3f}")
    return dict(
        ratio=r, predicted=pred_r, predicted_contended=contended_r, ratios=ratios,
        equal=equal, adam_over_backward=adam_over_bwd, bound=bound,
        sync=sync.rows, overlap=ovl.rows, load=os.getloadavg(), params=params,
    )  # fmt: skip


def main() -> int:
    torch.set_num_threads(1)  # the model's compute: one core
    cpu_adam.set_num_threads(1)  # the CPU Adam: one thread (the worker's core)
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        print("bench_overlap: note: 1 core in the affinity mask: backward and Adam share it")
    device = init_distributed("cpu")
    from mp_offload import parallel_state as ps

    ps.initialize_model_parallel(1)
    sync, ovl = Run(False, device), Run(True, device)
    gen = torch.Generator().manual_seed(1)
    shape = (ARGS.micro_batch, ARGS.seq + 1)
    for i in range(ARGS.warmup + ARGS.iters):
        tokens = torch.randint(0, ARGS.vocab, shape, generator=gen)
        for run in (sync, ovl) if i % 2 == 0 else (ovl, sync):
            run.iteration(tokens, timed=i >= ARGS.warmup)
    rep = report(sync, ovl, cores)
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0 if rep["equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

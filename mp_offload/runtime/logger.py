"""The project's one logger, and the per-iteration metrics built on it.

``log`` (the ``mp_offload`` logger) prints plain lines on stdout from global rank 0
only; pass ``extra={"all_ranks": True}`` for a line every rank must print. ``Logger``
adds one JSON object per iteration/evaluation (``--log-json``) and TensorBoard.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist


class _RankZeroFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "all_ranks", False):
            return True
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        return rank == 0


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever sys.stdout is at the time (tests and tools swap it)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):
        pass


def _make_logger() -> logging.Logger:
    logger = logging.getLogger("mp_offload")
    if not logger.handlers:
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(_RankZeroFilter())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


log = _make_logger()


def peak_memory() -> dict:
    """Peak device (allocated, and reserved by the caching allocator) and host memory of
    this process in GB, and the bytes held by torch's pinned host allocator (the device
    proof checks that registering the staging leaves it unchanged)."""
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB
    out = dict(peak_device_gb=0.0, peak_device_reserved_gb=0.0, peak_host_gb=host)
    if torch.cuda.is_available():
        out["peak_device_gb"] = torch.cuda.max_memory_allocated() / 1e9
        out["peak_device_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    stats = getattr(torch.cuda, "host_memory_stats", None)
    out["host_allocator_bytes"] = (
        stats().get("allocated_bytes.current", 0) if stats and torch.cuda.is_available() else 0
    )
    return out


# Dense bf16/fp16 tensor-core peaks (TFLOPS) by device name, for MFU; others: no MFU.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "RTX 4090": 165.2, "L40S": 362.0}


def device_peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def _device_fields(rec: dict) -> str:
    """The progress line's fields that mean something on this run: the loss scale and
    skips only where steps can be skipped (fp16), device memory and host<->device
    traffic only on a GPU, MFU where the device's peak is known."""
    out = ""
    if rec["loss_scale"] != 1.0 or rec["skipped_iterations"]:
        out += f" | loss scale {rec['loss_scale']:g} | skipped {rec['skipped_iterations']}"
    out += f" | tokens/s {rec['tokens_per_sec']:.0f} | TFLOPS/dev {rec['tflops_per_device']:.3f}"
    peak = device_peak_tflops()
    if peak:
        out += f" | MFU {100 * rec['tflops_per_device'] / peak:.1f}%"
    if torch.cuda.is_available():
        out += f" | peak mem dev/host GB {rec['peak_device_gb']:.2f}/{rec['peak_host_gb']:.2f}"
        if "host_device_bytes_per_param" in rec:  # ZeRO-Offload traffic, per owned param
            out += f" | host<->device B/param {rec['host_device_bytes_per_param']:.2f}"
    else:
        out += f" | peak host mem GB {rec['peak_host_gb']:.2f}"
    return out


def sample_block(text: str, longest_blank_run: int = 2) -> str:
    """``text`` as an indented block. A run of more than ``longest_blank_run`` blank or
    whitespace-only lines (an early model's sample is often newlines and indentation only)
    is one line saying how many; the JSON log keeps the text as it is."""
    out: list[str] = []
    blank: list[str] = []

    def flush():
        if len(blank) > longest_blank_run:
            out.append(f"    | ({len(blank)} blank lines)")
        else:
            out.extend("    | " + line for line in blank)
        blank.clear()

    for line in text.splitlines() or [""]:
        if line.strip():
            flush()
            out.append("    | " + line)
        else:
            blank.append(line)
    flush()
    return "\n".join(out)


def hms(seconds: float) -> str:
    """``h:mm:ss`` (``m:ss`` under an hour)."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Logger:
    def __init__(self, cfg, is_main: bool, run_config: dict | None = None):
        self.is_main = is_main
        self.start = time.time()
        self.json = None
        if is_main and cfg.log_json:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.log_json)), exist_ok=True)
            self.json = open(cfg.log_json, "a")
        # Progress: set by start_loop (the loop's first iteration, its last, and when).
        self.total_iters: int | None = None
        self._loop_first, self._loop_start = 0, self.start
        # split -> (iteration, loss) of its latest evaluation (for the summary)
        self.last_eval: dict[str, tuple[int, float]] = {}
        self.tb = None
        if is_main and cfg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(cfg.tensorboard_dir)
            except ImportError:
                self.info(
                    "--tensorboard-dir given but TensorBoard is not installed; skipping "
                    "(pip install tensorboard)"
                )
        self.wandb = None
        if is_main and getattr(cfg, "wandb_project", None):
            try:
                import wandb
            except ImportError:
                self.info(
                    f"warning: --wandb-project {cfg.wandb_project}: wandb is not "
                    "installed (pip install wandb); not logging to Weights & Biases"
                )
            else:
                self.wandb = wandb.init(project=cfg.wandb_project, config=run_config or {})

    def info(self, msg: str) -> None:
        log.info(msg)

    def start_loop(self, first_iteration: int, total_iters: int) -> None:
        """The loop runs from ``first_iteration`` (a resumed run: > 0) to ``total_iters``;
        the ETA is this session's mean time per iteration times the iterations left."""
        self.total_iters = total_iters
        self._loop_first, self._loop_start = first_iteration, time.time()

    def progress(self, iteration: int) -> dict:
        """elapsed_s (since start-up) and, once an iteration of this session is done,
        eta_s (to ``total_iters``)."""
        now = time.time()
        out = {"elapsed_s": now - self.start}
        done = iteration - self._loop_first
        if self.total_iters is not None and done > 0:
            out["eta_s"] = (now - self._loop_start) / done * max(0, self.total_iters - iteration)
        return out

    def _record(self, rec: dict) -> None:
        if self.json:
            try:
                self.json.write(json.dumps(rec) + "\n")
                self.json.flush()
            except OSError as e:  # a full disk: say which file
                raise OSError(e.errno, f"--log-json {self.json.name}: {e.strerror}") from None
        numbers = {
            k: v
            for k, v in rec.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration"
        }
        if self.tb:
            for k, v in numbers.items():
                self.tb.add_scalar(k, v, rec["iteration"])
        if self.wandb:
            self.wandb.log(numbers, step=rec["iteration"])

    def iteration(self, rec: dict, print_line: bool) -> None:
        if not self.is_main:
            return
        rec = dict(rec, **peak_memory())
        self._record(rec)
        if print_line:
            progress = self.progress(rec["iteration"])  # printed, not recorded
            it = str(rec["iteration"])
            if self.total_iters is not None:
                it = f"{it}/{self.total_iters}".rjust(2 * len(str(self.total_iters)) + 1)
            eta = f" | ETA {hms(progress['eta_s'])}" if "eta_s" in progress else ""
            log.info(
                f" iteration {it} | elapsed {hms(progress['elapsed_s'])}{eta} | consumed "
                f"samples {rec['consumed_samples']:10d} | ms/iter {rec['elapsed_ms']:8.1f} | "
                f"lr {rec['lr']:.3e} | loss {rec['loss']:.4f} | grad norm "
                f"{rec['grad_norm']:.3f}{_device_fields(rec)}"
            )

    def evaluation(self, iteration: int, split: str, loss: float | None) -> None:
        if not self.is_main or loss is None:
            return
        ppl = math.exp(min(loss, 50.0))
        self.last_eval[split] = (iteration, loss)
        self._record({"iteration": iteration, f"{split}_loss": loss, f"{split}_ppl": ppl})
        log.info(f" {split} loss at iteration {iteration} | lm loss {loss:.4f} | ppl {ppl:.2f}")

    def sample(self, iteration: int, text: str) -> None:
        """A generated sample (``--sample-prompt``): printed as an indented block."""
        if not self.is_main:
            return
        self._record({"iteration": iteration, "sample": text})
        log.info(f" sample at iteration {iteration} (greedy):\n{sample_block(text)}")

    def close(self) -> None:
        """Close every sink (again: a no-op)."""
        json_file, tb, wb = self.json, self.tb, self.wandb
        self.json = self.tb = self.wandb = None
        if json_file:
            json_file.close()
        if tb:
            tb.close()
        if wb:
            wb.finish()


def final_losses(summary: dict, last_eval: dict[str, tuple[int, float]]) -> str:
    """The last training loss and each split's last evaluation, with the iteration each
    belongs to (an evaluation may be older than the last step: a stopped run's last one,
    or the iteration-0 baseline)."""
    items = [(summary["iteration"], f"train {summary['loss']:.4f}")] if "loss" in summary else []
    items += [
        (i, f"{split} {loss:.4f} (ppl {math.exp(min(loss, 50.0)):.1f})")
        for split, (i, loss) in last_eval.items()
    ]
    if not items:
        return "-"
    if len({i for i, _ in items}) == 1:
        return f"at iteration {items[0][0]}: " + " | ".join(text for _, text in items)
    return " | ".join(f"{text} at iteration {i}" for i, text in items)


def run_summary(
    args,
    logger: Logger,
    summary: dict,
    start_iteration: int,
    start_consumed: int,
    checkpoint_written: bool,
) -> str:
    """The lines that end a run (``args``: its ``config.Args``): time, tokens, final losses
    and the checkpoint (``checkpoint_written``: the one of the last iteration is in --save)."""
    seq, it = args.model.seq_length, summary["iteration"]
    seconds = time.time() - logger.start
    session = (summary["consumed_samples"] - start_consumed) * seq
    losses = final_losses(summary, logger.last_eval)
    lines = [
        " run summary:",
        f"   iterations  {it}/{args.train.train_iters}"
        f"{f' (resumed at {start_iteration})' if start_iteration else ''}"
        f" in {hms(seconds)} (start-up, training and evaluation)",
        f"   tokens      {summary['consumed_samples'] * seq:,} trained on in all; this "
        f"session {session:,} ({session / max(seconds, 1e-9):,.0f} tokens/s overall)",
        f"   final loss  {losses}",
    ]
    if "overlap_steps" in summary:  # --overlap-cpu-optimizer (this session's steps)
        n, r = summary["overlap_steps"], summary["overlap_replays"]
        lines.append(
            f"   overlap     {r} of {n} steps replayed (replay rate {r / max(n, 1):.1%}; "
            "a replay is one extra CPU Adam pass)"
        )
    if args.ckpt.save and checkpoint_written:
        lines.append(f"   checkpoint  {args.ckpt.save} (iteration {it})")
    elif args.ckpt.save:
        lines.append(f"   checkpoint  none written to {args.ckpt.save} (no step was taken)")
    return "\n".join(lines)

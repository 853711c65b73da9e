"""Host memory-bandwidth ceiling for an optimizer step's traffic, independent of our kernel.

An Adam step must stream fixed bytes per element (fp32 param/grad/exp_avg/exp_avg_sq:
read 16 B, write 12 B = 28 B). How fast the machine can move exactly those bytes
depends on the access pattern, so the ceiling is the BEST of several patterns, none of
them our kernel's:

  contiguous       each thread one contiguous range, all arrays advanced together
  contiguous+nt    the same with non-temporal (cache-bypassing) stores
  tiles-256K       256K-element tiles dealt round-robin to the threads
  tiles-256K+nt    the same with non-temporal stores
  dynamic-1M       1M-element tiles handed out on demand (OpenMP dynamic schedule)
  split-4K         each thread one contiguous range, walked 4K elements at a time
                   one array after the other (fewer concurrent streams)
  torch-ops        torch's own kernels: param.add_(grad); exp_avg.mul_(1); exp_avg_sq.mul_(1)
                   (+ param_out.fill_(1)): the same bytes in separate passes (only where
                   param and grad share a dtype: else add_ makes a temporary)

The C++ patterns live in csrc/host_ceiling.cpp (nothing shared with csrc/cpu_adam.cpp),
compiled here with the host's own flags (-O3 -march=native -fopenmp, cached under
build/host_ceiling/) and called through ctypes; without a compiler only torch-ops runs.
bench/bench_cpu_adam.py times these patterns round-robin with its rows; run alone:

  python bench/bench_host_ceiling.py [--sizes 100e6] [--threads N] [--repeats 7]
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "csrc", "host_ceiling.cpp")

sys.path.insert(0, ROOT)
from mp_offload.ops.traffic import READ, READ_WRITE, WRITE, adam_arrays, bytes_per_element  # noqa: E402,F401

_DTYPE = {4: "float32", 2: "bfloat16"}


def _traffic(arrays) -> tuple[int, list]:
    """(bytes/element, [(array, dtype name, mode)]) of one ops/traffic.py account."""
    return bytes_per_element(arrays), [(name, _DTYPE[b], mode) for name, b, mode in arrays]


# traffic class -> (bytes/element, [(array, dtype name, mode)]): the Adam pass's arrays as
# the planner's throughput model charges them (mp_offload/ops/traffic.py)
TRAFFIC = {
    "fp32": _traffic(adam_arrays()),
    "fp32+bf16out": _traffic(adam_arrays(param_out=2)),
    "bf16grad": _traffic(adam_arrays(grad=2)),
    "bf16mom": _traffic(adam_arrays(exp_avg=2, exp_avg_sq=2)),
}
# name -> (pattern code in host_ceiling.cpp, tile elements, non-temporal stores)
C_PATTERNS = {
    "contiguous": (0, 0, False),
    "contiguous+nt": (0, 0, True),
    "tiles-256K": (1, 1 << 18, False),
    "tiles-256K+nt": (1, 1 << 18, True),
    "dynamic-1M": (2, 1 << 20, False),
    "split-4K": (3, 1 << 12, False),
}


def build_library():
    """(ctypes library, "") or (None, why not). Compiled once per source version and flags."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        return None, "no C++ compiler on PATH"
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha1(f.read()).hexdigest()[:12]
    out_dir = os.path.join(ROOT, "build", "host_ceiling")
    os.makedirs(out_dir, exist_ok=True)
    errors = []
    for arch in (["-march=native"], []):
        so = os.path.join(out_dir, f"host_ceiling-{digest}{'-native' if arch else ''}.so")
        if not os.path.exists(so):
            tmp = f"{so}.{os.getpid()}.tmp"
            cmd = [
                cxx,
                "-O3",
                *arch,
                "-fopenmp",
                "-shared",
                "-fPIC",
                "-w",
                "-std=c++17",
                SOURCE,
                "-o",
                tmp,
            ]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
            if res.returncode != 0:
                errors.append(res.stderr.strip().splitlines()[-1:] or ["failed"])
                continue
            os.replace(tmp, so)
        try:
            lib = ctypes.CDLL(so)
        except OSError as exc:
            errors.append([str(exc)])
            continue
        fn = lib.mpo_host_stream
        fn.restype = ctypes.c_double
        fn.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_int),
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_uint32),
        ]
        return lib, ""
    return None, f"could not build {os.path.relpath(SOURCE, ROOT)}: {errors}"


class HostCeiling:
    """Pattern callables for one traffic class over n elements.

    ``shared`` may supply read-only arrays (e.g. the benchmark's real grads) by name;
    every written array is private scratch (it gets junk). ``scratch`` is a dict of
    already allocated scratch tensors to reuse across classes (filled in here)."""

    def __init__(self, lib, torch, n, threads, traffic, shared=None, scratch=None):
        self.torch, self.n, self.threads = torch, n, threads
        self.bytes_per_elem, spec = TRAFFIC[traffic]
        scratch = {} if scratch is None else scratch
        shared = shared or {}
        self.arrays = []
        for name, dtype, mode in spec:
            dt = getattr(torch, dtype)
            if mode == READ and name in shared and shared[name].dtype == dt:
                t = shared[name]
            else:
                key = (name, dtype)
                if key not in scratch:
                    scratch[key] = torch.ones(n, dtype=dt)
                t = scratch[key]
            self.arrays.append((name, t, mode))
        self.lib = lib
        self.aligned = all(t.data_ptr() % 64 == 0 for _, t, _ in self.arrays)

    def _c_pass(self, code, tile, nt):
        k = len(self.arrays)
        ptrs = (ctypes.c_void_p * k)(*[t.data_ptr() for _, t, _ in self.arrays])
        esize = (ctypes.c_int * k)(*[t.element_size() for _, t, _ in self.arrays])
        mode = (ctypes.c_int * k)(*[m for _, _, m in self.arrays])
        sink = ctypes.c_uint32(0)

        def run():
            self.lib.mpo_host_stream(
                code, k, ptrs, esize, mode, self.n, self.threads, tile, int(nt), ctypes.byref(sink)
            )

        return run

    def _torch_pass(self):
        by_name = {name: (t, mode) for name, t, mode in self.arrays}
        param, grad = by_name["param"][0], by_name["grad"][0]
        others = [
            t for name, (t, mode) in by_name.items() if mode == READ_WRITE and name != "param"
        ]
        outs = [t for name, (t, mode) in by_name.items() if mode == WRITE]

        def run():
            param.add_(grad)  # read param + grad, write param
            for t in others:
                t.mul_(1.0)  # read + write
            for t in outs:
                t.fill_(1.0)  # write

        return run

    def patterns(self):
        """[(name, callable)]: one pass of each pattern (C ones only if the library built)."""
        out = []
        if self.lib is not None:
            for name, (code, tile, nt) in C_PATTERNS.items():
                if nt and not self.aligned:
                    continue
                out.append((name, self._c_pass(code, tile, nt)))
        by_name = {name: t for name, t, _ in self.arrays}
        if by_name["param"].dtype == by_name["grad"].dtype or not out:
            # (else param.add_(grad) converts grad into a temporary: more bytes than the
            # class's, and page faults at every pass; kept only when nothing else runs)
            out.append(("torch-ops", self._torch_pass()))
        return out


def best_of(times_by_pattern):
    """(pattern name, median seconds) of the fastest pattern by median."""
    med = {k: statistics.median(v) for k, v in times_by_pattern.items() if v}
    name = min(med, key=med.get)
    return name, med[name]


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="100e6")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--traffic",
        default=",".join(TRAFFIC),
        help=f"comma-separated subset of {','.join(TRAFFIC)}",
    )
    ap.add_argument(
        "--no-thp", action="store_true", help="do not ask torch for transparent huge pages"
    )
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if not args.no_thp:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    import torch

    torch.set_num_threads(args.threads)
    lib, why = build_library()
    if lib is None:
        print(f"C++ patterns unavailable: {why}; torch-ops only")
    for n in (int(float(s)) for s in args.sizes.split(",") if s.strip()):
        scratch = {}
        print(f"\n=== n = {n:,} elements, threads = {args.threads} ===")
        for traffic in args.traffic.split(","):
            hc = HostCeiling(lib, torch, n, args.threads, traffic, scratch=scratch)
            pats = hc.patterns()
            for _, fn in pats:
                fn()
            times = {name: [] for name, _ in pats}
            for r in range(args.repeats):
                for name, fn in pats[r % len(pats) :] + pats[: r % len(pats)]:
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            best, t = best_of(times)
            cells = "  ".join(f"{k} {statistics.median(v) * 1e3:.1f}" for k, v in times.items())
            print(
                f"{traffic:>13s} ({hc.bytes_per_elem} B): best {best} {t * 1e3:.1f} ms = "
                f"{hc.bytes_per_elem * n / t / 1e9:.1f} GB/s | ms: {cells}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

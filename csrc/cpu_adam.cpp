// CPU Adam/AdamW for ZeRO-Offload: one fused pass over param, grad, exp_avg,
// exp_avg_sq (+ optional fp16/bf16 copy of the new param for the GPU).
//
// Deliberately free of torch headers: Python passes raw addresses, element
// counts and dtype codes (validated in mp_offload/ops/cpu_adam.py), so this
// builds in seconds and does not depend on torch's C++ ABI.
//
// One binary serves every x86-64 host: the AVX2 and AVX-512 kernels are
// compiled with per-function target attributes and picked at run time from
// CPUID. Elsewhere (aarch64, ...) only the portable scalar kernel exists.
//
// This file: threading, argument checks and the Python bindings. The SIMD and
// dtype primitives are in simd.h, the kernels (and how their rounding matches
// torch) in adam_kernels.h.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "adam_kernels.h"
#include "split_kernels.h"

namespace py = pybind11;

namespace {

// Threads take chunks of the slice on demand (see run_all). Chunks are cut
// at multiples of kGrain elements (whole cache lines of every stream when the
// arrays are aligned) and hold at most kChunkMax elements (4 MiB of each fp32
// stream: long sequential runs for the hardware prefetchers). Below
// kMinPerThread elements per thread the fork/join costs more than the extra
// thread brings. No software prefetch: on Zen 4 it only took load slots from
// the hardware prefetchers (measured 5-15% slower).
constexpr std::size_t kGrain = 64;
constexpr std::size_t kChunkMax = std::size_t{1} << 20;
constexpr std::size_t kMinPerThread = 8192;

int g_level = kScalar;
int g_threads = 1;
int g_last_team = 0;  // threads that ran the last adam_step / stream_probe (observable for tests)

// Weight decay per element: `runs` (sorted, disjoint, non-empty [start, end))
// take `dec`, everything else `nodec`. Runs only pick which constants a piece
// uses; they never change how the slice is split between threads.
using Runs = std::vector<std::pair<std::size_t, std::size_t>>;

void run_range(TileFn fn, const Job& dec, const Job& nodec, const Runs* runs, std::size_t b, std::size_t e) {
  if (!runs) return fn(dec, b, e);
  // first run ending after b
  auto k = std::upper_bound(runs->begin(), runs->end(), b,
                            [](std::size_t x, const std::pair<std::size_t, std::size_t>& r) { return x < r.second; });
  while (b < e) {
    if (k != runs->end() && k->first <= b) {
      const std::size_t s = std::min(e, k->second);
      fn(dec, b, s);
      b = s;
      ++k;
    } else {
      const std::size_t s = k == runs->end() ? e : std::min(e, k->first);
      fn(nodec, b, s);
      b = s;
    }
  }
}

// One parallel region over the whole slice. Threads take chunks on demand
// (dynamic schedule) rather than one fixed range each: on a shared host a
// thread the OS preempts for a while no longer holds the others up at the end
// (measured ~9% faster than fixed ranges on the loaded 2-core test host).
// About 8 chunks per thread, at most kChunkMax elements each.
void run_all(TileFn fn, const Job& dec, const Job& nodec, const Runs* runs, std::size_t n) {
  const std::size_t want = std::max<std::size_t>(1, std::min<std::size_t>(g_threads, n / kMinPerThread));
  std::size_t chunk = std::min(kChunkMax, (n + want * 8 - 1) / (want * 8));
  chunk = std::max(kGrain, (chunk + kGrain - 1) / kGrain * kGrain);
  const long long nchunks = static_cast<long long>((n + chunk - 1) / chunk);
  int team = 1;
#pragma omp parallel num_threads(static_cast<int>(want)) if (want > 1)
  {
    if (omp_get_thread_num() == 0) team = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1) nowait
    for (long long k = 0; k < nchunks; ++k) {
      const std::size_t b = static_cast<std::size_t>(k) * chunk;
      run_range(fn, dec, nodec, runs, b, std::min(n, b + chunk));
    }
  }
  g_last_team = team;
}

void check_codes(int grad_dtype, std::uintptr_t out_ptr, int out_dtype, int exp_avg_dtype, int exp_avg_sq_dtype) {
  if (grad_dtype != kF32 && grad_dtype != kF16 && grad_dtype != kBF16)
    throw std::invalid_argument("grad_dtype must be 0 (fp32), 1 (fp16) or 2 (bf16), got " + std::to_string(grad_dtype));
  if (out_ptr != 0 && out_dtype != kF16 && out_dtype != kBF16)
    throw std::invalid_argument("out_dtype must be 1 (fp16) or 2 (bf16), got " + std::to_string(out_dtype));
  if (exp_avg_dtype != kF32 && exp_avg_dtype != kBF16)
    throw std::invalid_argument("exp_avg_dtype must be 0 (fp32) or 2 (bf16), got " + std::to_string(exp_avg_dtype));
  if (exp_avg_sq_dtype != kF32 && exp_avg_sq_dtype != kBF16)
    throw std::invalid_argument("exp_avg_sq_dtype must be 0 (fp32) or 2 (bf16), got " +
                                std::to_string(exp_avg_sq_dtype));
}

// The buffers of a call (lo: the remainders, 0 without); Hyper is filled in later.
Job make_job(std::uintptr_t p, std::uintptr_t g, std::uintptr_t m, std::uintptr_t v, std::uintptr_t out,
             std::uintptr_t lo = 0) {
  return Job{reinterpret_cast<float*>(p), reinterpret_cast<const void*>(g), reinterpret_cast<void*>(m),
             reinterpret_cast<void*>(v), reinterpret_cast<void*>(out), reinterpret_cast<std::uint16_t*>(lo),
             Hyper{}};
}

void check_addresses(const Job& j) {
  if (j.lo && (!j.out || !j.g || !j.m || !j.v))
    throw std::invalid_argument("null param_hi/param_lo/grad/exp_avg/exp_avg_sq address");
  if (!j.lo && (!j.p || !j.g || !j.m || !j.v))
    throw std::invalid_argument("null param/grad/exp_avg/exp_avg_sq address");
}

// The out code of a bf16 param_out: rounded to nearest even (0) or by the split rule (1).
int out_code(std::uintptr_t out, int out_dtype, int bf16_rounding) {
  if (bf16_rounding != 0 && bf16_rounding != 1)
    throw std::invalid_argument("bf16_rounding must be 0 (nearest even) or 1 (split), got " +
                                std::to_string(bf16_rounding));
  if (!out) return kNone;
  if (bf16_rounding == 1 && out_dtype != kBF16)
    throw std::invalid_argument("bf16_rounding 1 (split) needs a bf16 param_out (out_dtype 2)");
  return bf16_rounding == 1 ? kBF16Split : out_dtype;
}

// Sorted, disjoint runs within [0, n); empty ones dropped.
Runs clean_runs(const Runs& in, std::size_t n) {
  Runs out;
  out.reserve(in.size());
  std::size_t prev_end = 0;
  for (std::size_t k = 0; k < in.size(); ++k) {
    const auto [s, e] = in[k];
    const auto fail = [&](const std::string& what) {
      throw std::invalid_argument("decay_runs[" + std::to_string(k) + "] = (" + std::to_string(s) + ", " +
                                  std::to_string(e) + ")" + what);
    };
    if (s > e) fail(": start > end");
    if (e > n) fail(" is out of range [0, " + std::to_string(n) + "]");
    if (s < prev_end) fail(" is unsorted or overlaps the run before it");
    prev_end = e;
    if (s < e) out.emplace_back(s, e);
  }
  return out;
}

// The hyper-parameters of one step, as adam_step and adam_step_remainder take them.
struct StepArgs {
  long long step;
  double lr, beta1, beta2, eps, weight_decay;
  bool adamw, bias_correction;
  double grad_scale;
};

// Checks the step and the runs, then runs tile kind `ot` over the n elements of job
// (its Hyper filled in here; a second one for the undecayed gaps between runs).
void run_step(Job job, int grad_dtype, int exp_avg_dtype, int exp_avg_sq_dtype, int ot, std::size_t n,
              const StepArgs& a, const std::optional<Runs>& decay_runs) {
  if (a.step < 1) throw std::invalid_argument("step must be >= 1, got " + std::to_string(a.step));
  std::optional<Runs> runs;
  if (decay_runs) runs = clean_runs(*decay_runs, n);
  if (n == 0) return;
  check_addresses(job);
  const auto hyper = [&](double wd) {
    return make_hyper(a.step, a.lr, a.beta1, a.beta2, a.eps, wd, a.adamw, a.bias_correction, a.grad_scale);
  };
  job.h = hyper(a.weight_decay);
  Job nodec = job;
  const bool mixed = runs && a.weight_decay != 0.0;
  if (mixed) nodec.h = hyper(0.0);
  const TileFn fn = pick<false>(g_level, grad_dtype, exp_avg_dtype, exp_avg_sq_dtype, ot);
  run_all(fn, job, nodec, mixed ? &*runs : nullptr, n);
}

void adam_step(std::uintptr_t param, std::uintptr_t grad, int grad_dtype, std::uintptr_t exp_avg,
               std::uintptr_t exp_avg_sq, std::uintptr_t out, int out_dtype, std::size_t n, long long step,
               double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
               bool bias_correction, double grad_scale, int exp_avg_dtype, int exp_avg_sq_dtype,
               const std::optional<Runs>& decay_runs, int bf16_rounding) {
  check_codes(grad_dtype, out, out_dtype, exp_avg_dtype, exp_avg_sq_dtype);
  const int ot = out_code(out, out_dtype, bf16_rounding);
  const StepArgs a{step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale};
  run_step(make_job(param, grad, exp_avg, exp_avg_sq, out), grad_dtype, exp_avg_dtype, exp_avg_sq_dtype, ot, n, a,
           decay_runs);
}

// The same step with the fp32 param kept as (hi, lo) halves (SPLIT in adam_kernels.h):
// read and written in place, hi being the bf16 param that goes to the device.
void adam_step_remainder(std::uintptr_t hi, std::uintptr_t lo, std::uintptr_t grad, int grad_dtype,
                         std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq, std::size_t n, long long step,
                         double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                         bool bias_correction, double grad_scale, int exp_avg_dtype, int exp_avg_sq_dtype,
                         const std::optional<Runs>& decay_runs) {
  check_codes(grad_dtype, 0, 0, exp_avg_dtype, exp_avg_sq_dtype);
  const StepArgs a{step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale};
  if (!lo && n) throw std::invalid_argument("null param_hi/param_lo/grad/exp_avg/exp_avg_sq address");
  run_step(make_job(0, grad, exp_avg, exp_avg_sq, hi, lo), grad_dtype, exp_avg_dtype, exp_avg_sq_dtype, kRem, n,
           a, decay_runs);
}

// Our kernel's memory traffic with trivial math: identical loads, stores, out
// conversion, threading and SIMD path as adam_step. Returns the wall time of
// one pass in seconds. Overwrites its buffers.
double stream_probe(std::uintptr_t param, std::uintptr_t grad, int grad_dtype, std::uintptr_t exp_avg,
                    std::uintptr_t exp_avg_sq, std::uintptr_t out, int out_dtype, std::size_t n, int exp_avg_dtype,
                    int exp_avg_sq_dtype) {
  check_codes(grad_dtype, out, out_dtype, exp_avg_dtype, exp_avg_sq_dtype);
  if (n == 0) return 0.0;
  Job j = make_job(param, grad, exp_avg, exp_avg_sq, out);
  check_addresses(j);
  j.h = make_hyper(1, 0, 0, 0, 0, 0, true, true, 1.0);
  const TileFn fn = pick<true>(g_level, grad_dtype, exp_avg_dtype, exp_avg_sq_dtype, out ? out_dtype : kNone);
  const auto t0 = std::chrono::steady_clock::now();
  run_all(fn, j, j, nullptr, n);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// x <-> (hi, lo) over n elements with the threads of adam_step (pure streaming:
// a static split in kChunkMax pieces is enough).
template <typename Fn, typename... P>
void run_split(Fn fn, std::size_t n, P... ptrs) {
  const std::size_t want = std::max<std::size_t>(1, std::min<std::size_t>(g_threads, n / kMinPerThread));
  const long long chunks = static_cast<long long>((n + kChunkMax - 1) / kChunkMax);
#pragma omp parallel for schedule(static) num_threads(static_cast<int>(want)) if (want > 1)
  for (long long k = 0; k < chunks; ++k) {
    const std::size_t b = static_cast<std::size_t>(k) * kChunkMax;
    fn(ptrs..., b, std::min(n, b + kChunkMax));
  }
}

void split_fp32(std::uintptr_t x, std::uintptr_t hi, std::uintptr_t lo, std::size_t n) {
  if (n && (!x || !hi || !lo)) throw std::invalid_argument("null x/hi/lo address");
  run_split(pick_split(g_level), n, reinterpret_cast<const float*>(x), reinterpret_cast<std::uint16_t*>(hi),
            reinterpret_cast<std::uint16_t*>(lo));
}

void join_fp32(std::uintptr_t hi, std::uintptr_t lo, std::uintptr_t x, std::size_t n) {
  if (n && (!x || !hi || !lo)) throw std::invalid_argument("null hi/lo/x address");
  run_split(pick_join(g_level), n, reinterpret_cast<const std::uint16_t*>(hi),
            reinterpret_cast<const std::uint16_t*>(lo), reinterpret_cast<float*>(x));
}

}  // namespace

PYBIND11_MODULE(_cpu_adam, m) {
  m.doc() = "Fused CPU Adam/AdamW on raw buffers (see mp_offload/ops/cpu_adam.py)";
  g_threads = std::max(1, omp_get_max_threads());
  g_level = best_level();
  if (const char* env = std::getenv("MP_OFFLOAD_CPU_ADAM_SIMD"); env && *env) {
    try {
      g_level = parse_level(env);
    } catch (const std::exception& e) {
      throw py::import_error(std::string("MP_OFFLOAD_CPU_ADAM_SIMD: ") + e.what());
    }
  }

  m.attr("DTYPE_FLOAT32") = static_cast<int>(kF32);
  m.attr("DTYPE_FLOAT16") = static_cast<int>(kF16);
  m.attr("DTYPE_BFLOAT16") = static_cast<int>(kBF16);
  m.attr("TILE") = kMinPerThread;  // elements per thread below which fewer threads run

  m.def("adam_step", &adam_step, py::call_guard<py::gil_scoped_release>(), py::arg("param_ptr"),
        py::arg("grad_ptr"), py::arg("grad_dtype"), py::arg("exp_avg_ptr"), py::arg("exp_avg_sq_ptr"),
        py::arg("out_ptr"), py::arg("out_dtype"), py::arg("n"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"), py::arg("bias_correction"),
        py::arg("grad_scale"), py::arg("exp_avg_dtype") = 0, py::arg("exp_avg_sq_dtype") = 0,
        py::arg("decay_runs") = py::none(), py::arg("bf16_rounding") = 0,
        "One fused Adam/AdamW step over n elements at raw addresses (no validation of sizes!).\n"
        "decay_runs: optional [(start, end), ...] sorted disjoint element ranges that get weight_decay;\n"
        "the rest gets 0. Moments are fp32 (0) or bf16 (2) per exp_avg_dtype / exp_avg_sq_dtype.\n"
        "bf16_rounding: a bf16 param_out rounded to nearest even (0) or by the split rule (1).");
  m.def("adam_step_remainder", &adam_step_remainder, py::call_guard<py::gil_scoped_release>(),
        py::arg("hi_ptr"), py::arg("lo_ptr"), py::arg("grad_ptr"), py::arg("grad_dtype"), py::arg("exp_avg_ptr"),
        py::arg("exp_avg_sq_ptr"), py::arg("n"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"), py::arg("bias_correction"),
        py::arg("grad_scale"), py::arg("exp_avg_dtype") = 0, py::arg("exp_avg_sq_dtype") = 0,
        py::arg("decay_runs") = py::none(),
        "adam_step with the fp32 param as (hi, lo) uint16 halves, updated in place (split rule).");
  m.def("stream_probe", &stream_probe, py::call_guard<py::gil_scoped_release>(), py::arg("param_ptr"),
        py::arg("grad_ptr"), py::arg("grad_dtype"), py::arg("exp_avg_ptr"), py::arg("exp_avg_sq_ptr"),
        py::arg("out_ptr"), py::arg("out_dtype"), py::arg("n"), py::arg("exp_avg_dtype") = 0,
        py::arg("exp_avg_sq_dtype") = 0,
        "Same memory traffic as adam_step with trivial math; returns seconds. Overwrites the buffers.");
  m.def("split_fp32", &split_fp32, py::call_guard<py::gil_scoped_release>(), py::arg("x_ptr"), py::arg("hi_ptr"),
        py::arg("lo_ptr"), py::arg("n"), "fp32 x -> (hi, lo) uint16 halves by the split rule.");
  m.def("join_fp32", &join_fp32, py::call_guard<py::gil_scoped_release>(), py::arg("hi_ptr"), py::arg("lo_ptr"),
        py::arg("x_ptr"), py::arg("n"), "(hi, lo) uint16 halves -> fp32 x, the inverse of split_fp32.");
  m.def("simd_level", []() { return std::string(kLevelNames[g_level]); });
  m.def("available_simd_levels", &available_levels);
  m.def("set_simd_level", [](const std::string& name) { g_level = parse_level(name); }, py::arg("name"));
  m.def("set_num_threads", [](int n) {
    if (n < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(n));
    g_threads = n;
  }, py::arg("n"), "Threads the kernel asks for (a num_threads clause: OMP_NUM_THREADS does not cap it).");
  m.def("get_num_threads", []() { return g_threads; });
  m.def("last_num_threads", []() { return g_last_team; },
        "omp_get_num_threads() inside the parallel region of the last adam_step / stream_probe (0: none yet).");
}

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

Job make_job(std::uintptr_t p, std::uintptr_t g, std::uintptr_t m, std::uintptr_t v, std::uintptr_t out,
             const Hyper& h) {
  if (!p || !g || !m || !v) throw std::invalid_argument("null param/grad/exp_avg/exp_avg_sq address");
  return Job{reinterpret_cast<float*>(p), reinterpret_cast<const void*>(g), reinterpret_cast<void*>(m),
             reinterpret_cast<void*>(v), reinterpret_cast<void*>(out), h};
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

void adam_step(std::uintptr_t param, std::uintptr_t grad, int grad_dtype, std::uintptr_t exp_avg,
               std::uintptr_t exp_avg_sq, std::uintptr_t out, int out_dtype, std::size_t n, long long step,
               double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
               bool bias_correction, double grad_scale, int exp_avg_dtype, int exp_avg_sq_dtype,
               const std::optional<Runs>& decay_runs) {
  check_codes(grad_dtype, out, out_dtype, exp_avg_dtype, exp_avg_sq_dtype);
  if (step < 1) throw std::invalid_argument("step must be >= 1, got " + std::to_string(step));
  std::optional<Runs> runs;
  if (decay_runs) runs = clean_runs(*decay_runs, n);
  if (n == 0) return;
  const Hyper h = make_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale);
  const Job dec = make_job(param, grad, exp_avg, exp_avg_sq, out, h);
  Job nodec = dec;
  const bool mixed = runs && weight_decay != 0.0;
  if (mixed) nodec.h = make_hyper(step, lr, beta1, beta2, eps, 0.0, adamw, bias_correction, grad_scale);
  const TileFn fn = pick<false>(g_level, grad_dtype, exp_avg_dtype, exp_avg_sq_dtype, out ? out_dtype : kNone);
  run_all(fn, dec, nodec, mixed ? &*runs : nullptr, n);
}

// Our kernel's memory traffic with trivial math: identical loads, stores, out
// conversion, threading and SIMD path as adam_step. Returns the wall time of
// one pass in seconds. Overwrites its buffers.
double stream_probe(std::uintptr_t param, std::uintptr_t grad, int grad_dtype, std::uintptr_t exp_avg,
                    std::uintptr_t exp_avg_sq, std::uintptr_t out, int out_dtype, std::size_t n, int exp_avg_dtype,
                    int exp_avg_sq_dtype) {
  check_codes(grad_dtype, out, out_dtype, exp_avg_dtype, exp_avg_sq_dtype);
  if (n == 0) return 0.0;
  const Job j = make_job(param, grad, exp_avg, exp_avg_sq, out, make_hyper(1, 0, 0, 0, 0, 0, true, true, 1.0));
  const TileFn fn = pick<true>(g_level, grad_dtype, exp_avg_dtype, exp_avg_sq_dtype, out ? out_dtype : kNone);
  const auto t0 = std::chrono::steady_clock::now();
  run_all(fn, j, j, nullptr, n);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
        py::arg("decay_runs") = py::none(),
        "One fused Adam/AdamW step over n elements at raw addresses (no validation of sizes!).\n"
        "decay_runs: optional [(start, end), ...] sorted disjoint element ranges that get weight_decay;\n"
        "the rest gets 0. Moments are fp32 (0) or bf16 (2) per exp_avg_dtype / exp_avg_sq_dtype.");
  m.def("stream_probe", &stream_probe, py::call_guard<py::gil_scoped_release>(), py::arg("param_ptr"),
        py::arg("grad_ptr"), py::arg("grad_dtype"), py::arg("exp_avg_ptr"), py::arg("exp_avg_sq_ptr"),
        py::arg("out_ptr"), py::arg("out_dtype"), py::arg("n"), py::arg("exp_avg_dtype") = 0,
        py::arg("exp_avg_sq_dtype") = 0,
        "Same memory traffic as adam_step with trivial math; returns seconds. Overwrites the buffers.");
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

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
#include "q8_codes.h"
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

// fn's jobs address element 0 at `base` (an 8-bit group's start, see q8_group); b, e
// and the runs are counted from the slice start.
void run_range(TileFn fn, const Job& dec, const Job& nodec, const Runs* runs, std::size_t b, std::size_t e,
               std::size_t base = 0) {
  if (!runs) return fn(dec, b - base, e - base);
  // first run ending after b
  auto k = std::upper_bound(runs->begin(), runs->end(), b,
                            [](std::size_t x, const std::pair<std::size_t, std::size_t>& r) { return x < r.second; });
  while (b < e) {
    if (k != runs->end() && k->first <= b) {
      const std::size_t s = std::min(e, k->second);
      fn(dec, b - base, s - base);
      b = s;
      ++k;
    } else {
      const std::size_t s = k == runs->end() ? e : std::min(e, k->first);
      fn(nodec, b - base, s - base);
      b = s;
    }
  }
}

// One parallel region over the whole slice. Threads take chunks on demand
// (dynamic schedule) rather than one fixed range each: on a shared host a
// thread the OS preempts for a while no longer holds the others up at the end
// (measured ~9% faster than fixed ranges on the loaded 2-core test host).
// About 8 chunks per thread, at most kChunkMax elements each, cut at multiples
// of `grain` (kQ8Block with 8-bit moments: a block is never split).
template <typename Range>
void run_all(const Range& range, std::size_t n, std::size_t grain) {
  const std::size_t want = std::max<std::size_t>(1, std::min<std::size_t>(g_threads, n / kMinPerThread));
  std::size_t chunk = std::min(kChunkMax, (n + want * 8 - 1) / (want * 8));
  chunk = std::max(grain, (chunk + grain - 1) / grain * grain);
  const long long nchunks = static_cast<long long>((n + chunk - 1) / chunk);
  int team = 1;
#pragma omp parallel num_threads(static_cast<int>(want)) if (want > 1)
  {
    if (omp_get_thread_num() == 0) team = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1) nowait
    for (long long k = 0; k < nchunks; ++k) {
      const std::size_t b = static_cast<std::size_t>(k) * chunk;
      range(b, std::min(n, b + chunk));
    }
  }
  g_last_team = team;
}

void run_all(TileFn fn, const Job& dec, const Job& nodec, const Runs* runs, std::size_t n) {
  run_all([&](std::size_t b, std::size_t e) { run_range(fn, dec, nodec, runs, b, e); }, n, kGrain);
}

// ------------------------------------------------------------ 8-bit moments
// A step with one or both moments block-wise 8-bit (q8_codes.h): Job.m / Job.v hold
// their codes, ms / vs their scales. Each block is decoded into fp32 stack buffers,
// stepped by the fp32-moment tile `fn` (any SIMD level, grad and out code) and
// encoded again (rounded with the step's dither, q8_codes.h THE FREEZE): one pass
// over memory, the same bits as the fp32 kernel run on the decoded moments followed
// by quantize_8bit(..., step).
struct Q8Step {
  TileFn fn;
  Job dec, nodec;
  const Runs* runs;
  int gt, mt, vt;
  float *ms, *vs;
  const Q8Round *um, *uv;
};

// j with its element 0 moved to element b (the 8-bit moments are set by the caller).
Job rebase(Job j, std::size_t b, int gt, int mt, int vt) {
  if (j.p) j.p += b;
  j.g = static_cast<const char*>(j.g) + b * dsize(gt);
  if (mt != kQ8) j.m = static_cast<char*>(j.m) + b * dsize(mt);
  if (vt != kQ8) j.v = static_cast<char*>(j.v) + b * dsize(vt);
  if (j.out) j.out = static_cast<std::uint16_t*>(j.out) + b;  // fp16/bf16 copy or hi: 2 bytes
  if (j.lo) j.lo += b;
  return j;
}

// Blocks are decoded, stepped and encoded kQ8Group at a time (8 KiB of each moment on
// the stack, in L1): the tile then runs on 2048 elements per call, not 256 (its fixed
// cost per call, and the sfence after a streamed param_out, measured 0.5 ns/element
// with one block per call).
constexpr std::size_t kQ8Group = 8;

// Elements [b, e), at most kQ8Group blocks, b on a block.
void q8_group(const Q8Step& q, std::size_t b, std::size_t e) {
  alignas(64) float mb[kQ8Group * kQ8Block], vb[kQ8Group * kQ8Block];
  Job d = rebase(q.dec, b, q.gt, q.mt, q.vt), nd = rebase(q.nodec, b, q.gt, q.mt, q.vt);
  d.in_l1 = nd.in_l1 = true;
  std::uint8_t* const mc = static_cast<std::uint8_t*>(q.dec.m) + b;
  std::uint8_t* const vc = static_cast<std::uint8_t*>(q.dec.v) + b;
  const auto blocks = [&](auto&& fn) {
    for (std::size_t i = 0; i < e - b; i += kQ8Block) fn(i, std::min(e - b - i, kQ8Block), (b + i) / kQ8Block);
  };
  using Blk = std::size_t;  // (i: offset in the group, len, blk: block index in the call)
  if (q.mt == kQ8) {
    blocks([&](Blk i, Blk len, Blk blk) { q8_decode(mc + i, q.ms[blk], len, true, mb + i, g_level); });
    d.m = nd.m = mb;
  }
  if (q.vt == kQ8) {
    blocks([&](Blk i, Blk len, Blk blk) { q8_decode(vc + i, q.vs[blk], len, false, vb + i, g_level); });
    d.v = nd.v = vb;
  }
  run_range(q.fn, d, nd, q.runs, b, e, b);
  if (q.mt == kQ8)
    blocks([&](Blk i, Blk len, Blk blk) { q8_encode(mb + i, len, true, *q.um, mc + i, q.ms + blk, g_level); });
  if (q.vt == kQ8)
    blocks([&](Blk i, Blk len, Blk blk) { q8_encode(vb + i, len, false, *q.uv, vc + i, q.vs + blk, g_level); });
}

void run_all_q8(const Q8Step& q, std::size_t n) {
  run_all(
      [&](std::size_t b, std::size_t e) {
        for (; b < e; b += kQ8Group * kQ8Block) q8_group(q, b, std::min(e, b + kQ8Group * kQ8Block));
      },
      n, kQ8Block);
}

void check_moment_code(const char* name, int code, bool allow_q8) {
  if (code == kF32 || code == kBF16 || (allow_q8 && code == kQ8)) return;
  throw std::invalid_argument(std::string(name) + (allow_q8 ? " must be 0 (fp32), 2 (bf16) or 5 (8-bit)" : " must be 0 (fp32) or 2 (bf16)") +
                              ", got " + std::to_string(code));
}

void check_codes(int grad_dtype, std::uintptr_t out_ptr, int out_dtype, int exp_avg_dtype, int exp_avg_sq_dtype,
                 bool allow_q8 = true) {
  if (grad_dtype != kF32 && grad_dtype != kF16 && grad_dtype != kBF16)
    throw std::invalid_argument("grad_dtype must be 0 (fp32), 1 (fp16) or 2 (bf16), got " + std::to_string(grad_dtype));
  if (out_ptr != 0 && out_dtype != kF16 && out_dtype != kBF16)
    throw std::invalid_argument("out_dtype must be 1 (fp16) or 2 (bf16), got " + std::to_string(out_dtype));
  check_moment_code("exp_avg_dtype", exp_avg_dtype, allow_q8);
  check_moment_code("exp_avg_sq_dtype", exp_avg_sq_dtype, allow_q8);
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

// Out of place (OUT OF PLACE in adam_kernels.h): the job's state addresses become the
// sources and the dst ones (all or none; p is hi with remainders) take the writes.
struct Dst {
  std::uintptr_t p = 0, lo = 0, m = 0, v = 0;
};

Job out_of_place(Job j, const Dst& d, bool rem, int exp_avg_dtype, int exp_avg_sq_dtype, std::size_t n) {
  const char* names = rem ? "param_hi_dst/param_lo_dst/exp_avg_dst/exp_avg_sq_dst"
                          : "param_dst/exp_avg_dst/exp_avg_sq_dst";
  const int given = (d.p != 0) + (d.m != 0) + (d.v != 0) + (rem && d.lo != 0), all = rem ? 4 : 3;
  if (given == 0 || n == 0) return j;
  if (given != all || (!rem && d.lo)) throw std::invalid_argument(std::string(names) + ": all or none");
  if (exp_avg_dtype == kQ8 || exp_avg_sq_dtype == kQ8)
    throw std::invalid_argument(std::string(names) + " need fp32/bf16 moments: 8-bit ones step in place only");
  check_addresses(j);  // the sources
  j.src = Src{j.p, j.m, j.v, rem ? static_cast<const std::uint16_t*>(j.out) : nullptr, j.lo};
  j.m = reinterpret_cast<void*>(d.m);
  j.v = reinterpret_cast<void*>(d.v);
  if (rem) {
    j.out = reinterpret_cast<void*>(d.p);
    j.lo = reinterpret_cast<std::uint16_t*>(d.lo);
  } else {
    j.p = reinterpret_cast<float*>(d.p);
  }
  return j;
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

// The scales of 8-bit moments (0: that moment is not 8-bit).
struct Scales {
  std::uintptr_t m = 0, v = 0;
};

// Checks the step and the runs, then runs tile kind `ot` over the n elements of job
// (its Hyper filled in here; a second one for the undecayed gaps between runs).
void run_step(Job job, int grad_dtype, int exp_avg_dtype, int exp_avg_sq_dtype, int ot, std::size_t n,
              const StepArgs& a, const std::optional<Runs>& decay_runs, Scales sc = {}) {
  if (a.step < 1) throw std::invalid_argument("step must be >= 1, got " + std::to_string(a.step));
  std::optional<Runs> runs;
  if (decay_runs) runs = clean_runs(*decay_runs, n);
  if (n == 0) return;
  check_addresses(job);
  if ((exp_avg_dtype == kQ8 && !sc.m) || (exp_avg_sq_dtype == kQ8 && !sc.v))
    throw std::invalid_argument("null exp_avg_scale/exp_avg_sq_scale address of an 8-bit moment");
  const auto hyper = [&](double wd) {
    return make_hyper(a.step, a.lr, a.beta1, a.beta2, a.eps, wd, a.adamw, a.bias_correction, a.grad_scale);
  };
  job.h = hyper(a.weight_decay);
  Job nodec = job;
  const bool mixed = runs && a.weight_decay != 0.0;
  if (mixed) nodec.h = hyper(0.0);
  const Runs* r = mixed ? &*runs : nullptr;
  const int mt = exp_avg_dtype == kQ8 ? kF32 : exp_avg_dtype, vt = exp_avg_sq_dtype == kQ8 ? kF32 : exp_avg_sq_dtype;
  const TileFn fn = pick<false>(g_level, grad_dtype, mt, vt, ot);
  if (mt == exp_avg_dtype && vt == exp_avg_sq_dtype) return run_all(fn, job, nodec, r, n);
  const Q8Round um(a.step, true), uv(a.step, false);
  run_all_q8(Q8Step{fn, job, nodec, r, grad_dtype, exp_avg_dtype, exp_avg_sq_dtype, reinterpret_cast<float*>(sc.m),
                    reinterpret_cast<float*>(sc.v), &um, &uv},
             n);
}

void adam_step(std::uintptr_t param, std::uintptr_t grad, int grad_dtype, std::uintptr_t exp_avg,
               std::uintptr_t exp_avg_sq, std::uintptr_t out, int out_dtype, std::size_t n, long long step,
               double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
               bool bias_correction, double grad_scale, int exp_avg_dtype, int exp_avg_sq_dtype,
               const std::optional<Runs>& decay_runs, int bf16_rounding, std::uintptr_t exp_avg_scale,
               std::uintptr_t exp_avg_sq_scale, std::uintptr_t param_dst, std::uintptr_t exp_avg_dst,
               std::uintptr_t exp_avg_sq_dst) {
  check_codes(grad_dtype, out, out_dtype, exp_avg_dtype, exp_avg_sq_dtype);
  const int ot = out_code(out, out_dtype, bf16_rounding);
  const StepArgs a{step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale};
  const Job job = out_of_place(make_job(param, grad, exp_avg, exp_avg_sq, out),
                               Dst{param_dst, 0, exp_avg_dst, exp_avg_sq_dst}, false, exp_avg_dtype, exp_avg_sq_dtype, n);
  run_step(job, grad_dtype, exp_avg_dtype, exp_avg_sq_dtype, ot, n, a, decay_runs,
           Scales{exp_avg_scale, exp_avg_sq_scale});
}

// The same step with the fp32 param kept as (hi, lo) halves (SPLIT in adam_kernels.h):
// read and written in place, hi being the bf16 param that goes to the device.
void adam_step_remainder(std::uintptr_t hi, std::uintptr_t lo, std::uintptr_t grad, int grad_dtype,
                         std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq, std::size_t n, long long step,
                         double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                         bool bias_correction, double grad_scale, int exp_avg_dtype, int exp_avg_sq_dtype,
                         const std::optional<Runs>& decay_runs, std::uintptr_t exp_avg_scale,
                         std::uintptr_t exp_avg_sq_scale, std::uintptr_t hi_dst, std::uintptr_t lo_dst,
                         std::uintptr_t exp_avg_dst, std::uintptr_t exp_avg_sq_dst) {
  check_codes(grad_dtype, 0, 0, exp_avg_dtype, exp_avg_sq_dtype);
  const StepArgs a{step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale};
  if (!lo && n) throw std::invalid_argument("null param_hi/param_lo/grad/exp_avg/exp_avg_sq address");
  const Job job = out_of_place(make_job(0, grad, exp_avg, exp_avg_sq, hi, lo),
                               Dst{hi_dst, lo_dst, exp_avg_dst, exp_avg_sq_dst}, true, exp_avg_dtype, exp_avg_sq_dtype, n);
  run_step(job, grad_dtype, exp_avg_dtype, exp_avg_sq_dtype, kRem, n, a, decay_runs,
           Scales{exp_avg_scale, exp_avg_sq_scale});
}

// Our kernel's memory traffic with trivial math: identical loads, stores, out
// conversion, threading and SIMD path as adam_step. Returns the wall time of
// one pass in seconds. Overwrites its buffers.
double stream_probe(std::uintptr_t param, std::uintptr_t grad, int grad_dtype, std::uintptr_t exp_avg,
                    std::uintptr_t exp_avg_sq, std::uintptr_t out, int out_dtype, std::size_t n, int exp_avg_dtype,
                    int exp_avg_sq_dtype) {
  check_codes(grad_dtype, out, out_dtype, exp_avg_dtype, exp_avg_sq_dtype, false);
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

// fp32 x <-> 8-bit codes + one scale per kQ8Block elements (q8_codes.h), threaded by block;
// rounded to nearest (step 0) or with adam_step's dither at that step.
void q8_quantize(std::uintptr_t x, std::uintptr_t codes, std::uintptr_t scales, std::size_t n, bool is_exp_avg,
                 long long step) {
  if (n && (!x || !codes || !scales)) throw std::invalid_argument("null x/codes/scales address");
  if (step < 0) throw std::invalid_argument("step must be >= 0 (0: nearest), got " + std::to_string(step));
  const Q8Round u(step, is_exp_avg);
  const auto* xs = reinterpret_cast<const float*>(x);
  auto* cs = reinterpret_cast<std::uint8_t*>(codes);
  auto* ss = reinterpret_cast<float*>(scales);
  run_split([&](std::size_t b, std::size_t e) {
    for (; b < e; b += kQ8Block) q8_encode(xs + b, std::min(e, b + kQ8Block) - b, is_exp_avg, u, cs + b, ss + b / kQ8Block,
                                                g_level);
  }, n);
}

void q8_dequantize(std::uintptr_t codes, std::uintptr_t scales, std::uintptr_t x, std::size_t n, bool is_exp_avg) {
  if (n && (!x || !codes || !scales)) throw std::invalid_argument("null codes/scales/x address");
  const auto* cs = reinterpret_cast<const std::uint8_t*>(codes);
  const auto* ss = reinterpret_cast<const float*>(scales);
  auto* xs = reinterpret_cast<float*>(x);
  run_split([&](std::size_t b, std::size_t e) {
    for (; b < e; b += kQ8Block) q8_decode(cs + b, ss[b / kQ8Block], std::min(e, b + kQ8Block) - b, is_exp_avg, xs + b, g_level);
  }, n);
}

std::vector<float> q8_table(bool is_exp_avg) {
  std::vector<float> t(256);
  for (int c = 0; c < 256; ++c) t[c] = q8_value(is_exp_avg, c);
  return t;
}

}  // namespace

PYBIND11_MODULE(_cpu_adam, m) {
  m.doc() = "Fused CPU Adam/AdamW on raw buffers (see mp_offload/ops/cpu_adam.py)";
  g_threads = std::max(1, omp_get_max_threads());
  g_level = best_level();
#if defined(MPO_X86)
  g_unroll_avx512 = default_unroll_avx512();
#endif
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
  m.attr("DTYPE_Q8") = static_cast<int>(kQ8);
  m.attr("Q8_BLOCK") = kQ8Block;
  m.attr("TILE") = kMinPerThread;  // elements per thread below which fewer threads run

  m.def("adam_step", &adam_step, py::call_guard<py::gil_scoped_release>(), py::arg("param_ptr"),
        py::arg("grad_ptr"), py::arg("grad_dtype"), py::arg("exp_avg_ptr"), py::arg("exp_avg_sq_ptr"),
        py::arg("out_ptr"), py::arg("out_dtype"), py::arg("n"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"), py::arg("bias_correction"),
        py::arg("grad_scale"), py::arg("exp_avg_dtype") = 0, py::arg("exp_avg_sq_dtype") = 0,
        py::arg("decay_runs") = py::none(), py::arg("bf16_rounding") = 0, py::arg("exp_avg_scale_ptr") = 0,
        py::arg("exp_avg_sq_scale_ptr") = 0, py::arg("param_dst_ptr") = 0, py::arg("exp_avg_dst_ptr") = 0,
        py::arg("exp_avg_sq_dst_ptr") = 0,
        "One fused Adam/AdamW step over n elements at raw addresses (no validation of sizes!).\n"
        "decay_runs: optional [(start, end), ...] sorted disjoint element ranges that get weight_decay;\n"
        "the rest gets 0. Moments are fp32 (0) or bf16 (2) per exp_avg_dtype / exp_avg_sq_dtype.\n"
        "bf16_rounding: a bf16 param_out rounded to nearest even (0) or by the split rule (1).\n"
        "An 8-bit moment (dtype 5): uint8 codes at its pointer, fp32 block scales at its scale pointer.\n"
        "*_dst_ptr (all or none): out of place, the new state goes there and the sources stay as they are.");
  m.def("adam_step_remainder", &adam_step_remainder, py::call_guard<py::gil_scoped_release>(),
        py::arg("hi_ptr"), py::arg("lo_ptr"), py::arg("grad_ptr"), py::arg("grad_dtype"), py::arg("exp_avg_ptr"),
        py::arg("exp_avg_sq_ptr"), py::arg("n"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"), py::arg("bias_correction"),
        py::arg("grad_scale"), py::arg("exp_avg_dtype") = 0, py::arg("exp_avg_sq_dtype") = 0,
        py::arg("decay_runs") = py::none(), py::arg("exp_avg_scale_ptr") = 0, py::arg("exp_avg_sq_scale_ptr") = 0,
        py::arg("hi_dst_ptr") = 0, py::arg("lo_dst_ptr") = 0, py::arg("exp_avg_dst_ptr") = 0,
        py::arg("exp_avg_sq_dst_ptr") = 0,
        "adam_step with the fp32 param as (hi, lo) uint16 halves, updated in place (split rule),\n"
        "or out of place into the *_dst_ptr buffers (all or none).");
  m.def("stream_probe", &stream_probe, py::call_guard<py::gil_scoped_release>(), py::arg("param_ptr"),
        py::arg("grad_ptr"), py::arg("grad_dtype"), py::arg("exp_avg_ptr"), py::arg("exp_avg_sq_ptr"),
        py::arg("out_ptr"), py::arg("out_dtype"), py::arg("n"), py::arg("exp_avg_dtype") = 0,
        py::arg("exp_avg_sq_dtype") = 0,
        "Same memory traffic as adam_step with trivial math; returns seconds. Overwrites the buffers.");
  m.def("split_fp32", &split_fp32, py::call_guard<py::gil_scoped_release>(), py::arg("x_ptr"), py::arg("hi_ptr"),
        py::arg("lo_ptr"), py::arg("n"), "fp32 x -> (hi, lo) uint16 halves by the split rule.");
  m.def("join_fp32", &join_fp32, py::call_guard<py::gil_scoped_release>(), py::arg("hi_ptr"), py::arg("lo_ptr"),
        py::arg("x_ptr"), py::arg("n"), "(hi, lo) uint16 halves -> fp32 x, the inverse of split_fp32.");
  m.def("q8_quantize", &q8_quantize, py::call_guard<py::gil_scoped_release>(), py::arg("x_ptr"),
        py::arg("codes_ptr"), py::arg("scales_ptr"), py::arg("n"), py::arg("is_exp_avg"), py::arg("step") = 0,
        "fp32 x -> 8-bit codes + one absmax scale per Q8_BLOCK elements (exp_avg's or exp_avg_sq's code),\n"
        "rounded to nearest (step 0) or with adam_step's dither at that step.");
  m.def("q8_dequantize", &q8_dequantize, py::call_guard<py::gil_scoped_release>(), py::arg("codes_ptr"),
        py::arg("scales_ptr"), py::arg("x_ptr"), py::arg("n"), py::arg("is_exp_avg"),
        "8-bit codes + block scales -> fp32 x (code value times its block's scale).");
  m.def("q8_table", &q8_table, py::arg("is_exp_avg"), "The value of each of the 256 codes before scaling.");
  m.def("simd_level", []() { return std::string(kLevelNames[g_level]); });
  m.def("available_simd_levels", &available_levels);
  m.def("set_simd_level", [](const std::string& name) { g_level = parse_level(name); }, py::arg("name"));
  m.def("set_num_threads", [](int n) {
    if (n < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(n));
    g_threads = n;
  }, py::arg("n"), "Threads the kernel asks for (a num_threads clause: OMP_NUM_THREADS does not cap it).");
  m.def("get_num_threads", []() { return g_threads; });
#if defined(MPO_X86)
  m.def("set_avx512_unroll", [](int u) {
    if (u != 1 && u != kUnrollAVX512)
      throw std::invalid_argument("avx512 unroll must be 1 or " + std::to_string(kUnrollAVX512) + ", got " + std::to_string(u));
    g_unroll_avx512 = u;
  }, py::arg("u"), "Vectors a step of the AVX-512 loops (tests; the default is picked by CPU at import).");
  m.def("avx512_unroll", []() { return g_unroll_avx512; });
#endif
  m.def("last_num_threads", []() { return g_last_team; },
        "omp_get_num_threads() inside the parallel region of the last adam_step / stream_probe (0: none yet).");
}

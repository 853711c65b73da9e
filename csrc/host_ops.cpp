// Host-side gradient work of ZeRO-Offload with gradient accumulation (k > 1 micro-batches):
// put a reduced chunk that came down in fp32/fp16/bf16 into the fp32 gradient slice
// (overwrite on the first micro-batch, add on the others) and, with the last one, the sum
// of squares of the ranges that count for the gradient norm, in the same pass.
//
// Memory-bound by construction: the bf16 add moves 10 B per element (read 2 + 4, write 4),
// the first micro-batch's overwrite 6 (large calls use streaming stores, which skip reading
// the lines they replace), the fused norm nothing extra. Sources are widened in registers
// (bf16: a shift; fp16: F16C) with simd.h's loads, on the AVX-512 / AVX2 / scalar path
// picked at run time as for the CPU Adam. Raw pointers from Python (checked in
// mp_offload/ops/host_ops.py), OpenMP, the GIL released, no torch headers.
//
// The element results are exact (a conversion, one fp32 add), so every path gives the same
// bits. So does the sum of squares, by fixing its order: each range is cut into pieces of
// kPiece elements from its own start; in a piece, element j is squared in double (exact)
// and added to lane j % kLanes; the lanes are folded in a fixed tree; piece sums are added
// in order. Threads and SIMD width only decide who computes a piece, never how.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "simd.h"
#include "simd_level.h"

namespace py = pybind11;

namespace {

enum : int { kCopy = 0, kAdd = 1, kRead = 2 };  // what a pass does to dst (kRead: reads src only)

// Pieces are the unit of the norm's summation order; threads take runs of them on demand
// (as in the CPU Adam: a preempted thread does not hold the others up).
constexpr std::size_t kPiece = std::size_t{1} << 15;
constexpr int kLanes = 32;  // = 4 AVX-512 or 8 AVX2 double accumulators
constexpr std::size_t kMinPerThread = std::size_t{1} << 15;  // less: the fork costs more
constexpr std::size_t kRunMax = std::size_t{1} << 20;  // elements a thread takes at once
// From this size on an overwrite streams its stores: the destination is far larger than
// the caches, so reading its old lines first would be wasted traffic.
constexpr std::size_t kStreamMin = std::size_t{1} << 20;
constexpr std::uintptr_t kStreamAlign = 64;  // streaming stores need aligned vectors

int g_level = kScalar;
int g_threads = 1;

struct Args {
  float* dst;
  const void* src;
};

double fold(double* lanes) {
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  return lanes[0];
}

// Elements [i, e) of the piece starting at b, one at a time: the scalar path, and the
// vector paths' tails (same lanes, same rounding).
template <int ST, int OP, bool SQ>
void elements_scalar(const Args& a, std::size_t b, std::size_t i, std::size_t e, double* lanes) {
  for (; i < e; ++i) {
    float x;
    if constexpr (OP == kRead) {
      x = load_scalar<ST>(a.src, i);
    } else {
      const float v = load_scalar<ST>(a.src, i);
      x = OP == kCopy ? v : a.dst[i] + v;
      a.dst[i] = x;
    }
    if constexpr (SQ) {
      const double d = x;
      lanes[(i - b) % kLanes] += d * d;
    }
  }
}

template <int ST, int OP, bool SQ, bool NT>
double piece_scalar(const Args& a, std::size_t b, std::size_t e) {
  alignas(64) double lanes[kLanes] = {};
  elements_scalar<ST, OP, SQ>(a, b, b, e, lanes);
  return SQ ? fold(lanes) : 0.0;
}

#if defined(MPO_X86)
// ---------------------------------------------------------------- AVX2 (8)
template <int ST, int OP, bool NT>
MPO_AVX2 inline __m256 element8_avx2(const Args& a, std::size_t i) {
  __m256 x = load_avx2<ST>(a.src, i);
  if constexpr (OP == kRead) return x;
  if constexpr (OP == kAdd) x = _mm256_add_ps(_mm256_loadu_ps(a.dst + i), x);
  if constexpr (NT) _mm256_stream_ps(a.dst + i, x); else _mm256_storeu_ps(a.dst + i, x);
  return x;
}

// Squares of 8 floats in double: the low 4 into lo, the high 4 into hi.
MPO_AVX2 inline void square8_avx2(__m256d& lo, __m256d& hi, __m256 x) {
  const __m256d l = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  const __m256d h = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  lo = _mm256_add_pd(lo, _mm256_mul_pd(l, l));
  hi = _mm256_add_pd(hi, _mm256_mul_pd(h, h));
}

template <int ST, int OP, bool SQ, bool NT>
MPO_AVX2 double piece_avx2(const Args& a, std::size_t b, std::size_t e) {
  __m256d acc[kLanes / 4];
  for (auto& v : acc) v = _mm256_setzero_pd();
  std::size_t i = b;
  for (; i + kLanes <= e; i += kLanes) {
    __m256 x[kLanes / 8];
    for (int u = 0; u < kLanes / 8; ++u) x[u] = element8_avx2<ST, OP, NT>(a, i + 8 * u);
    if constexpr (SQ)
      for (int u = 0; u < kLanes / 8; ++u) square8_avx2(acc[2 * u], acc[2 * u + 1], x[u]);
  }
  if constexpr (NT) _mm_sfence();  // the streamed sums are visible before anyone reads them
  alignas(64) double lanes[kLanes];
  for (int k = 0; k < kLanes / 4; ++k) _mm256_store_pd(lanes + 4 * k, acc[k]);
  elements_scalar<ST, OP, SQ>(a, b, i, e, lanes);
  return SQ ? fold(lanes) : 0.0;
}

// ------------------------------------------------------------- AVX-512 (16)
template <int ST, int OP, bool NT>
MPO_AVX512 inline __m512 element16_avx512(const Args& a, std::size_t i) {
  __m512 x = load_avx512<ST>(a.src, i);
  if constexpr (OP == kRead) return x;
  if constexpr (OP == kAdd) x = _mm512_add_ps(_mm512_loadu_ps(a.dst + i), x);
  if constexpr (NT) _mm512_stream_ps(a.dst + i, x); else _mm512_storeu_ps(a.dst + i, x);
  return x;
}

MPO_AVX512 inline void square16_avx512(__m512d& lo, __m512d& hi, __m512 x) {
  const __m512d l = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  const __m512d h = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  lo = _mm512_add_pd(lo, _mm512_mul_pd(l, l));
  hi = _mm512_add_pd(hi, _mm512_mul_pd(h, h));
}

template <int ST, int OP, bool SQ, bool NT>
MPO_AVX512 double piece_avx512(const Args& a, std::size_t b, std::size_t e) {
  __m512d acc[kLanes / 8];
  for (auto& v : acc) v = _mm512_setzero_pd();
  std::size_t i = b;
  for (; i + kLanes <= e; i += kLanes) {
    __m512 x[kLanes / 16];
    for (int u = 0; u < kLanes / 16; ++u) x[u] = element16_avx512<ST, OP, NT>(a, i + 16 * u);
    if constexpr (SQ)
      for (int u = 0; u < kLanes / 16; ++u) square16_avx512(acc[2 * u], acc[2 * u + 1], x[u]);
  }
  if constexpr (NT) _mm_sfence();
  alignas(64) double lanes[kLanes];
  for (int k = 0; k < kLanes / 8; ++k) _mm512_store_pd(lanes + 8 * k, acc[k]);
  elements_scalar<ST, OP, SQ>(a, b, i, e, lanes);
  return SQ ? fold(lanes) : 0.0;
}
#endif  // MPO_X86

// --------------------------------------------------------------- dispatch
using PieceFn = double (*)(const Args&, std::size_t, std::size_t);

// fns[squared][streamed] for one source dtype and operation on the active level.
struct Kernels {
  PieceFn fns[2][2];
};

template <int ST, int OP, bool SQ, bool NT>
PieceFn pick_level(int level) {
#if defined(MPO_X86)
  if (level == kAVX512) return &piece_avx512<ST, OP, SQ, NT>;
  if (level == kAVX2) return &piece_avx2<ST, OP, SQ, NT>;
#endif
  (void)level;
  return &piece_scalar<ST, OP, SQ, NT>;
}

template <int ST, int OP>
Kernels pick_ops(int level) {
  Kernels k;
  k.fns[0][0] = pick_level<ST, OP, false, false>(level);
  k.fns[0][1] = pick_level<ST, OP, false, true>(level);
  k.fns[1][0] = pick_level<ST, OP, true, false>(level);
  k.fns[1][1] = pick_level<ST, OP, true, true>(level);
  return k;
}

template <int ST>
Kernels pick_op(int level, bool overwrite) {
  return overwrite ? pick_ops<ST, kCopy>(level) : pick_ops<ST, kAdd>(level);
}

Kernels pick(int level, int src_dtype, bool overwrite) {
  if (src_dtype == kF16) return pick_op<kF16>(level, overwrite);
  if (src_dtype == kBF16) return pick_op<kBF16>(level, overwrite);
  return pick_op<kF32>(level, overwrite);
}

// ------------------------------------------------------------------ pieces
using Ranges = std::vector<std::pair<std::size_t, std::size_t>>;

struct Piece {
  std::size_t b, e;
  long long part;  // index of its partial sum of squares; -1: not part of the norm
};

void cut(std::vector<Piece>& out, std::size_t b, std::size_t e, bool squared, long long& parts) {
  for (; b < e; b += kPiece) out.push_back({b, std::min(e, b + kPiece), squared ? parts++ : -1});
}

void check_ranges(const Ranges& ranges, std::size_t n) {
  std::size_t prev = 0;
  for (std::size_t k = 0; k < ranges.size(); ++k) {
    const auto [b, e] = ranges[k];
    if (b > e || e > n || b < prev)
      throw std::invalid_argument("norm range " + std::to_string(k) + " = (" + std::to_string(b) + ", " +
                                  std::to_string(e) + ") is reversed, beyond " + std::to_string(n) +
                                  " or before the range ahead of it");
    prev = e;
  }
}

// [0, n) as pieces: each norm range cut from its own start, and with `gaps` what lies
// between them (touched but not summed).
std::vector<Piece> make_pieces(std::size_t n, const Ranges& ranges, bool gaps, long long& parts) {
  std::vector<Piece> out;
  out.reserve(n / kPiece + 2 * ranges.size() + 2);
  std::size_t at = 0;
  for (const auto& [b, e] : ranges) {
    if (gaps) cut(out, at, b, false, parts);
    cut(out, b, e, true, parts);
    at = e;
  }
  if (gaps) cut(out, at, n, false, parts);
  return out;
}

// One parallel region over the pieces; returns the sum of squares in the fixed order.
// Threads take runs of consecutive pieces (about 8 per thread, at most kRunMax elements):
// long sequential streams for the prefetchers, as in the CPU Adam.
double run(const Kernels& k, const Args& a, const std::vector<Piece>& pieces, long long parts,
           std::size_t n, bool stream) {
  std::vector<double> part(static_cast<std::size_t>(parts), 0.0);
  const std::size_t want = std::max<std::size_t>(1, std::min<std::size_t>(g_threads, n / kMinPerThread));
  const std::size_t per_run = std::clamp<std::size_t>(n / (want * 8 * kPiece), 1, kRunMax / kPiece);
  const long long count = static_cast<long long>(pieces.size());
  const long long runs = (count + static_cast<long long>(per_run) - 1) / static_cast<long long>(per_run);
#pragma omp parallel for schedule(dynamic, 1) num_threads(static_cast<int>(want)) if (want > 1)
  for (long long r = 0; r < runs; ++r) {
    const long long end = std::min(count, (r + 1) * static_cast<long long>(per_run));
    for (long long q = r * static_cast<long long>(per_run); q < end; ++q) {
      const Piece& p = pieces[q];
      const bool nt = stream && reinterpret_cast<std::uintptr_t>(a.dst + p.b) % kStreamAlign == 0;
      const double s = k.fns[p.part >= 0][nt](a, p.b, p.e);
      if (p.part >= 0) part[p.part] = s;
    }
  }
  double total = 0.0;
  for (const double s : part) total += s;
  return total;
}

double accumulate(std::uintptr_t dst, std::uintptr_t src, long long n, int src_dtype, bool overwrite,
                  const std::optional<Ranges>& norm_ranges) {
  if (n < 0) throw std::invalid_argument("accumulate: negative length " + std::to_string(n));
  if (src_dtype != kF32 && src_dtype != kF16 && src_dtype != kBF16)
    throw std::invalid_argument("accumulate: src_dtype must be 0 (fp32), 1 (fp16) or 2 (bf16), got " +
                                std::to_string(src_dtype));
  const std::size_t len = static_cast<std::size_t>(n);
  const Ranges none;
  const Ranges& ranges = norm_ranges ? *norm_ranges : none;
  check_ranges(ranges, len);
  if (len == 0) return 0.0;
  if (!dst || !src) throw std::invalid_argument("accumulate: null address");
  long long parts = 0;
  const auto pieces = make_pieces(len, ranges, true, parts);
  const Args a{reinterpret_cast<float*>(dst), reinterpret_cast<const void*>(src)};
  return run(pick(g_level, src_dtype, overwrite), a, pieces, parts, len, overwrite && len >= kStreamMin);
}

Kernels pick_read(int level, int dtype) {
  if (dtype == kF16) return pick_ops<kF16, kRead>(level);
  if (dtype == kBF16) return pick_ops<kBF16, kRead>(level);
  return pick_ops<kF32, kRead>(level);
}

// The squares of x (fp32, fp16 or bf16, widened exactly) in the same fixed order.
double sum_squares(std::uintptr_t ptr, long long n, const Ranges& ranges, int dtype) {
  if (n < 0) throw std::invalid_argument("sum_squares: negative length " + std::to_string(n));
  if (dtype != kF32 && dtype != kF16 && dtype != kBF16)
    throw std::invalid_argument("sum_squares: dtype must be 0 (fp32), 1 (fp16) or 2 (bf16), got " +
                                std::to_string(dtype));
  const std::size_t len = static_cast<std::size_t>(n);
  check_ranges(ranges, len);
  long long parts = 0;
  const auto pieces = make_pieces(len, ranges, false, parts);
  if (pieces.empty()) return 0.0;
  if (!ptr) throw std::invalid_argument("sum_squares: null address");
  const Args a{nullptr, reinterpret_cast<const void*>(ptr)};
  return run(pick_read(g_level, dtype), a, pieces, parts, len, false);
}

}  // namespace

PYBIND11_MODULE(_host_ops, m) {
  m.doc() = "fp32 gradient accumulation and sum of squares for ZeRO-Offload's host side";
  g_level = best_level();
  if (const char* env = std::getenv("MP_OFFLOAD_HOST_OPS_SIMD"); env && *env) {
    try {
      g_level = parse_level(env);
    } catch (const std::exception& e) {
      throw py::import_error(std::string("MP_OFFLOAD_HOST_OPS_SIMD: ") + e.what());
    }
  }
  m.attr("DTYPE_FLOAT32") = py::int_(static_cast<int>(kF32));
  m.attr("DTYPE_FLOAT16") = py::int_(static_cast<int>(kF16));
  m.attr("DTYPE_BFLOAT16") = py::int_(static_cast<int>(kBF16));
  m.attr("PIECE") = py::int_(kPiece);  // the norm's summation order, for tests
  m.attr("LANES") = py::int_(kLanes);
  m.attr("STREAM_MIN") = py::int_(kStreamMin);
  m.def("accumulate", &accumulate, py::call_guard<py::gil_scoped_release>(), py::arg("dst"), py::arg("src"),
        py::arg("n"), py::arg("src_dtype"), py::arg("overwrite"), py::arg("norm_ranges") = py::none(),
        "dst = src or dst += src over n elements; returns the sum of squares of the new dst over the\n"
        "sorted, disjoint norm_ranges (0 without them), computed in the same pass.");
  m.def("sum_squares", &sum_squares, py::call_guard<py::gil_scoped_release>(), py::arg("ptr"), py::arg("n"),
        py::arg("ranges"), py::arg("dtype") = 0,
        "Sum of squares (in double) of fp32/fp16/bf16 x over sorted, disjoint ranges of [0, n).");
  m.def("simd_level", [] { return std::string(kLevelNames[g_level]); });
  m.def("available_simd_levels", &available_levels);
  m.def("set_simd_level", [](const std::string& name) { g_level = parse_level(name); }, py::arg("name"));
  m.def("set_num_threads", [](int n) {
    if (n < 1) throw std::invalid_argument("set_num_threads: n must be >= 1, got " + std::to_string(n));
    g_threads = n;
  }, py::arg("n"));
  m.def("get_num_threads", [] { return g_threads; });
}

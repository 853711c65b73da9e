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
// Rounding follows torch's single-tensor AdamW (torch/optim/adam.py) op by op,
// with FMAs exactly where torch's vectorised CPU kernels use them (lerp,
// addcmul, add with alpha) and plain mul/add/div elsewhere. (GCC 12 leaves the
// intrinsic mul/add pairs unfused at -O3; checked with objdump.) The one known
// difference: torch's vectorised sqrt is not always correctly rounded, ours is.
//
// Moments (exp_avg, exp_avg_sq) are fp32 or bf16, each on its own. bf16 ones
// are widened exactly to fp32, the step runs in fp32 as above (the param update
// sees the unrounded fp32 moments), and they are stored rounded to nearest
// even, as torch's .to(torch.bfloat16) does; NaN stays NaN.
//
// Every element's result depends on its own inputs only, never on where a
// thread, vector or tail boundary falls: any split of the work (threads,
// weight-decay runs, alignment peeling) gives the same bits.
//
// DIV_BC2. The SIMD paths compute sqrt(v) / bc2_sqrt without a divide: the
// divider (shared by sqrt and div, ~16 cycles per AVX-512 vector on Zen 4) is
// the kernel's bottleneck, the FMA units are not. With c = bc2_sqrt,
// r = RN(1/c) (relative error < 2^-24) and x = sqrt(v):
//   q0 = RN(x*r); q1 = RN(q0 + RN(x - q0*c)*r); q2 = RN(q1 + RN(x - q1*c)*r)
// (each bracket one fma). q0 is within ~1.5 ulp of x/c, so q1 is within a
// tiny fraction of an ulp of it before its rounding: a faithful rounding of
// x/c. Markstein's theorem (faithful q, reciprocal with relative error below
// 2^-p, one fma residual and one fma correction in round-to-nearest) then
// gives q2 == RN(x/c), exactly what the divide returns, provided nothing
// over- or underflows. That holds here: x is 0 or >= sqrt(2^-149) > 2^-75,
// c is in [2^-26.5, 1] (bc2 >= 2^-53 for any double beta2 < 1), so x/c stays
// far inside float range and the residuals, multiples of 2^(-75-27-46), are
// exact even when subnormal; x = 0 gives +0 as the divide does (v is never
// -0 after its update). +inf and NaN lanes fall back to the divide.
// Exhaustively checked against vdivps for every float significand in 8
// binades of x (2^-75 .. 2^63) and 940 values of c (bc2_sqrt of steps 1..2e5
// for 9 beta2 values, the smallest possible c, random c): no difference. The
// scalar path keeps the plain division.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// -DMPO_NO_SIMD builds the portable path only (as on aarch64; used to test it).
#if defined(__x86_64__) && !defined(MPO_NO_SIMD)
#include <immintrin.h>
#define MPO_X86 1
#define MPO_AVX2 __attribute__((target("avx2,fma,f16c")))
#define MPO_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#endif

namespace py = pybind11;

namespace {

// dtype codes shared with the Python face; as an out code, kNone = no copy.
enum : int { kF32 = 0, kF16 = 1, kBF16 = 2, kNone = 0 };
enum : int { kScalar = 0, kAVX2 = 1, kAVX512 = 2 };
const char* const kLevelNames[] = {"scalar", "avx2", "avx512"};

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

inline std::size_t dsize(int code) { return code == kF32 ? 4 : 2; }

// ---------------------------------------------------------------- scalars
// Per-step constants, computed in double and rounded to float exactly where
// torch turns its Python-float scalars into float operands.
struct Hyper {
  float grad_scale, l2_wd, decay, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step;
  float inv_bc2_sqrt;  // RN(1 / bc2_sqrt), for div_bc2 in the SIMD paths
  bool l2;         // Adam (L2): g += wd * p
  bool lerp_end;   // torch's lerp switches formula when |weight| >= 0.5
};

Hyper make_hyper(long long step, double lr, double beta1, double beta2, double eps, double wd,
                 bool adamw, bool bias_correction, double grad_scale) {
  Hyper h;
  h.grad_scale = static_cast<float>(grad_scale);
  h.l2 = !adamw && wd != 0.0;
  h.l2_wd = static_cast<float>(wd);
  h.decay = (adamw && wd != 0.0) ? static_cast<float>(1.0 - lr * wd) : 1.0f;  // p*1 is exact
  const float w = static_cast<float>(1.0 - beta1);
  h.lerp_end = !(std::fabs(w) < 0.5f);
  h.lerp_w = h.lerp_end ? w - 1.0f : w;
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  double bc1 = 1.0, bc2 = 1.0;
  if (bias_correction) {
    bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  }
  h.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));
  h.inv_bc2_sqrt = 1.0f / h.bc2_sqrt;
  h.eps = static_cast<float>(eps);
  h.neg_step = static_cast<float>(-(lr / bc1));
  return h;
}

// Moments are float* or uint16_t* (bf16) as the tile's template says.
struct Job {
  float* p;
  const void* g;
  void* m;
  void* v;
  void* out;
  Hyper h;
};

inline std::uint32_t f2u(float f) { std::uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(std::uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float bf16_to_f32(std::uint16_t b) { return u2f(static_cast<std::uint32_t>(b) << 16); }

// Round to nearest even; NaN stays NaN (quiet bit forced so truncation can
// never turn a NaN with a low-only payload into infinity).
inline std::uint16_t f32_to_bf16(float f) {
  const std::uint32_t u = f2u(f);
  if (std::isnan(f)) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (e == 0) {  // zero / subnormal: mant * 2^-24 is exact in float
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return u2f(sign | f2u(mag));
  }
  if (e == 31) return u2f(sign | 0x7f800000u | (mant << 13));
  return u2f(sign | ((e + 112u) << 23) | (mant << 13));
}

// Round to nearest even, like F16C's vcvtps2ph with imm 0.
inline std::uint16_t f32_to_f16(float f) {
  const std::uint32_t u = f2u(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u | ((a >> 13) & 0x3ffu);  // quiet NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 (incl. inf) -> inf
  if (a < 0x38800000u) {                         // below 2^-14: half subnormal or 0
    const std::uint32_t e = a >> 23;
    if (e < 102) return sign;  // < 2^-25 (or == 2^-25, a tie to even 0)
    const std::uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126 - e;  // 14..24
    std::uint32_t r = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return sign | static_cast<std::uint16_t>(r);
  }
  const std::uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15
  return sign | static_cast<std::uint16_t>((r + 0xfffu + ((r >> 13) & 1u)) >> 13);
}

// fp32, fp16 or bf16 element -> float (grads and moments).
template <int T>
inline float load_scalar(const void* a, std::size_t i) {
  if constexpr (T == kF32) return static_cast<const float*>(a)[i];
  else if constexpr (T == kF16) return f16_to_f32(static_cast<const std::uint16_t*>(a)[i]);
  else return bf16_to_f32(static_cast<const std::uint16_t*>(a)[i]);
}

// float -> fp32/fp16/bf16 element (moments and param_out); T == kNone for OT = no copy.
template <int T, bool IS_OUT>
inline void store_scalar(void* a, std::size_t i, float x) {
  if constexpr (T == kF16) static_cast<std::uint16_t*>(a)[i] = f32_to_f16(x);
  else if constexpr (T == kBF16) static_cast<std::uint16_t*>(a)[i] = f32_to_bf16(x);
  else if constexpr (!IS_OUT) static_cast<float*>(a)[i] = x;
}

template <int GT, int MT, int VT, int OT, bool PROBE>
void tile_scalar(const Job& j, std::size_t b, std::size_t e) {
  const Hyper h = j.h;  // locals: stores through the buffers cannot alias them
  float* const pp = j.p;
  const void* const gp = j.g;
  void* const mp = j.m;
  void* const vp = j.v;
  void* const op = j.out;
  for (std::size_t i = b; i < e; ++i) {
    float g = load_scalar<GT>(gp, i) * h.grad_scale;
    float p = pp[i], m = load_scalar<MT>(mp, i), v = load_scalar<VT>(vp, i);
    if constexpr (PROBE) {  // same traffic, trivial math
      m = m + g; v = v + g; p = p + g;
    } else {
      if (h.l2) g = std::fma(h.l2_wd, p, g);
      p = p * h.decay;
      m = std::fma(h.lerp_w, g - m, h.lerp_end ? g : m);
      v = std::fma(h.one_minus_beta2 * g, g, v * h.beta2);
      const float d = std::sqrt(v) / h.bc2_sqrt + h.eps;
      p = p + (h.neg_step * m) / d;
    }
    pp[i] = p;
    store_scalar<MT, false>(mp, i, m);
    store_scalar<VT, false>(vp, i, v);
    store_scalar<OT, true>(op, i, p);
  }
}

#if defined(MPO_X86)
// Pieces shorter than a vector (a range's ragged head or tail) go through
// zero-padded stack buffers so they run the very same vector code (identical
// rounding, no masked loads/stores needed).
template <int W>
struct TailBuf {
  alignas(64) float p[W] = {}, g[W] = {}, m[W] = {}, v[W] = {};
  alignas(64) std::uint16_t out[W] = {};
  Job load(const Job& j, int gt, int mt, int vt, std::size_t i, std::size_t r) {
    std::memcpy(p, j.p + i, r * 4);
    std::memcpy(g, static_cast<const char*>(j.g) + i * dsize(gt), r * dsize(gt));
    std::memcpy(m, static_cast<const char*>(j.m) + i * dsize(mt), r * dsize(mt));
    std::memcpy(v, static_cast<const char*>(j.v) + i * dsize(vt), r * dsize(vt));
    Job t = j;
    t.p = p; t.g = g; t.m = m; t.v = v; t.out = j.out ? out : nullptr;
    return t;
  }
  void store(const Job& j, int mt, int vt, std::size_t i, std::size_t r) const {
    std::memcpy(j.p + i, p, r * 4);
    std::memcpy(static_cast<char*>(j.m) + i * dsize(mt), m, r * dsize(mt));
    std::memcpy(static_cast<char*>(j.v) + i * dsize(vt), v, r * dsize(vt));
    if (j.out) std::memcpy(static_cast<std::uint16_t*>(j.out) + i, out, r * 2);
  }
};

// One call's buffers, copied out of the Job into a local: stores through them
// then cannot alias the pointers, so the loop never reloads them.
struct Ptrs {
  float* p;
  const void* g;
  void* m;
  void* v;
  void* out;
  explicit Ptrs(const Job& j) : p(j.p), g(j.g), m(j.m), v(j.v), out(j.out) {}
};

// The vector loops take U vectors per step, stage by stage (all loads, then each
// operation for all U, then all stores): more independent loads in flight and
// more divides queued than one vector's dependency chain offers. Unrolling only
// regroups independent lanes; every lane's operations and rounding are unchanged.
#define MPO_UNROLL _Pragma("GCC unroll 8")

// ---------------------------------------------------------------- AVX2 (8)
// The AVX2 and AVX-512 bodies mirror each other line by line (and the scalar
// one): a target attribute cannot depend on a template parameter, so each ISA
// spells out its own intrinsics. Keep the three in the same operation order.
template <int T>
MPO_AVX2 inline __m256 load_avx2(const void* a, std::size_t i) {
  if constexpr (T == kF32) return _mm256_loadu_ps(static_cast<const float*>(a) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(a) + i));
  if constexpr (T == kF16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// bf16: integer round-to-nearest-even, NaN -> quiet NaN (f32_to_bf16 lane-wise).
MPO_AVX2 inline __m128i to_bf16_avx2(__m256 x) {
  const __m256i u = _mm256_castps_si256(x), hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <int T>
MPO_AVX2 inline void store_mom_avx2(void* a, std::size_t i, __m256 x) {
  if constexpr (T == kF32) _mm256_storeu_ps(static_cast<float*>(a) + i, x);
  else _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(a) + i), to_bf16_avx2(x));
}

template <int OT, bool NT>
MPO_AVX2 inline void store_out_avx2(void* out, std::size_t i, __m256 x) {
  if constexpr (OT == kNone) return;
  __m128i* dst = reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(out) + i);
  const __m128i h = OT == kF16 ? _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT) : to_bf16_avx2(x);
  if constexpr (NT) _mm_stream_si128(dst, h); else _mm_storeu_si128(dst, h);
}

struct C256 {
  __m256 gs, l2wd, decay, lw, b2, omb2, bc2s, ibc2s, eps, nstep;
  bool l2, lerp_end, scale, decay_on;  // scale/decay_on: grad_scale != 1 / decay != 1 (x * 1 == x exactly)
  MPO_AVX2 explicit C256(const Hyper& h)
      : gs(_mm256_set1_ps(h.grad_scale)), l2wd(_mm256_set1_ps(h.l2_wd)), decay(_mm256_set1_ps(h.decay)),
        lw(_mm256_set1_ps(h.lerp_w)), b2(_mm256_set1_ps(h.beta2)), omb2(_mm256_set1_ps(h.one_minus_beta2)),
        bc2s(_mm256_set1_ps(h.bc2_sqrt)), ibc2s(_mm256_set1_ps(h.inv_bc2_sqrt)), eps(_mm256_set1_ps(h.eps)),
        nstep(_mm256_set1_ps(h.neg_step)), l2(h.l2), lerp_end(h.lerp_end), scale(h.grad_scale != 1.0f),
        decay_on(h.decay != 1.0f) {}
};

// x / bc2_sqrt, correctly rounded, on the FMA units instead of the divider (see DIV_BC2).
MPO_AVX2 inline __m256 div_bc2_avx2(__m256 x, const C256& c) {
  const __m256 q0 = _mm256_mul_ps(x, c.ibc2s);
  const __m256 q1 = _mm256_fmadd_ps(_mm256_fnmadd_ps(q0, c.bc2s, x), c.ibc2s, q0);
  const __m256 q2 = _mm256_fmadd_ps(_mm256_fnmadd_ps(q1, c.bc2s, x), c.ibc2s, q1);
  const __m256 special = _mm256_cmp_ps(x, _mm256_set1_ps(HUGE_VALF), _CMP_NLT_UQ);  // +inf or NaN
  if (__builtin_expect(_mm256_movemask_ps(special) != 0, 0)) return _mm256_div_ps(x, c.bc2s);
  return q2;
}

template <int GT, int MT, int VT, int OT, bool PROBE, bool NT, int U>
MPO_AVX2 inline void body_avx2(const Ptrs& s, const C256& c, std::size_t i) {
  __m256 g[U], p[U], m[U], v[U];
  MPO_UNROLL for (int u = 0; u < U; ++u) g[u] = load_avx2<GT>(s.g, i + 8 * u);
  MPO_UNROLL for (int u = 0; u < U; ++u) p[u] = _mm256_loadu_ps(s.p + i + 8 * u);
  MPO_UNROLL for (int u = 0; u < U; ++u) m[u] = load_avx2<MT>(s.m, i + 8 * u);
  MPO_UNROLL for (int u = 0; u < U; ++u) v[u] = load_avx2<VT>(s.v, i + 8 * u);
  if (c.scale) MPO_UNROLL for (int u = 0; u < U; ++u) g[u] = _mm256_mul_ps(g[u], c.gs);
  if constexpr (PROBE) {
    MPO_UNROLL for (int u = 0; u < U; ++u) {
      m[u] = _mm256_add_ps(m[u], g[u]); v[u] = _mm256_add_ps(v[u], g[u]); p[u] = _mm256_add_ps(p[u], g[u]);
    }
  } else {
    if (c.l2) MPO_UNROLL for (int u = 0; u < U; ++u) g[u] = _mm256_fmadd_ps(c.l2wd, p[u], g[u]);
    if (c.decay_on) MPO_UNROLL for (int u = 0; u < U; ++u) p[u] = _mm256_mul_ps(p[u], c.decay);
    MPO_UNROLL for (int u = 0; u < U; ++u) m[u] = _mm256_fmadd_ps(c.lw, _mm256_sub_ps(g[u], m[u]), c.lerp_end ? g[u] : m[u]);
    MPO_UNROLL for (int u = 0; u < U; ++u)
      v[u] = _mm256_fmadd_ps(_mm256_mul_ps(c.omb2, g[u]), g[u], _mm256_mul_ps(v[u], c.b2));
    __m256 d[U];
    MPO_UNROLL for (int u = 0; u < U; ++u) d[u] = _mm256_add_ps(div_bc2_avx2(_mm256_sqrt_ps(v[u]), c), c.eps);
    MPO_UNROLL for (int u = 0; u < U; ++u) p[u] = _mm256_add_ps(p[u], _mm256_div_ps(_mm256_mul_ps(c.nstep, m[u]), d[u]));
  }
  MPO_UNROLL for (int u = 0; u < U; ++u) _mm256_storeu_ps(s.p + i + 8 * u, p[u]);
  MPO_UNROLL for (int u = 0; u < U; ++u) store_mom_avx2<MT>(s.m, i + 8 * u, m[u]);
  MPO_UNROLL for (int u = 0; u < U; ++u) store_mom_avx2<VT>(s.v, i + 8 * u, v[u]);
  MPO_UNROLL for (int u = 0; u < U; ++u) store_out_avx2<OT, NT>(s.out, i + 8 * u, p[u]);
}

template <int GT, int MT, int VT, int OT, bool PROBE>
MPO_AVX2 void piece_avx2(const Job& j, const C256& c, std::size_t i, std::size_t r) {
  TailBuf<8> t;
  const Ptrs s(t.load(j, GT, MT, VT, i, r));
  body_avx2<GT, MT, VT, OT, PROBE, false, 1>(s, c, 0);
  t.store(j, MT, VT, i, r);
}

constexpr int kUnrollAVX2 = 2;  // 16 ymm registers: two vectors' state fits without spills

template <int GT, int MT, int VT, int OT, bool PROBE, bool NT>
MPO_AVX2 std::size_t loop_avx2(const Ptrs& s, const C256& c, std::size_t i, std::size_t e) {
  constexpr int U = kUnrollAVX2;
  for (; i + 8 * U <= e; i += 8 * U) body_avx2<GT, MT, VT, OT, PROBE, NT, U>(s, c, i);
  for (; i + 8 <= e; i += 8) body_avx2<GT, MT, VT, OT, PROBE, NT, 1>(s, c, i);
  if constexpr (NT) _mm_sfence();  // order the streaming stores before anyone reads param_out
  return i;
}

template <int GT, int MT, int VT, int OT, bool PROBE>
MPO_AVX2 void tile_avx2(const Job& j, std::size_t b, std::size_t e) {
  const C256 c(j.h);
  const Ptrs s(j);
  std::size_t i = b;
  // Peel up to the param's next 32-byte boundary: no vector load splits a cache line.
  const std::size_t head = std::min(e - i, (8 - (reinterpret_cast<std::uintptr_t>(j.p + i) / 4) % 8) % 8);
  if (head) piece_avx2<GT, MT, VT, OT, PROBE>(j, c, i, head);
  i += head;
  if (OT != kNone && reinterpret_cast<std::uintptr_t>(static_cast<std::uint16_t*>(j.out) + i) % 16 == 0)
    i = loop_avx2<GT, MT, VT, OT, PROBE, true>(s, c, i, e);  // param_out is write-only: stream it
  else
    i = loop_avx2<GT, MT, VT, OT, PROBE, false>(s, c, i, e);
  if (i < e) piece_avx2<GT, MT, VT, OT, PROBE>(j, c, i, e - i);
}

// ------------------------------------------------------------- AVX-512 (16)
template <int T>
MPO_AVX512 inline __m512 load_avx512(const void* a, std::size_t i) {
  if constexpr (T == kF32) return _mm512_loadu_ps(static_cast<const float*>(a) + i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(a) + i));
  if constexpr (T == kF16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

MPO_AVX512 inline __m256i to_bf16_avx512(__m512 x) {
  const __m512i u = _mm512_castps_si512(x), hi = _mm512_srli_epi32(u, 16);
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));  // NaN lanes: hi | quiet bit
  return _mm512_cvtepi32_epi16(r);  // values fit in 16 bits
}

template <int T>
MPO_AVX512 inline void store_mom_avx512(void* a, std::size_t i, __m512 x) {
  if constexpr (T == kF32) _mm512_storeu_ps(static_cast<float*>(a) + i, x);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(a) + i), to_bf16_avx512(x));
}

template <int OT, bool NT>
MPO_AVX512 inline void store_out_avx512(void* out, std::size_t i, __m512 x) {
  if constexpr (OT == kNone) return;
  __m256i* dst = reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(out) + i);
  const __m256i h =
      OT == kF16 ? _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC) : to_bf16_avx512(x);
  if constexpr (NT) _mm256_stream_si256(dst, h); else _mm256_storeu_si256(dst, h);
}

struct C512 {
  __m512 gs, l2wd, decay, lw, b2, omb2, bc2s, ibc2s, eps, nstep;
  bool l2, lerp_end, scale, decay_on;  // scale/decay_on: grad_scale != 1 / decay != 1 (x * 1 == x exactly)
  MPO_AVX512 explicit C512(const Hyper& h)
      : gs(_mm512_set1_ps(h.grad_scale)), l2wd(_mm512_set1_ps(h.l2_wd)), decay(_mm512_set1_ps(h.decay)),
        lw(_mm512_set1_ps(h.lerp_w)), b2(_mm512_set1_ps(h.beta2)), omb2(_mm512_set1_ps(h.one_minus_beta2)),
        bc2s(_mm512_set1_ps(h.bc2_sqrt)), ibc2s(_mm512_set1_ps(h.inv_bc2_sqrt)), eps(_mm512_set1_ps(h.eps)),
        nstep(_mm512_set1_ps(h.neg_step)), l2(h.l2), lerp_end(h.lerp_end), scale(h.grad_scale != 1.0f),
        decay_on(h.decay != 1.0f) {}
};

MPO_AVX512 inline __m512 div_bc2_avx512(__m512 x, const C512& c) {
  const __m512 q0 = _mm512_mul_ps(x, c.ibc2s);
  const __m512 q1 = _mm512_fmadd_ps(_mm512_fnmadd_ps(q0, c.bc2s, x), c.ibc2s, q0);
  const __m512 q2 = _mm512_fmadd_ps(_mm512_fnmadd_ps(q1, c.bc2s, x), c.ibc2s, q1);
  const __mmask16 special = _mm512_cmp_ps_mask(x, _mm512_set1_ps(HUGE_VALF), _CMP_NLT_UQ);  // +inf or NaN
  if (__builtin_expect(special != 0, 0)) return _mm512_div_ps(x, c.bc2s);
  return q2;
}

template <int GT, int MT, int VT, int OT, bool PROBE, bool NT, int U>
MPO_AVX512 inline void body_avx512(const Ptrs& s, const C512& c, std::size_t i) {
  __m512 g[U], p[U], m[U], v[U];
  MPO_UNROLL for (int u = 0; u < U; ++u) g[u] = load_avx512<GT>(s.g, i + 16 * u);
  MPO_UNROLL for (int u = 0; u < U; ++u) p[u] = _mm512_loadu_ps(s.p + i + 16 * u);
  MPO_UNROLL for (int u = 0; u < U; ++u) m[u] = load_avx512<MT>(s.m, i + 16 * u);
  MPO_UNROLL for (int u = 0; u < U; ++u) v[u] = load_avx512<VT>(s.v, i + 16 * u);
  if (c.scale) MPO_UNROLL for (int u = 0; u < U; ++u) g[u] = _mm512_mul_ps(g[u], c.gs);
  if constexpr (PROBE) {
    MPO_UNROLL for (int u = 0; u < U; ++u) {
      m[u] = _mm512_add_ps(m[u], g[u]); v[u] = _mm512_add_ps(v[u], g[u]); p[u] = _mm512_add_ps(p[u], g[u]);
    }
  } else {
    if (c.l2) MPO_UNROLL for (int u = 0; u < U; ++u) g[u] = _mm512_fmadd_ps(c.l2wd, p[u], g[u]);
    if (c.decay_on) MPO_UNROLL for (int u = 0; u < U; ++u) p[u] = _mm512_mul_ps(p[u], c.decay);
    MPO_UNROLL for (int u = 0; u < U; ++u) m[u] = _mm512_fmadd_ps(c.lw, _mm512_sub_ps(g[u], m[u]), c.lerp_end ? g[u] : m[u]);
    MPO_UNROLL for (int u = 0; u < U; ++u)
      v[u] = _mm512_fmadd_ps(_mm512_mul_ps(c.omb2, g[u]), g[u], _mm512_mul_ps(v[u], c.b2));
    __m512 d[U];
    MPO_UNROLL for (int u = 0; u < U; ++u) d[u] = _mm512_add_ps(div_bc2_avx512(_mm512_sqrt_ps(v[u]), c), c.eps);
    MPO_UNROLL for (int u = 0; u < U; ++u) p[u] = _mm512_add_ps(p[u], _mm512_div_ps(_mm512_mul_ps(c.nstep, m[u]), d[u]));
  }
  MPO_UNROLL for (int u = 0; u < U; ++u) _mm512_storeu_ps(s.p + i + 16 * u, p[u]);
  MPO_UNROLL for (int u = 0; u < U; ++u) store_mom_avx512<MT>(s.m, i + 16 * u, m[u]);
  MPO_UNROLL for (int u = 0; u < U; ++u) store_mom_avx512<VT>(s.v, i + 16 * u, v[u]);
  MPO_UNROLL for (int u = 0; u < U; ++u) store_out_avx512<OT, NT>(s.out, i + 16 * u, p[u]);
}

template <int GT, int MT, int VT, int OT, bool PROBE>
MPO_AVX512 void piece_avx512(const Job& j, const C512& c, std::size_t i, std::size_t r) {
  TailBuf<16> t;
  const Ptrs s(t.load(j, GT, MT, VT, i, r));
  body_avx512<GT, MT, VT, OT, PROBE, false, 1>(s, c, 0);
  t.store(j, MT, VT, i, r);
}

constexpr int kUnrollAVX512 = 4;  // measured on Zen 4: 4 > 8 (spills) ~ 1 in cache, 4 best from DRAM

template <int GT, int MT, int VT, int OT, bool PROBE, bool NT>
MPO_AVX512 std::size_t loop_avx512(const Ptrs& s, const C512& c, std::size_t i, std::size_t e) {
  constexpr int U = kUnrollAVX512;
  for (; i + 16 * U <= e; i += 16 * U) body_avx512<GT, MT, VT, OT, PROBE, NT, U>(s, c, i);
  for (; i + 16 <= e; i += 16) body_avx512<GT, MT, VT, OT, PROBE, NT, 1>(s, c, i);
  if constexpr (NT) _mm_sfence();  // order the streaming stores before anyone reads param_out
  return i;
}

template <int GT, int MT, int VT, int OT, bool PROBE>
MPO_AVX512 void tile_avx512(const Job& j, std::size_t b, std::size_t e) {
  const C512 c(j.h);
  const Ptrs s(j);
  std::size_t i = b;
  // Peel up to the param's next 64-byte boundary: no vector load splits a cache line.
  const std::size_t head = std::min(e - i, (16 - (reinterpret_cast<std::uintptr_t>(j.p + i) / 4) % 16) % 16);
  if (head) piece_avx512<GT, MT, VT, OT, PROBE>(j, c, i, head);
  i += head;
  if (OT != kNone && reinterpret_cast<std::uintptr_t>(static_cast<std::uint16_t*>(j.out) + i) % 32 == 0)
    i = loop_avx512<GT, MT, VT, OT, PROBE, true>(s, c, i, e);  // param_out is write-only: stream it
  else
    i = loop_avx512<GT, MT, VT, OT, PROBE, false>(s, c, i, e);
  if (i < e) piece_avx512<GT, MT, VT, OT, PROBE>(j, c, i, e - i);
}
#endif  // MPO_X86

// --------------------------------------------------------------- dispatch
using TileFn = void (*)(const Job&, std::size_t, std::size_t);

template <int GT, int MT, int VT, int OT, bool PROBE>
TileFn pick_level(int level) {
#if defined(MPO_X86)
  if (level == kAVX512) return &tile_avx512<GT, MT, VT, OT, PROBE>;
  if (level == kAVX2) return &tile_avx2<GT, MT, VT, OT, PROBE>;
#endif
  (void)level;
  return &tile_scalar<GT, MT, VT, OT, PROBE>;
}

template <int GT, int MT, int VT, bool PROBE>
TileFn pick_out(int level, int ot) {
  if (ot == kF16) return pick_level<GT, MT, VT, kF16, PROBE>(level);
  if (ot == kBF16) return pick_level<GT, MT, VT, kBF16, PROBE>(level);
  return pick_level<GT, MT, VT, kNone, PROBE>(level);
}

template <int GT, int MT, bool PROBE>
TileFn pick_v(int level, int vt, int ot) {
  return vt == kBF16 ? pick_out<GT, MT, kBF16, PROBE>(level, ot) : pick_out<GT, MT, kF32, PROBE>(level, ot);
}

template <int GT, bool PROBE>
TileFn pick_m(int level, int mt, int vt, int ot) {
  return mt == kBF16 ? pick_v<GT, kBF16, PROBE>(level, vt, ot) : pick_v<GT, kF32, PROBE>(level, vt, ot);
}

template <bool PROBE>
TileFn pick(int level, int gt, int mt, int vt, int ot) {
  if (gt == kF16) return pick_m<kF16, PROBE>(level, mt, vt, ot);
  if (gt == kBF16) return pick_m<kBF16, PROBE>(level, mt, vt, ot);
  return pick_m<kF32, PROBE>(level, mt, vt, ot);
}

bool level_supported(int level) {
#if defined(MPO_X86)
  __builtin_cpu_init();
  if (level == kAVX512) return __builtin_cpu_supports("avx512f") && level_supported(kAVX2);
  if (level == kAVX2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
  return level == kScalar;
}

int best_level() {
  for (int l = kAVX512; l > kScalar; --l)
    if (level_supported(l)) return l;
  return kScalar;
}

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

int parse_level(const std::string& name) {
  if (name == "auto") return best_level();
  for (int l = kScalar; l <= kAVX512; ++l)
    if (name == kLevelNames[l]) {
      if (!level_supported(l))
        throw std::runtime_error("SIMD level '" + name + "' is not supported by this CPU/build");
      return l;
    }
  throw std::invalid_argument("unknown SIMD level '" + name + "' (expected scalar, avx2, avx512 or auto)");
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
  m.def("available_simd_levels", []() {
    std::vector<std::string> out;
    for (int l = kScalar; l <= kAVX512; ++l)
      if (level_supported(l)) out.emplace_back(kLevelNames[l]);
    return out;
  });
  m.def("set_simd_level", [](const std::string& name) { g_level = parse_level(name); }, py::arg("name"));
  m.def("set_num_threads", [](int n) {
    if (n < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(n));
    g_threads = n;
  }, py::arg("n"), "Threads the kernel asks for (a num_threads clause: OMP_NUM_THREADS does not cap it).");
  m.def("get_num_threads", []() { return g_threads; });
  m.def("last_num_threads", []() { return g_last_team; },
        "omp_get_num_threads() inside the parallel region of the last adam_step / stream_probe (0: none yet).");
}

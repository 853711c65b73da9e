// The Adam kernels behind csrc/cpu_adam.cpp: per-step constants, one tile
// (a range of elements) per SIMD level, and the dispatch from dtype codes to
// the template instance. Internal linkage as in simd.h.
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
// SPLIT. With remainders (OT == kRem) the fp32 master x lives as two uint16
// halves: hi, the bf16 param that goes to the device, and lo. The tile joins x
// from them, runs the very same step, and splits the new x back in place (no fp32
// param, no separate bf16 copy: 26 B/element with fp32 moments and bf16 grads,
// 18 with bf16 moments). With t = top half of x, a = |x| bits, r = lo >= 0x8000:
//   lo = low half of x;  hi = sign | ((t + r) mod 0x7f80) for finite x, t otherwise.
// For a fixed sign and lo this permutes the 15-bit magnitudes (a cyclic shift of
// the 0x7f80 finite ones, the identity on inf/NaN), so it is a bijection on all
// 2^32 patterns; join_hi_lo is its inverse. hi equals round-to-nearest-even except
// (1) exact ties (lo == 0x8000) under an even t: away from zero (RNE goes to even);
// (2) |x| >= 0x7f7f8000, which RNE sends to inf: hi = +-0; (3) a signalling NaN:
// its top half (RNE forces the quiet bit), +-inf if its payload is all in lo.
// No bijection does better: 0x7f7f is the nearest finite bf16 of 3 * 2^15 floats
// but offers 2^16 lo codes, and the finite and inf/NaN classes are each exactly
// full, so the surplus must go to the one free finite code, hi = +-0 with r = 1.
// adam_step's bf16_rounding = split (OT == kBF16Split) rounds a param_out the same way.
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
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "simd.h"
#include "simd_level.h"

namespace {

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

// OUT OF PLACE (adam_step's *_dst): the step reads the state at Src and writes
// it at the Job's own addresses, which then only take stores (streamed when
// aligned, see stream_all): the bytes of the in-place step. Null: in place.
struct Src {
  const float* p = nullptr;
  const void* m = nullptr;
  const void* v = nullptr;
  const std::uint16_t* hi = nullptr;  // with remainders
  const std::uint16_t* lo = nullptr;
};

// Moments are float* or uint16_t* (bf16) as the tile's template says. With
// OT == kRem there is no fp32 param (p is null): out holds hi, lo the remainders.
// These are where the step writes; it reads there too unless src says otherwise.
struct Job {
  float* p;
  const void* g;
  void* m;
  void* v;
  void* out;
  std::uint16_t* lo;
  Hyper h;
  Src src{};
  bool in_l1 = false;  // stack blocks (8-bit moments): compute-bound, the 4-vector AVX-512 step
};

// Where a tile reads each stream: src's address, or the written one in place.
struct Reads {
  const float* p;
  const void* m;
  const void* v;
  const std::uint16_t* hi;
  const std::uint16_t* lo;
  explicit Reads(const Job& j)
      : p(j.src.p ? j.src.p : j.p), m(j.src.m ? j.src.m : j.m), v(j.src.v ? j.src.v : j.v),
        hi(j.src.hi ? j.src.hi : static_cast<const std::uint16_t*>(j.out)), lo(j.src.lo ? j.src.lo : j.lo) {}
};

template <int GT, int MT, int VT, int OT, bool PROBE>
void tile_scalar(const Job& j, std::size_t b, std::size_t e) {
  const Hyper h = j.h;  // locals: stores through the buffers cannot alias them
  const Reads r(j);
  float* const pp = j.p;
  const void* const gp = j.g;
  void* const mp = j.m;
  void* const vp = j.v;
  void* const op = j.out;
  std::uint16_t* const lp = j.lo;
  for (std::size_t i = b; i < e; ++i) {
    float g = load_scalar<GT>(gp, i) * h.grad_scale;
    float p = OT == kRem ? join_hi_lo(r.hi[i], r.lo[i]) : r.p[i];
    float m = load_scalar<MT>(r.m, i), v = load_scalar<VT>(r.v, i);
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
    if constexpr (OT != kRem) pp[i] = p;
    store_scalar<MT, false>(mp, i, m);
    store_scalar<VT, false>(vp, i, v);
    if constexpr (OT == kRem) {
      static_cast<std::uint16_t*>(op)[i] = split_hi(p);
      lp[i] = split_lo(p);
    } else {
      store_scalar<OT, true>(op, i, p);
    }
  }
}

#if defined(MPO_X86)
// Pieces shorter than a vector (a range's ragged head or tail) go through
// zero-padded stack buffers so they run the very same vector code (identical
// rounding, no masked loads/stores needed).
template <int W>
struct TailBuf {
  alignas(64) float p[W] = {}, g[W] = {}, m[W] = {}, v[W] = {};
  alignas(64) std::uint16_t out[W] = {}, lo[W] = {};
  // With remainders (j.lo set) hi (in out) and lo are read as well as written.
  // Read from the sources, stepped in place here, stored to the Job's addresses.
  Job load(const Job& j, int gt, int mt, int vt, std::size_t i, std::size_t r) {
    const Reads s(j);
    if (j.p) std::memcpy(p, s.p + i, r * 4);
    if (j.lo) std::memcpy(out, s.hi + i, r * 2);
    if (j.lo) std::memcpy(lo, s.lo + i, r * 2);
    std::memcpy(g, static_cast<const char*>(j.g) + i * dsize(gt), r * dsize(gt));
    std::memcpy(m, static_cast<const char*>(s.m) + i * dsize(mt), r * dsize(mt));
    std::memcpy(v, static_cast<const char*>(s.v) + i * dsize(vt), r * dsize(vt));
    Job t = j;
    t.p = p; t.g = g; t.m = m; t.v = v; t.out = j.out ? out : nullptr; t.lo = j.lo ? lo : nullptr;
    t.src = Src{};
    return t;
  }
  void store(const Job& j, int mt, int vt, std::size_t i, std::size_t r) const {
    if (j.p) std::memcpy(j.p + i, p, r * 4);
    std::memcpy(static_cast<char*>(j.m) + i * dsize(mt), m, r * dsize(mt));
    std::memcpy(static_cast<char*>(j.v) + i * dsize(vt), v, r * dsize(vt));
    if (j.out) std::memcpy(static_cast<std::uint16_t*>(j.out) + i, out, r * 2);
    if (j.lo) std::memcpy(j.lo + i, lo, r * 2);
  }
};

// Elements from i up to the param's next W-element boundary (W * 4 bytes of the
// fp32 param, W * 2 of hi with remainders): no vector load then splits a cache line.
template <int W, int OT>
std::size_t head_len(const Job& j, std::size_t i, std::size_t e) {
  const std::uintptr_t at = OT == kRem ? reinterpret_cast<std::uintptr_t>(static_cast<std::uint16_t*>(j.out) + i) / 2
                                       : reinterpret_cast<std::uintptr_t>(j.p + i) / 4;
  return std::min(e - i, (W - at % W) % W);
}

// Which stores stream (non-temporal): none, param_out (write-only: streamed when
// aligned; never with remainders in place, hi is read too), or, out of place, every
// store (all write-only), when every written stream is aligned to its vector there.
enum : int { kStreamNone = 0, kStreamOut = 1, kStreamAll = 2 };

template <int OT, int ALIGN>
bool stream_out(const Job& j, std::size_t i) {
  return OT != kNone && OT != kRem && reinterpret_cast<std::uintptr_t>(static_cast<std::uint16_t*>(j.out) + i) % ALIGN == 0;
}

template <int W, int MT, int VT, int OT>
bool stream_all(const Job& j, std::size_t i) {
  const auto at = [i](const void* a, std::size_t es) {  // element i of a, es bytes each, on W * 4 bytes
    return !a || reinterpret_cast<std::uintptr_t>(static_cast<const char*>(a) + i * es) % (W * 4) == 0;
  };
  return j.src.m && at(OT == kRem ? nullptr : j.p, 4) && at(j.m, dsize(MT)) && at(j.v, dsize(VT)) &&
         at(OT == kNone ? nullptr : j.out, 2) && at(OT == kRem ? j.lo : nullptr, 2);
}

// One call's buffers, copied out of the Job into a local: stores through them
// then cannot alias the pointers, so the loop never reloads them.
struct Ptrs {
  float* p;
  const void* g;
  void* m;
  void* v;
  void* out;
  std::uint16_t* lo;
  Reads r;
  explicit Ptrs(const Job& j) : p(j.p), g(j.g), m(j.m), v(j.v), out(j.out), lo(j.lo), r(j) {}
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

// The param: fp32, or joined from / split into (hi, lo) with remainders.
template <int OT>
MPO_AVX2 inline __m256 load_p_avx2(const Ptrs& s, std::size_t i) {
  if constexpr (OT != kRem) return _mm256_loadu_ps(s.r.p + i);
  else
    return join_avx2(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.r.hi + i)),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s.r.lo + i)));
}

template <int OT, int NT>
MPO_AVX2 inline void store_p_avx2(const Ptrs& s, std::size_t i, __m256 p) {
  if constexpr (OT != kRem) {
    if constexpr (OT != kNone) store_out_avx2<OT, NT != kStreamNone>(s.out, i, p);
  } else {
    __m128i hi, lo;
    split_avx2(p, &hi, &lo);
    put_avx2<NT == kStreamAll>(static_cast<std::uint16_t*>(s.out) + i, hi);
    put_avx2<NT == kStreamAll>(s.lo + i, lo);
  }
}

template <int GT, int MT, int VT, int OT, bool PROBE, int NT, int U>
MPO_AVX2 inline void body_avx2(const Ptrs& s, const C256& c, std::size_t i) {
  __m256 g[U], p[U], m[U], v[U];
  MPO_UNROLL for (int u = 0; u < U; ++u) g[u] = load_avx2<GT>(s.g, i + 8 * u);
  MPO_UNROLL for (int u = 0; u < U; ++u) p[u] = load_p_avx2<OT>(s, i + 8 * u);
  MPO_UNROLL for (int u = 0; u < U; ++u) m[u] = load_avx2<MT>(s.r.m, i + 8 * u);
  MPO_UNROLL for (int u = 0; u < U; ++u) v[u] = load_avx2<VT>(s.r.v, i + 8 * u);
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
  constexpr bool all = NT == kStreamAll;
  if constexpr (OT != kRem) MPO_UNROLL for (int u = 0; u < U; ++u) put_avx2<all>(s.p + i + 8 * u, p[u]);
  MPO_UNROLL for (int u = 0; u < U; ++u) store_mom_avx2<MT, all>(s.m, i + 8 * u, m[u]);
  MPO_UNROLL for (int u = 0; u < U; ++u) store_mom_avx2<VT, all>(s.v, i + 8 * u, v[u]);
  MPO_UNROLL for (int u = 0; u < U; ++u) store_p_avx2<OT, NT>(s, i + 8 * u, p[u]);
}

template <int GT, int MT, int VT, int OT, bool PROBE>
MPO_AVX2 void piece_avx2(const Job& j, const C256& c, std::size_t i, std::size_t r) {
  TailBuf<8> t;
  const Ptrs s(t.load(j, GT, MT, VT, i, r));
  body_avx2<GT, MT, VT, OT, PROBE, kStreamNone, 1>(s, c, 0);
  t.store(j, MT, VT, i, r);
}

constexpr int kUnrollAVX2 = 2;  // 16 ymm registers: two vectors' state fits without spills

template <int GT, int MT, int VT, int OT, bool PROBE, int NT>
MPO_AVX2 std::size_t loop_avx2(const Ptrs& s, const C256& c, std::size_t i, std::size_t e) {
  constexpr int U = kUnrollAVX2;
  for (; i + 8 * U <= e; i += 8 * U) body_avx2<GT, MT, VT, OT, PROBE, NT, U>(s, c, i);
  for (; i + 8 <= e; i += 8) body_avx2<GT, MT, VT, OT, PROBE, NT, 1>(s, c, i);
  if constexpr (NT != kStreamNone) _mm_sfence();  // order the streaming stores before anyone reads them
  return i;
}

template <int GT, int MT, int VT, int OT, bool PROBE>
MPO_AVX2 void tile_avx2(const Job& j, std::size_t b, std::size_t e) {
  const C256 c(j.h);
  const Ptrs s(j);
  std::size_t i = b;
  const std::size_t head = head_len<8, OT>(j, i, e);
  if (head) piece_avx2<GT, MT, VT, OT, PROBE>(j, c, i, head);
  i += head;
  if (!PROBE && stream_all<8, MT, VT, OT>(j, i))
    i = loop_avx2<GT, MT, VT, OT, PROBE, PROBE ? kStreamNone : kStreamAll>(s, c, i, e);
  else if (stream_out<OT, 16>(j, i))
    i = loop_avx2<GT, MT, VT, OT, PROBE, kStreamOut>(s, c, i, e);
  else
    i = loop_avx2<GT, MT, VT, OT, PROBE, kStreamNone>(s, c, i, e);
  if (i < e) piece_avx2<GT, MT, VT, OT, PROBE>(j, c, i, e - i);
}

// ------------------------------------------------------------- AVX-512 (16)

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

template <int OT>
MPO_AVX512 inline __m512 load_p_avx512(const Ptrs& s, std::size_t i) {
  if constexpr (OT != kRem) return _mm512_loadu_ps(s.r.p + i);
  else
    return join_avx512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.r.hi + i)),
                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.r.lo + i)));
}

template <int OT, int NT>
MPO_AVX512 inline void store_p_avx512(const Ptrs& s, std::size_t i, __m512 p) {
  if constexpr (OT != kRem) {
    if constexpr (OT != kNone) store_out_avx512<OT, NT != kStreamNone>(s.out, i, p);
  } else {
    __m256i hi, lo;
    split_avx512(p, &hi, &lo);
    put_avx512<NT == kStreamAll>(static_cast<std::uint16_t*>(s.out) + i, hi);
    put_avx512<NT == kStreamAll>(s.lo + i, lo);
  }
}

// The step on U vectors of loaded state (the lanes in any order: each is its own element).
// Forced inline: called out of line (GCC's choice once two bodies share it), its vectors
// went through memory and every AVX-512 row lost ~10%.
template <bool PROBE, int U>
MPO_AVX512 inline __attribute__((always_inline)) void math_avx512(const C512& c, __m512* g, __m512* p, __m512* m, __m512* v) {
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
}

template <int GT, int MT, int VT, int OT, bool PROBE, int NT, int U>
MPO_AVX512 inline void body_avx512(const Ptrs& s, const C512& c, std::size_t i) {
  __m512 g[U], p[U], m[U], v[U];
  MPO_UNROLL for (int u = 0; u < U; ++u) g[u] = load_avx512<GT>(s.g, i + 16 * u);
  MPO_UNROLL for (int u = 0; u < U; ++u) p[u] = load_p_avx512<OT>(s, i + 16 * u);
  MPO_UNROLL for (int u = 0; u < U; ++u) m[u] = load_avx512<MT>(s.r.m, i + 16 * u);
  MPO_UNROLL for (int u = 0; u < U; ++u) v[u] = load_avx512<VT>(s.r.v, i + 16 * u);
  math_avx512<PROBE, U>(c, g, p, m, v);
  constexpr bool all = NT == kStreamAll;
  if constexpr (OT != kRem) MPO_UNROLL for (int u = 0; u < U; ++u) put_avx512<all>(s.p + i + 16 * u, p[u]);
  MPO_UNROLL for (int u = 0; u < U; ++u) store_mom_avx512<MT, all>(s.m, i + 16 * u, m[u]);
  MPO_UNROLL for (int u = 0; u < U; ++u) store_mom_avx512<VT, all>(s.v, i + 16 * u, v[u]);
  MPO_UNROLL for (int u = 0; u < U; ++u) store_p_avx512<OT, NT>(s, i + 16 * u, p[u]);
}

template <int GT, int MT, int VT, int OT, bool PROBE>
MPO_AVX512 void piece_avx512(const Job& j, const C512& c, std::size_t i, std::size_t r) {
  TailBuf<16> t;
  const Ptrs s(t.load(j, GT, MT, VT, i, r));
  body_avx512<GT, MT, VT, OT, PROBE, kStreamNone, 1>(s, c, 0);
  t.store(j, MT, VT, i, r);
}

// With remainders: 32 elements in two vectors, even and odd (EVEN/ODD in simd.h), U2 pairs a step.
template <int GT, int MT, int VT, int NT, int U2>
MPO_AVX512 inline void body_rem_avx512(const Ptrs& s, const C512& c, std::size_t i) {
  constexpr int U = 2 * U2;
  constexpr bool all = NT == kStreamAll;
  __m512 g[U], p[U], m[U], v[U];
  MPO_UNROLL for (int u = 0; u < U2; ++u) load_eo_avx512<GT>(s.g, i + 32 * u, g + 2 * u);
  MPO_UNROLL for (int u = 0; u < U2; ++u) join_eo_avx512(s.r.hi + i + 32 * u, s.r.lo + i + 32 * u, p + 2 * u);
  MPO_UNROLL for (int u = 0; u < U2; ++u) load_eo_avx512<MT>(s.r.m, i + 32 * u, m + 2 * u);
  MPO_UNROLL for (int u = 0; u < U2; ++u) load_eo_avx512<VT>(s.r.v, i + 32 * u, v + 2 * u);
  math_avx512<false, U>(c, g, p, m, v);
  MPO_UNROLL for (int u = 0; u < U2; ++u) store_eo_avx512<MT, all>(s.m, i + 32 * u, m + 2 * u);
  MPO_UNROLL for (int u = 0; u < U2; ++u) store_eo_avx512<VT, all>(s.v, i + 32 * u, v + 2 * u);
  MPO_UNROLL for (int u = 0; u < U2; ++u)
    split_eo_avx512<all>(p + 2 * u, static_cast<std::uint16_t*>(s.out) + i + 32 * u, s.lo + i + 32 * u);
}

// Vectors a step of the loops without remainders from DRAM, by CPU (set at import, see
// default_unroll_avx512; set_avx512_unroll for the tests): 4 on Zen 4 (4 > 8 (spills)
// ~ 1 in cache, 4 best from DRAM), 1 on the Intel Xeon test host, where 4 cost 4-14%
// there but won 4-8% on the 8-bit moments' L1 blocks (Job::in_l1: always 4; see
// docs/PERFORMANCE.md, 1b fifth look). Either gives the same bits.
constexpr int kUnrollAVX512 = 4;
inline int g_unroll_avx512 = kUnrollAVX512;  // 4 or 1
constexpr int kUnrollRemAVX512 = 2;  // pairs: the same 4 vectors of state a step

inline int default_unroll_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") ? kUnrollAVX512 : 1;
}

template <int GT, int MT, int VT, int OT, bool PROBE, int NT>
MPO_AVX512 std::size_t loop_avx512(const Ptrs& s, const C512& c, std::size_t i, std::size_t e, bool wide) {
  constexpr int U = kUnrollAVX512;
  if constexpr (OT == kRem && !PROBE) {
    constexpr int U2 = kUnrollRemAVX512;
    for (; i + 32 * U2 <= e; i += 32 * U2) body_rem_avx512<GT, MT, VT, NT, U2>(s, c, i);
    for (; i + 32 <= e; i += 32) body_rem_avx512<GT, MT, VT, NT, 1>(s, c, i);
  }
  if (wide)
    for (; i + 16 * U <= e; i += 16 * U) body_avx512<GT, MT, VT, OT, PROBE, NT, U>(s, c, i);
  for (; i + 16 <= e; i += 16) body_avx512<GT, MT, VT, OT, PROBE, NT, 1>(s, c, i);
  if constexpr (NT != kStreamNone) _mm_sfence();  // order the streaming stores before anyone reads them
  return i;
}

template <int GT, int MT, int VT, int OT, bool PROBE>
MPO_AVX512 void tile_avx512(const Job& j, std::size_t b, std::size_t e) {
  const C512 c(j.h);
  const Ptrs s(j);
  std::size_t i = b;
  // With remainders hi is peeled to a 64-byte line: its 512-bit loads and stores (EVEN/ODD) split none.
  const std::size_t head = head_len<OT == kRem ? 32 : 16, OT>(j, i, e);
  for (std::size_t h = 0; h < head; h += 16) piece_avx512<GT, MT, VT, OT, PROBE>(j, c, i + h, std::min<std::size_t>(16, head - h));
  i += head;
  const bool wide = j.in_l1 || g_unroll_avx512 == kUnrollAVX512;
  if (!PROBE && stream_all<16, MT, VT, OT>(j, i))
    i = loop_avx512<GT, MT, VT, OT, PROBE, PROBE ? kStreamNone : kStreamAll>(s, c, i, e, wide);
  else if (stream_out<OT, 32>(j, i))
    i = loop_avx512<GT, MT, VT, OT, PROBE, kStreamOut>(s, c, i, e, wide);
  else
    i = loop_avx512<GT, MT, VT, OT, PROBE, kStreamNone>(s, c, i, e, wide);
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
  if constexpr (!PROBE) {  // stream_probe has neither
    if (ot == kBF16Split) return pick_level<GT, MT, VT, kBF16Split, PROBE>(level);
    if (ot == kRem) return pick_level<GT, MT, VT, kRem, PROBE>(level);
  }
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

}  // namespace

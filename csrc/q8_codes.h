// Block-wise 8-bit Adam moments (Q8): one uint8 code per element and one fp32
// scale s, the block's absmax, per kQ8Block elements. Blocks are counted from
// element 0 of the arrays a call gets, so a block never straddles two calls
// (the Python face checks that a view starts on a block and ends on one, or at
// its storage's end).
//
// CODES. Both are logarithmic, 8 steps per octave (ratio r = 2^(1/8) = 1.0905),
// their top code is 1 (the absmax itself, stored exactly in s):
//   exp_avg:    bit 7 = sign, bits 0..6 = k; |m| = 0 (k = 0) or 2^((k - 127) / 8) s:
//               127 magnitudes over 2^15.75 = 5.5e4 (down to 1.8e-5 s).
//   exp_avg_sq: k = 0..255; v = 0 or 2^((k - 255) / 8) s: 255 steps over 2^31.75
//               = 3.6e9 in v, i.e. a log code of sqrt(v) with ratio 2^(1/16) over
//               the same 2^15.9 as exp_avg's (v ~ m^2), the range that decides the
//               step m / sqrt(v).
// Decoded value D_k = RN(value_k * s) (fp32). ERROR: a value inside the range is
// stored within one code step of itself (|D/x - 1| < r - 1 = 9.05%, 4.4% in
// sqrt(v)); with nearest rounding within half a step ((r - 1) / (r + 1) = 4.3%).
// Below the range an m may become 0 (its step becomes 0: harmless), but a v > 0
// never does: it gets code 1 at least (an overestimate: a smaller step), since a
// v of 0 under a non-zero m would make that element's step m / eps.
//
// THE FREEZE, and why the kernel does not round to nearest. Adam changes v by
// (1 - beta2)(g^2 - v) per step: 0.1% of v for beta2 = 0.999 unless g^2 > 44 v.
// Nearest rounding maps any change below half a code step back to the old code,
// so an element's v (its ratio to the block's absmax) never moves: a v that
// should decay stays large (its steps stall), one that should grow stays small
// (its steps grow up to 6.6x). m (beta1 = 0.9) freezes the same way within 43% of
// its grad. No 8-bit nearest code escapes this: a fixed point exists whenever
// the relative change is below (r - 1) / 2, and 256 codes with r = 1.002 span a
// range of only 1.7. So the kernel rounds with a deterministic dither: between
// the two codes around x it takes the upper one iff x lies above a point u of
// the way between them, with
//   u = (((j * 49471 + t * 37345 + salt) mod 2^16) | 1) / 2^16  in [2^-16, 1 - 2^-16],
// j the element's index in its block, t the step (salt 1 for exp_avg, 0 for
// exp_avg_sq). For one element u runs a Weyl sequence in t (equidistributed in
// (0, 1)), so over steps the code moves by the true change on average: the
// stored moments track the fp32 ones without random state, the same bits on any
// path, thread count or resume. quantize_8bit without a step rounds to nearest
// (u = 1/2).
//
// THE RULE, per block (every SIMD level and the scalar one compute it alike).
// Fast blocks, tiny <= s < 2^126 (value_1 * s and 1 / s normal): one divide per
// block, y = RN(|x| * RN(1 / s)). The float bits of y index 1/8 octaves
// (y_bits >> 20: exponent and top 3 mantissa bits); each 1/8 octave b of [1, 2)
// holds one code's mantissa M_(b+1) = RN(2^((b+1)/8)), or none (b = 7), so the
// code below y is c = (y_bits >> 20) + (mantissa > thr[b]) + koff, exactly
// (value_c <= y < value_(c+1)). With z = y's significand in [1, 2) and j = c's
// place in its octave: code c + 1 iff z - M_j > RN(G_j * u), G_j = M_(j+1) - M_j
// (both differences exact); below code 1 (c <= 0): code 1 iff y > RN(value_1 * u),
// else 0 (for exp_avg_sq: code 1 iff y > 0, see ERROR). Other blocks (tiny or huge
// scales, where decoded values may underflow and coincide): the same choice on the
// decoded values D_k = RN(value_k * s) by an exact search: c = the smallest code
// of the largest D <= |x|, n = the smallest code of the next larger D, code n iff
// |x| - D_c > RN((D_n - D_c) * u) (or, for exp_avg_sq, iff D_c = 0 < |x|).
//
// IDEMPOTENT. A decoded D_k of a fast block gives y within 2^-22.4 of value_k
// (two roundings), while u keeps every threshold more than 2^-19.5 value_k away
// from both codes: D_k encodes back to k whichever side of value_k y lands. In
// other blocks D_k - D_c = 0 is never above a threshold and the search returns
// the smallest code of each value, the one the encode wrote. The decoded block's
// absmax is D_top = s and a sign bit is set only on a non-zero magnitude, so
// quantize(dequantize(q)) == q, codes and scales, for any q the kernel writes.
// Non-finite moments: a block with an inf or NaN gets scale NaN (codes 0): it
// decodes to NaN, and back.
//
// Decode is arithmetic, no gather: w = k + 1, bits = mant[w & 7] + ((w >> 3) << 23)
// (an 8-entry permute), zero for k = 0, times s.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "simd.h"
#include "simd_level.h"

namespace {

constexpr std::size_t kQ8Block = 256;
constexpr int kQ8 = 5;  // moment dtype code: block-wise 8-bit (after the out codes of simd.h)

struct Q8Code {
  int levels = 0;                 // magnitudes: 128 (exp_avg, + a sign bit) or 256 (exp_avg_sq)
  float value[256] = {};          // what a code byte stands for: dec, signed by bit 7 for exp_avg
  std::int32_t mant[8] = {};      // bits of value[k] = mant[(k+1) & 7] + (((k+1) >> 3) << 23), k >= 1
  std::int32_t thr[8] = {};       // mantissa of the code in 1/8 octave b (0x800000: none), minus 1
  std::int32_t koff = 0;          // code below y = (y_bits >> 20) + [mantissa > thr] + koff
  float oct[8] = {}, gap[8] = {}; // M_j = RN(2^(j/8)) and M_(j+1) - M_j (M_8 = 2), j = (k + 1) & 7
  float tiny = 0.0f;              // smallest scale of the fast path: value[1] * tiny = 2^-126

  explicit Q8Code(int lv) : levels(lv) {
    const int noct = lv / 8;  // octaves: value[1] = 2^(2/8) * 2^-noct
    for (int j = 0; j < 8; ++j) {
      const float r = static_cast<float>(std::exp2(j / 8.0));  // RN(2^(j/8)), one mantissa per j
      mant[j] = static_cast<std::int32_t>(f2u(r)) - (noct << 23);
      oct[j] = r;
      gap[j] = (j < 7 ? static_cast<float>(std::exp2((j + 1) / 8.0)) : 2.0f) - r;
      thr[j] = j < 7 ? static_cast<std::int32_t>(f2u(static_cast<float>(std::exp2((j + 1) / 8.0))) & 0x7fffff) - 1
                     : 0x7fffff;
    }
    koff = (lv - 1) - 127 * 8;
    for (int k = 1; k < lv; ++k) value[k] = u2f(static_cast<std::uint32_t>(dec_bits(k)));
    if (lv == 128)
      for (int c = 128; c < 256; ++c) value[c] = -value[c - 128];
    tiny = std::ldexp(1.0f, -126) / value[1];
    tiny = tiny * value[1] < std::ldexp(1.0f, -126) ? std::nextafter(tiny, 1.0f) : tiny;
  }
  std::int32_t dec_bits(int k) const { return mant[(k + 1) & 7] + (((k + 1) >> 3) << 23); }
  int top() const { return levels - 1; }
  float dec(int k) const { return k ? u2f(static_cast<std::uint32_t>(dec_bits(k))) : 0.0f; }
};

const Q8Code kCodeM(128);   // exp_avg
const Q8Code kCodeV(256);   // exp_avg_sq

// The 256 values a code byte stands for (times the scale): the table tests share.
inline float q8_value(bool is_m, int c) { return (is_m ? kCodeM : kCodeV).value[c]; }

// The dither of one call (see THE FREEZE): u per element index in a block, for one
// moment at step t (t = 0: nearest, u = 1/2 everywhere).
// u1 = RN(value_1 * u): the threshold between codes 0 and 1 in y (0 for exp_avg_sq:
// a v > 0 never gets code 0).
struct Q8Round {
  alignas(64) float u[kQ8Block];
  alignas(64) float u1[kQ8Block];
  Q8Round(long long t, bool is_m) {
    const float v1 = (is_m ? kCodeM : kCodeV).value[1];
    for (std::size_t j = 0; j < kQ8Block; ++j) {
      const auto h = static_cast<std::uint32_t>(j * 49471u + static_cast<std::uint32_t>(t) * 37345u + (is_m ? 1u : 0u));
      u[j] = t == 0 ? 0.5f : static_cast<float>((h & 0xffffu) | 1u) * 0x1p-16f;
      u1[j] = is_m ? v1 * u[j] : 0.0f;
    }
  }
};

// Block absmax, or NaN if the block holds an inf or NaN (see CODES); elements [b, len)
// on top of a partial result (amax, bad) of [0, b). max is exact: any order, same bits.
inline float q8_absmax(const float* x, std::size_t len, std::size_t b = 0, float amax = 0.0f, bool bad = false) {
  for (std::size_t i = b; i < len; ++i) {
    const float a = std::fabs(x[i]);
    bad |= !(a <= std::numeric_limits<float>::max());
    amax = a > amax ? a : amax;
  }
  return bad ? std::numeric_limits<float>::quiet_NaN() : amax;
}

// codes -> RN(value * scale), elements [b, e); the SIMD versions do the same bits lane-wise.
inline void q8_decode_scalar(const std::uint8_t* codes, float scale, std::size_t b, std::size_t e, const Q8Code& c,
                             float* x) {
  for (std::size_t i = b; i < e; ++i) x[i] = c.value[codes[i]] * scale;
}

// The code byte of x given its (c, n) pair's decision (see THE FREEZE): sign only on k > 0.
inline std::uint8_t q8_byte(const Q8Code& c, float x, int k) {
  return static_cast<std::uint8_t>(k | ((c.levels == 128) & (x < 0.0f) & (k > 0)) << 7);
}

// Fast blocks (see THE RULE), elements [b, e): u = the dither, u1 = Q8Round::u1.
inline void q8_encode_scalar(const float* x, float inv, const float* u, const float* u1, std::size_t b, std::size_t e,
                             const Q8Code& c, std::uint8_t* codes) {
  for (std::size_t i = b; i < e; ++i) {
    const float y = std::fabs(x[i]) * inv;
    const std::int32_t yb = static_cast<std::int32_t>(f2u(y)), mant = yb & 0x7fffff;
    int k = (yb >> 20) + (mant > c.thr[(yb >> 20) & 7]) + c.koff;
    const int j = (k + 1) & 7;
    const float z = u2f(static_cast<std::uint32_t>(mant | 0x3f800000));
    k = k < 1 ? (y > u1[i]) : k + ((z - c.oct[j]) > c.gap[j] * u[i]);
    codes[i] = q8_byte(c, x[i], k);
  }
}

// Other blocks (see THE RULE), any finite s > 0: a binary search over the block's
// decoded values (which may coincide when they underflow).
inline void q8_encode_exact(const float* x, float s, const float* u, std::size_t len, const Q8Code& c,
                            std::uint8_t* codes) {
  float d[256];
  for (int k = 0; k < c.levels; ++k) d[k] = c.dec(k) * s;
  for (std::size_t i = 0; i < len; ++i) {
    const float a = std::fabs(x[i]);
    int lo = 0, hi = c.levels;  // d[lo] <= a < d[hi] (d[levels] = +inf)
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      (d[mid] <= a ? lo : hi) = mid;
    }
    while (lo > 0 && d[lo - 1] == d[lo]) --lo;  // the smallest code of that value
    int k = lo;
    if (hi < c.levels) {  // hi: the smallest code of the next larger value
      const float d0 = d[lo], d1 = d[hi];
      if ((a - d0) > (d1 - d0) * u[i] || (c.levels == 256 && d0 == 0.0f && a > 0.0f)) k = hi;
    }
    codes[i] = q8_byte(c, x[i], k);
  }
}

#if defined(MPO_X86)
MPO_AVX2 inline float q8_absmax_avx2(const float* x, std::size_t len) {
  const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(std::numeric_limits<float>::max());
  __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  std::size_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));
    amax = _mm256_max_ps(amax, a);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  return q8_absmax(x, len, i, q8_absmax(lanes, 8), _mm256_movemask_ps(bad) != 0);
}

// value[k] (magnitude, k in 0..top) lane-wise: the arithmetic decode.
MPO_AVX2 inline __m256 q8_mag_avx2(__m256i k, __m256i mant) {
  const __m256i w = _mm256_add_epi32(k, _mm256_set1_epi32(1));
  const __m256i bits = _mm256_add_epi32(_mm256_permutevar8x32_epi32(mant, w), _mm256_slli_epi32(_mm256_srli_epi32(w, 3), 23));
  return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpeq_epi32(k, _mm256_setzero_si256()), bits));
}

MPO_AVX2 inline std::size_t q8_decode_avx2(const std::uint8_t* codes, float scale, std::size_t len,
                                           const Q8Code& c, float* x) {
  const __m256 s = _mm256_set1_ps(scale);
  const __m256i mant = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.mant));
  const bool is_m = c.levels == 128;
  std::size_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
    const __m256i k = is_m ? _mm256_and_si256(b, _mm256_set1_epi32(0x7f)) : b;
    __m256 v = q8_mag_avx2(k, mant);
    if (is_m) v = _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(b, 7), 31)));
    _mm256_storeu_ps(x + i, _mm256_mul_ps(v, s));
  }
  return i;
}

MPO_AVX2 inline std::size_t q8_encode_avx2(const float* x, float inv, const float* u, const float* u1, std::size_t len,
                                           const Q8Code& c, std::uint8_t* codes) {
  const __m256 vinv = _mm256_set1_ps(inv), sign = _mm256_set1_ps(-0.0f);
  const __m256i thr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.thr));
  const __m256 oct = _mm256_loadu_ps(c.oct), gap = _mm256_loadu_ps(c.gap);
  const __m256i koff = _mm256_set1_epi32(c.koff), zero = _mm256_setzero_si256(), one = _mm256_set1_epi32(1);
  const __m256i mmask = _mm256_set1_epi32(0x7fffff), expo = _mm256_set1_epi32(0x3f800000);
  const bool is_m = c.levels == 128;
  std::size_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i), y = _mm256_mul_ps(_mm256_andnot_ps(sign, xv), vinv);
    const __m256i yb = _mm256_castps_si256(y), b = _mm256_srli_epi32(yb, 20), mant = _mm256_and_si256(yb, mmask);
    __m256i k = _mm256_sub_epi32(_mm256_add_epi32(b, koff), _mm256_cmpgt_epi32(mant, _mm256_permutevar8x32_epi32(thr, b)));
    const __m256i j = _mm256_add_epi32(k, one);  // the permutes take its low 3 bits
    const __m256 z = _mm256_castsi256_ps(_mm256_or_si256(mant, expo));
    const __m256 t = _mm256_mul_ps(_mm256_permutevar8x32_ps(gap, j), _mm256_loadu_ps(u + i));
    k = _mm256_sub_epi32(k, _mm256_castps_si256(_mm256_cmp_ps(_mm256_sub_ps(z, _mm256_permutevar8x32_ps(oct, j)), t, _CMP_GT_OQ)));
    const __m256i low = _mm256_cmpgt_epi32(one, k);  // c <= 0: code 1 iff y > u1
    const __m256i k01 = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(y, _mm256_loadu_ps(u1 + i), _CMP_GT_OQ)), one);
    k = _mm256_blendv_epi8(k, k01, low);
    if (is_m) {
      const __m256i neg = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(xv, _mm256_setzero_ps(), _CMP_LT_OQ)),
                                           _mm256_cmpgt_epi32(k, zero));
      k = _mm256_or_si256(k, _mm256_and_si256(neg, _mm256_set1_epi32(0x80)));
    }
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(k), _mm256_extracti128_si256(k, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packus_epi16(w, w));
  }
  return i;
}

MPO_AVX512 inline float q8_absmax_avx512(const float* x, std::size_t len) {
  const __m512 big = _mm512_set1_ps(std::numeric_limits<float>::max());
  __m512 amax = _mm512_setzero_ps();
  __mmask16 bad = 0;
  std::size_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
    bad |= _mm512_cmp_ps_mask(a, big, _CMP_NLE_UQ);
    amax = _mm512_max_ps(amax, a);
  }
  return q8_absmax(x, len, i, _mm512_reduce_max_ps(amax), bad != 0);
}

// The 8-entry tables twice over: vpermd takes the low 4 bits of the index.
MPO_AVX512 inline __m512i q8_table16(const std::int32_t* t) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
}

MPO_AVX512 inline __m512 q8_mag_avx512(__m512i k, __m512i mant) {
  const __m512i w = _mm512_add_epi32(k, _mm512_set1_epi32(1));
  const __m512i bits = _mm512_add_epi32(_mm512_permutexvar_epi32(w, mant), _mm512_slli_epi32(_mm512_srli_epi32(w, 3), 23));
  return _mm512_castsi512_ps(_mm512_maskz_mov_epi32(_mm512_test_epi32_mask(k, k), bits));
}

MPO_AVX512 inline std::size_t q8_decode_avx512(const std::uint8_t* codes, float scale, std::size_t len,
                                               const Q8Code& c, float* x) {
  const __m512 s = _mm512_set1_ps(scale);
  const __m512i mant = q8_table16(c.mant);
  const bool is_m = c.levels == 128;
  std::size_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    const __m512i k = is_m ? _mm512_and_si512(b, _mm512_set1_epi32(0x7f)) : b;
    __m512 v = q8_mag_avx512(k, mant);
    if (is_m) v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), _mm512_slli_epi32(_mm512_srli_epi32(b, 7), 31)));
    _mm512_storeu_ps(x + i, _mm512_mul_ps(v, s));
  }
  return i;
}

MPO_AVX512 inline std::size_t q8_encode_avx512(const float* x, float inv, const float* u, const float* u1,
                                               std::size_t len, const Q8Code& c, std::uint8_t* codes) {
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i thr = q8_table16(c.thr);
  const __m512 oct = _mm512_castsi512_ps(q8_table16(reinterpret_cast<const std::int32_t*>(c.oct)));
  const __m512 gap = _mm512_castsi512_ps(q8_table16(reinterpret_cast<const std::int32_t*>(c.gap)));
  const __m512i koff = _mm512_set1_epi32(c.koff), one = _mm512_set1_epi32(1);
  const __m512i mmask = _mm512_set1_epi32(0x7fffff), expo = _mm512_set1_epi32(0x3f800000);
  const bool is_m = c.levels == 128;
  std::size_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i), y = _mm512_mul_ps(_mm512_abs_ps(xv), vinv);
    const __m512i yb = _mm512_castps_si512(y), b = _mm512_srli_epi32(yb, 20), mant = _mm512_and_si512(yb, mmask);
    const __m512i kb = _mm512_add_epi32(b, koff);
    __m512i k = _mm512_mask_add_epi32(kb, _mm512_cmpgt_epi32_mask(mant, _mm512_permutexvar_epi32(b, thr)), kb, one);
    const __m512i j = _mm512_add_epi32(k, one);  // the permutes take its low 4 bits: tables twice over
    const __m512 z = _mm512_castsi512_ps(_mm512_or_si512(mant, expo));
    const __m512 t = _mm512_mul_ps(_mm512_permutexvar_ps(j, gap), _mm512_loadu_ps(u + i));
    k = _mm512_mask_add_epi32(k, _mm512_cmp_ps_mask(_mm512_sub_ps(z, _mm512_permutexvar_ps(j, oct)), t, _CMP_GT_OQ), k, one);
    const __mmask16 low = _mm512_cmplt_epi32_mask(k, one);  // c <= 0: code 1 iff y > u1
    k = _mm512_mask_mov_epi32(k, low, _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(y, _mm512_loadu_ps(u1 + i), _CMP_GT_OQ), one));
    if (is_m) {
      const __mmask16 neg = _mm512_cmp_ps_mask(xv, _mm512_setzero_ps(), _CMP_LT_OQ) & _mm512_test_epi32_mask(k, k);
      k = _mm512_mask_or_epi32(k, neg, k, _mm512_set1_epi32(0x80));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(k));
  }
  return i;
}
#endif  // MPO_X86

// codes[0, len) with their block's scale -> fp32 x, on SIMD path `level`.
inline void q8_decode(const std::uint8_t* codes, float scale, std::size_t len, bool is_m, float* x,
                      int level = kScalar) {
  const Q8Code& c = is_m ? kCodeM : kCodeV;
  std::size_t i = 0;
#if defined(MPO_X86)
  if (level == kAVX512) i = q8_decode_avx512(codes, scale, len, c, x);
  else if (level == kAVX2) i = q8_decode_avx2(codes, scale, len, c, x);
#endif
  (void)level;
  q8_decode_scalar(codes, scale, i, len, c, x);
}

// x[0, len) (one block) -> codes and its scale (see CODES) with the dither r, on SIMD
// path `level`.
inline void q8_encode(const float* x, std::size_t len, bool is_m, const Q8Round& r, std::uint8_t* codes, float* scale,
                      int level = kScalar) {
  float amax;
#if defined(MPO_X86)
  if (level == kAVX512) amax = q8_absmax_avx512(x, len);
  else if (level == kAVX2) amax = q8_absmax_avx2(x, len);
  else
#endif
    amax = q8_absmax(x, len);
  *scale = amax;
  if (!(amax > 0.0f)) {  // all zero (scale 0) or non-finite (scale NaN): codes 0
    std::memset(codes, 0, len);
    return;
  }
  const Q8Code& c = is_m ? kCodeM : kCodeV;
  if (!(amax >= c.tiny && amax < 0x1p126f)) return q8_encode_exact(x, amax, r.u, len, c, codes);
  const float inv = 1.0f / amax;
  std::size_t i = 0;
#if defined(MPO_X86)
  if (level == kAVX512) i = q8_encode_avx512(x, inv, r.u, r.u1, len, c, codes);
  else if (level == kAVX2) i = q8_encode_avx2(x, inv, r.u, r.u1, len, c, codes);
#endif
  (void)level;
  q8_encode_scalar(x, inv, r.u, r.u1, i, len, c, codes);
}

}  // namespace

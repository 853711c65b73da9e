// Block-wise 8-bit Adam moments (Q8): one uint8 code per element and one fp32
// scale, the block's absmax, per kQ8Block elements. Blocks are counted from
// element 0 of the arrays a call gets, so a block never straddles two calls
// (the Python face checks that a view starts on a block and ends on one, or at
// its storage's end).
//
// CODES. Both are logarithmic, 8 steps per octave (ratio 2^(1/8) = 1.0905):
//   exp_avg:    bit 7 = sign (set for y < 0), bits 0..6 = k; |y| = 0 (k = 0) or
//               2^((k - 127) / 8): down to 2^-15.75 = 1.8e-5 of the block's absmax.
//   exp_avg_sq: k = 0..255; y = 0 or 2^((k - 255) / 8): down to 2^-31.75 = 3e-10,
//               the same range in sqrt(v) as exp_avg's (v ~ m^2), sqrt(v) in
//               2^(1/16) steps.
// Nearest code: k = #{mids < y}, y = RN(x / absmax), mids[k] = RN((dec[k] +
// dec[k+1]) / 2) in fp32: an exact rule torch's searchsorted reproduces. The
// relative error of a value inside the range is at most (r - 1) / (r + 1) = 4.3%
// (2.2% on sqrt(v)); below half the smallest step a value becomes 0. The stored
// value is RN(dec[k] * scale). A v that becomes 0 under a non-zero m makes that
// element's step m / eps: the cost of a per-block range (8-bit Adam has it too).
// Non-finite moments: a block with an inf or NaN gets scale NaN (codes 0): every
// element of it decodes to NaN, as a non-finite fp32 moment would spread anyway.
//
// ENCODE without a search: the float bits of y >= 0 (monotonic in y), shifted
// right by 19, index bins of 1/16 octave (the exponent and the top 4 mantissa
// bits), narrower than the 1/8-octave code spacing: each bin holds at most one
// mid, so k = start[bin] + (thr[bin] < y), start[bin] = #{mids < bin's lower
// edge}, thr[bin] = mids[start[bin]] (two independent lookups per element).
// Every y below the first bin (2^-17, 2^-33) lies below mids[0].
//
// SIMD. AVX2 / AVX-512 encode (the divide and the octave rule of q8_encode_avx2:
// the same codes, no table), decode (one gather and the multiply) and absmax
// lane-wise; a block's ragged end takes the scalar rule.
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
  float dec[256] = {};            // magnitude of code k, dec[levels - 1] = 1
  float value[256] = {};          // what a code byte stands for: dec, signed by bit 7 for exp_avg
  float mid[257] = {};            // mid[k] between dec[k] and dec[k + 1]; +inf from levels - 1 on
  int bin0 = 0, nbins = 0;        // first bin (float bits >> 19) and how many
  std::int32_t start[34 * 16 + 1] = {};
  float thr[34 * 16 + 1] = {};    // mid[start[b]]: indexed by the bin too, so no dependent lookup
  std::int32_t oct_mid[8] = {};   // mantissa bits of the 8 mids inside every octave (SIMD encode)

  explicit Q8Code(int lv) : levels(lv) {
    // 2^e * 2^(j/8) as one rounded mantissa per j, scaled exactly: every octave alike
    for (int k = 1; k < lv; ++k) {
      const int t = k - (lv - 1), e = (t - 7) / 8, j = t - 8 * e;  // floor division: j in 0..7
      dec[k] = std::ldexp(static_cast<float>(std::exp2(j / 8.0)), e);
    }
    for (int c = 0; c < 256; ++c) value[c] = lv == 256 ? dec[c] : (c & 0x80 ? -dec[c & 0x7f] : dec[c]);
    for (int k = 0; k < 257; ++k)
      mid[k] = k + 1 < lv ? static_cast<float>((static_cast<double>(dec[k]) + dec[k + 1]) * 0.5)
                          : std::numeric_limits<float>::infinity();
    const int floor_exp = static_cast<int>(std::ceil((lv - 2) / 8.0 + 1.0));  // 2^-floor_exp < mid[0]
    bin0 = (127 - floor_exp) * 16;
    nbins = floor_exp * 16 + 1;  // up to the bin starting at 1.0
    int k = 0;
    for (int b = 0; b < nbins; ++b) {
      const float lo = u2f(static_cast<std::uint32_t>(bin0 + b) << 19);
      while (mid[k] < lo) ++k;
      start[b] = k;
      thr[b] = mid[k];
    }
    for (int j = 0; j < 8; ++j) oct_mid[j] = static_cast<std::int32_t>(f2u(mid[lv - 9 + j]) & 0x7fffff);
  }

  // y >= 0 (or -0 / negative: code 0) -> its nearest code.
  int encode(float y) const {
    int b = (static_cast<std::int32_t>(f2u(y)) >> 19) - bin0;
    b = b < 0 ? 0 : (b >= nbins ? nbins - 1 : b);
    return start[b] + (thr[b] < y);
  }
};

const Q8Code kCodeM(128);   // exp_avg
const Q8Code kCodeV(256);   // exp_avg_sq

// The 256 values a code byte stands for (times the scale): the table tests share.
inline float q8_value(bool is_m, int c) { return (is_m ? kCodeM : kCodeV).value[c]; }

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

// codes -> RN(value * scale), and x -> codes given its block's finite, non-zero amax,
// elements [b, e); the SIMD versions below do the same bits lane-wise.
inline void q8_decode_scalar(const std::uint8_t* codes, float scale, std::size_t b, std::size_t e, const Q8Code& c,
                             float* x) {
  for (std::size_t i = b; i < e; ++i) x[i] = c.value[codes[i]] * scale;
}

inline void q8_encode_scalar(const float* x, float amax, std::size_t b, std::size_t e, const Q8Code& c,
                             std::uint8_t* codes) {
  const bool is_m = c.levels == 128;
  for (std::size_t i = b; i < e; ++i) {
    const float y = x[i] / amax;
    const int k = c.encode(is_m ? std::fabs(y) : y);
    codes[i] = static_cast<std::uint8_t>(k | (is_m & (y < 0.0f)) << 7);
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

MPO_AVX2 inline std::size_t q8_decode_avx2(const std::uint8_t* codes, float scale, std::size_t len,
                                           const Q8Code& c, float* x) {
  const __m256 s = _mm256_set1_ps(scale);
  std::size_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
    _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_i32gather_ps(c.value, idx, 4), s));
  }
  return i;
}

// The SIMD encode needs no table: the codes of the octave [2^e, 2^(e+1)) are
// levels - 1 + 8e + j (j = 0..7) and its 8 mids have the same mantissas in every octave
// (oct_mid), so k = levels - 1 + 8e + #{j : mantissa > oct_mid[j]}. At the bottom, where
// the octaves hold no code, k = 1 for y > mid[0] (the mid between 0 and code 1), else 0.
MPO_AVX2 inline std::size_t q8_encode_avx2(const float* x, float amax, std::size_t len, const Q8Code& c,
                                           std::uint8_t* codes) {
  const __m256 am = _mm256_set1_ps(amax), sign = _mm256_set1_ps(-0.0f), mid0 = _mm256_set1_ps(c.mid[0]);
  const __m256i base = _mm256_set1_epi32(c.levels - 1 - 8 * 127), one = _mm256_set1_epi32(1);
  const bool is_m = c.levels == 128;
  std::size_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 y = _mm256_div_ps(_mm256_loadu_ps(x + i), am);
    const __m256 a = is_m ? _mm256_andnot_ps(sign, y) : y;
    const __m256i u = _mm256_castps_si256(a), mant = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffff));
    __m256i k = _mm256_add_epi32(base, _mm256_slli_epi32(_mm256_srli_epi32(u, 23), 3));
    for (int j = 0; j < 8; ++j) k = _mm256_sub_epi32(k, _mm256_cmpgt_epi32(mant, _mm256_set1_epi32(c.oct_mid[j])));
    k = _mm256_and_si256(_mm256_max_epi32(k, one), _mm256_castps_si256(_mm256_cmp_ps(a, mid0, _CMP_GT_OQ)));
    if (is_m) k = _mm256_or_si256(k, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_LT_OQ)), _mm256_set1_epi32(0x80)));
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

MPO_AVX512 inline std::size_t q8_decode_avx512(const std::uint8_t* codes, float scale, std::size_t len,
                                               const Q8Code& c, float* x) {
  const __m512 s = _mm512_set1_ps(scale);
  std::size_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_i32gather_ps(idx, c.value, 4), s));
  }
  return i;
}

MPO_AVX512 inline std::size_t q8_encode_avx512(const float* x, float amax, std::size_t len, const Q8Code& c,
                                               std::uint8_t* codes) {
  const __m512 am = _mm512_set1_ps(amax), mid0 = _mm512_set1_ps(c.mid[0]);
  const __m512i base = _mm512_set1_epi32(c.levels - 1 - 8 * 127), one = _mm512_set1_epi32(1);
  const bool is_m = c.levels == 128;
  std::size_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512 y = _mm512_div_ps(_mm512_loadu_ps(x + i), am);
    const __m512 a = is_m ? _mm512_abs_ps(y) : y;
    const __m512i u = _mm512_castps_si512(a), mant = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffff));
    __m512i k = _mm512_add_epi32(base, _mm512_slli_epi32(_mm512_srli_epi32(u, 23), 3));
    for (int j = 0; j < 8; ++j)
      k = _mm512_mask_add_epi32(k, _mm512_cmpgt_epi32_mask(mant, _mm512_set1_epi32(c.oct_mid[j])), k, one);
    k = _mm512_maskz_max_epi32(_mm512_cmp_ps_mask(a, mid0, _CMP_GT_OQ), k, one);
    if (is_m) k = _mm512_mask_or_epi32(k, _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ), k, _mm512_set1_epi32(0x80));
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

// x[0, len) (one block) -> codes and its scale (see CODES), on SIMD path `level`.
inline void q8_encode(const float* x, std::size_t len, bool is_m, std::uint8_t* codes, float* scale,
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
  std::size_t i = 0;
#if defined(MPO_X86)
  if (level == kAVX512) i = q8_encode_avx512(x, amax, len, c, codes);
  else if (level == kAVX2) i = q8_encode_avx2(x, amax, len, c, codes);
#endif
  (void)level;
  q8_encode_scalar(x, amax, i, len, c, codes);
}

}  // namespace

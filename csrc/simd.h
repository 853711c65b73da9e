// SIMD and dtype primitives of the C++ extensions: the run-time target
// attributes, the dtype codes shared with the Python faces, and fp32 <-> fp16 /
// bf16 conversion and the fp32 <-> (hi, lo) split per element and per AVX2 /
// AVX-512 vector.
//
// Everything sits in an anonymous namespace on purpose: each extension module
// is one translation unit that includes this header, nothing crosses a module
// boundary, and internal linkage keeps GCC's inlining what it is when the code
// lives in the .cpp itself.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

// -DMPO_NO_SIMD builds the portable path only (as on aarch64; used to test it).
#if defined(__x86_64__) && !defined(MPO_NO_SIMD)
#include <immintrin.h>
#define MPO_X86 1
#define MPO_AVX2 __attribute__((target("avx2,fma,f16c")))
#define MPO_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#endif

namespace {

// dtype codes shared with the Python face; as an out code, kNone = no copy.
// Out codes only (never a dtype the Python face passes): kBF16Split = a bf16 copy
// rounded by the split rule below; kRem = no fp32 param at all, it lives as
// (hi, lo) halves, the hi one being the bf16 param (see SPLIT in adam_kernels.h).
enum : int { kF32 = 0, kF16 = 1, kBF16 = 2, kNone = 0, kBF16Split = 3, kRem = 4 };

inline std::size_t dsize(int code) { return code == kF32 ? 4 : 2; }

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

// The split rule (SPLIT in adam_kernels.h): hi = the top half of x plus one when
// lo >= 0x8000 for finite x, the finite magnitudes counted modulo 0x7f80 (so the
// x that would round into inf give +-0); inf and NaN keep their top half.
inline std::uint16_t split_hi(float f) {
  const std::uint32_t u = f2u(f), a = u & 0x7fffffffu;
  std::uint32_t hi = (u >> 16) + ((a < 0x7f800000u) & (u >> 15));
  if (a - 0x7f7f8000u < 0x8000u) hi &= 0x8000u;  // t = 0x7f7f, lo >= 0x8000: (t + 1) mod 0x7f80 = 0
  return static_cast<std::uint16_t>(hi);
}
inline std::uint16_t split_lo(float f) { return static_cast<std::uint16_t>(f2u(f)); }

// The inverse: t = (hi - [lo >= 0x8000]) modulo 0x7f80 on finite magnitudes.
inline float join_hi_lo(std::uint16_t hi, std::uint16_t lo) {
  const std::uint32_t h = hi, hm = h & 0x7fffu, r = static_cast<std::uint32_t>(lo) >> 15;
  std::uint32_t t = hm;
  if (hm < 0x7f80u) t = hm >= r ? hm - r : 0x7f7fu;
  return u2f((((h & 0x8000u) | t) << 16) | lo);
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
  else if constexpr (T == kBF16Split) static_cast<std::uint16_t*>(a)[i] = split_hi(x);
  else if constexpr (!IS_OUT) static_cast<float*>(a)[i] = x;
}

#if defined(MPO_X86)
// ---------------------------------------------------------------- AVX2 (8)
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

// The split rule lane-wise (split_hi / join_hi_lo). All compared values are below
// 2^31, so AVX2's signed compares do.
MPO_AVX2 inline __m256i split_hi32_avx2(__m256i u) {
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i fin = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f800000), a);
  const __m256i ovf = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f7f8000), a), fin);
  const __m256i up = _mm256_and_si256(_mm256_srli_epi32(u, 15), _mm256_and_si256(fin, _mm256_set1_epi32(1)));
  const __m256i hi = _mm256_add_epi32(_mm256_srli_epi32(u, 16), up);
  return _mm256_blendv_epi8(hi, _mm256_and_si256(hi, _mm256_set1_epi32(0x8000)), ovf);
}

MPO_AVX2 inline __m128i pack16_avx2(__m256i x) {  // 8 lanes in [0, 0xffff] -> 8 x u16
  return _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}

MPO_AVX2 inline void split_avx2(__m256 x, __m128i* hi, __m128i* lo) {
  const __m256i u = _mm256_castps_si256(x);
  *hi = pack16_avx2(split_hi32_avx2(u));
  *lo = pack16_avx2(_mm256_and_si256(u, _mm256_set1_epi32(0xffff)));
}

MPO_AVX2 inline __m256 join_avx2(__m128i hi, __m128i lo) {
  const __m256i h = _mm256_cvtepu16_epi32(hi), l = _mm256_cvtepu16_epi32(lo);
  const __m256i hm = _mm256_and_si256(h, _mm256_set1_epi32(0x7fff));
  const __m256i fin = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f80), hm);
  __m256i t = _mm256_sub_epi32(hm, _mm256_and_si256(_mm256_srli_epi32(l, 15), fin));
  t = _mm256_blendv_epi8(t, _mm256_set1_epi32(0x7f7f), _mm256_cmpgt_epi32(_mm256_setzero_si256(), t));  // -1: wrap
  const __m256i top = _mm256_or_si256(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)), t);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(top, 16), l));
}

// NT: a non-temporal store (the address aligned to the vector): for a stream the step
// only writes (param_out, or out-of-place state), no read for ownership of its lines.
template <bool NT>
MPO_AVX2 inline void put_avx2(float* a, __m256 x) {
  if constexpr (NT) _mm256_stream_ps(a, x); else _mm256_storeu_ps(a, x);
}
template <bool NT>
MPO_AVX2 inline void put_avx2(std::uint16_t* a, __m128i x) {
  if constexpr (NT) _mm_stream_si128(reinterpret_cast<__m128i*>(a), x);
  else _mm_storeu_si128(reinterpret_cast<__m128i*>(a), x);
}

template <int T, bool NT = false>
MPO_AVX2 inline void store_mom_avx2(void* a, std::size_t i, __m256 x) {
  if constexpr (T == kF32) put_avx2<NT>(static_cast<float*>(a) + i, x);
  else put_avx2<NT>(static_cast<std::uint16_t*>(a) + i, to_bf16_avx2(x));
}

template <int OT, bool NT>
MPO_AVX2 inline void store_out_avx2(void* out, std::size_t i, __m256 x) {
  if constexpr (OT == kNone) return;
  std::uint16_t* const dst = static_cast<std::uint16_t*>(out) + i;
  __m128i h;
  if constexpr (OT == kF16) h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
  else if constexpr (OT == kBF16Split) h = pack16_avx2(split_hi32_avx2(_mm256_castps_si256(x)));
  else h = to_bf16_avx2(x);
  put_avx2<NT>(dst, h);
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

MPO_AVX512 inline __m512i split_hi32_avx512(__m512i u) {
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 fin = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
  const __mmask16 ovf =
      _mm512_cmplt_epu32_mask(_mm512_sub_epi32(a, _mm512_set1_epi32(0x7f7f8000)), _mm512_set1_epi32(0x8000));
  __m512i hi = _mm512_srli_epi32(u, 16);
  hi = _mm512_mask_add_epi32(hi, fin, hi, _mm512_and_si512(_mm512_srli_epi32(u, 15), _mm512_set1_epi32(1)));
  return _mm512_mask_and_epi32(hi, ovf, hi, _mm512_set1_epi32(0x8000));
}

MPO_AVX512 inline void split_avx512(__m512 x, __m256i* hi, __m256i* lo) {
  const __m512i u = _mm512_castps_si512(x);
  *hi = _mm512_cvtepi32_epi16(split_hi32_avx512(u));
  *lo = _mm512_cvtepi32_epi16(u);  // vpmovdw truncates: the low halves
}

MPO_AVX512 inline __m512 join_avx512(__m256i hi, __m256i lo) {
  const __m512i h = _mm512_cvtepu16_epi32(hi), l = _mm512_cvtepu16_epi32(lo);
  const __m512i hm = _mm512_and_si512(h, _mm512_set1_epi32(0x7fff));
  const __mmask16 fin = _mm512_cmplt_epu32_mask(hm, _mm512_set1_epi32(0x7f80));
  __m512i t = _mm512_mask_sub_epi32(hm, fin, hm, _mm512_srli_epi32(l, 15));
  t = _mm512_mask_mov_epi32(t, _mm512_cmplt_epi32_mask(t, _mm512_setzero_si512()), _mm512_set1_epi32(0x7f7f));
  const __m512i top = _mm512_or_si512(_mm512_and_si512(h, _mm512_set1_epi32(0x8000)), t);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(top, 16), l));
}

template <bool NT>
MPO_AVX512 inline void put_avx512(float* a, __m512 x) {
  if constexpr (NT) _mm512_stream_ps(a, x); else _mm512_storeu_ps(a, x);
}
template <bool NT>
MPO_AVX512 inline void put_avx512(std::uint16_t* a, __m256i x) {
  if constexpr (NT) _mm256_stream_si256(reinterpret_cast<__m256i*>(a), x);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), x);
}

template <int T, bool NT = false>
MPO_AVX512 inline void store_mom_avx512(void* a, std::size_t i, __m512 x) {
  if constexpr (T == kF32) put_avx512<NT>(static_cast<float*>(a) + i, x);
  else put_avx512<NT>(static_cast<std::uint16_t*>(a) + i, to_bf16_avx512(x));
}

template <int OT, bool NT>
MPO_AVX512 inline void store_out_avx512(void* out, std::size_t i, __m512 x) {
  if constexpr (OT == kNone) return;
  std::uint16_t* const dst = static_cast<std::uint16_t*>(out) + i;
  __m256i h;
  if constexpr (OT == kF16) h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  else if constexpr (OT == kBF16Split) h = _mm512_cvtepi32_epi16(split_hi32_avx512(_mm512_castps_si512(x)));
  else h = to_bf16_avx512(x);
  put_avx512<NT>(dst, h);
}
#endif  // MPO_X86

}  // namespace

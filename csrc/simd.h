// SIMD and dtype primitives of the C++ extensions: the run-time target
// attributes, the dtype codes shared with the Python faces, and fp32 <-> fp16 /
// bf16 conversion per element and per AVX2 / AVX-512 vector.
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
enum : int { kF32 = 0, kF16 = 1, kBF16 = 2, kNone = 0 };

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
#endif  // MPO_X86

}  // namespace

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

template <bool NT>
MPO_AVX512 inline void put_avx512(std::uint16_t* a, __m512i x) {
  if constexpr (NT) _mm512_stream_si512(reinterpret_cast<__m512i*>(a), x);
  else _mm512_storeu_si512(a, x);
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
// EVEN/ODD (the remainder kernel's AVX-512 body). A 512-bit load of a 16-bit stream
// holds 32 elements: element 2k in the low half of dword k, 2k+1 in the high half. So
// the step keeps 32 elements as two vectors, the even ones and the odd ones: a 16-bit
// stream then goes in and out with one shift or mask per vector (no vpmovzxwd /
// vpmovdw, two-uop shuffles on the one shuffle port), fp32 streams through one
// vpermt2ps per vector. Lanes only move: every element's operations are unchanged.
// vpternlogd immediates: A = 0xf0, B = 0xcc, C = 0xaa; kSel = C ? A : B.
constexpr int kSel = 0xe4;

// vpermt2ps indices over (a, b) = elements 0..15, 16..31: into parity order and back.
MPO_AVX512 inline __m512i even_ix() { return _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30); }
MPO_AVX512 inline __m512i odd_ix() { return _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31); }
MPO_AVX512 inline __m512i first_ix() { return _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23); }
MPO_AVX512 inline __m512i second_ix() {
  return _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
}

template <int T>
MPO_AVX512 inline void load_eo_avx512(const void* a, std::size_t i, __m512* eo) {
  if constexpr (T == kBF16) {
    const __m512i w = _mm512_loadu_si512(static_cast<const std::uint16_t*>(a) + i);
    eo[0] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    eo[1] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  } else {  // fp32 (or fp16 widened): elements i .. i+31 in order, then split by parity
    const __m512 x = load_avx512<T>(a, i), y = load_avx512<T>(a, i + 16);
    eo[0] = _mm512_permutex2var_ps(x, even_ix(), y);
    eo[1] = _mm512_permutex2var_ps(x, odd_ix(), y);
  }
}

// bf16 RNE of x in the top half of each lane (to_bf16_avx512 before its shift and pack).
MPO_AVX512 inline __m512i bf16_top_avx512(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
}

// Two 32-bit lanes' top halves (odd) and low halves (even, already shifted down) as one 16-bit pair.
MPO_AVX512 inline __m512i pack_eo(__m512i odd_top, __m512i even_low) {
  return _mm512_ternarylogic_epi32(odd_top, even_low, _mm512_set1_epi32(static_cast<int>(0xffff0000u)), kSel);
}

template <int T, bool NT>
MPO_AVX512 inline void store_eo_avx512(void* a, std::size_t i, const __m512* eo) {
  if constexpr (T == kBF16) {
    const __m512i lo = _mm512_srli_epi32(bf16_top_avx512(eo[0]), 16);
    put_avx512<NT>(static_cast<std::uint16_t*>(a) + i, pack_eo(bf16_top_avx512(eo[1]), lo));
  } else {
    float* const f = static_cast<float*>(a) + i;
    put_avx512<NT>(f, _mm512_permutex2var_ps(eo[0], first_ix(), eo[1]));
    put_avx512<NT>(f + 16, _mm512_permutex2var_ps(eo[0], second_ix(), eo[1]));
  }
}

// join_hi_lo on 32-bit lanes x = hi << 16 | lo: t = hi - [lo >= 0x8000] on finite
// magnitudes, modulo 0x7f80 (hi = +-0 wraps to 0x7f7f: borrow, then + 0x7f80 << 16).
MPO_AVX512 inline __m512 join_fix_avx512(__m512i x) {
  const __m512i a = _mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 r = _mm512_test_epi32_mask(x, _mm512_set1_epi32(0x8000));
  const __mmask16 k = _mm512_mask_cmplt_epu32_mask(r, a, _mm512_set1_epi32(0x7f800000));
  x = _mm512_mask_sub_epi32(x, k, x, _mm512_set1_epi32(0x10000));
  const __mmask16 wrap = _mm512_mask_cmplt_epu32_mask(k, a, _mm512_set1_epi32(0x10000));
  return _mm512_castsi512_ps(_mm512_mask_add_epi32(x, wrap, x, _mm512_set1_epi32(0x7f800000)));
}

MPO_AVX512 inline void join_eo_avx512(const std::uint16_t* hi, const std::uint16_t* lo, __m512* eo) {
  const __m512i h = _mm512_loadu_si512(hi), l = _mm512_loadu_si512(lo);
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  eo[0] = join_fix_avx512(_mm512_ternarylogic_epi32(_mm512_slli_epi32(h, 16), l, top, kSel));
  eo[1] = join_fix_avx512(_mm512_ternarylogic_epi32(h, _mm512_srli_epi32(l, 16), top, kSel));
}

// split_avx512 on the pair: hi = top half of u + 0x8000 (the carry adds [lo >= 0x8000])
// for |u| < 0x7f7f8000; the rare vector with a larger magnitude, inf or NaN takes the
// exact split_hi32_avx512 (the wrap to +-0 and the untouched inf/NaN tops).
template <bool NT>
MPO_AVX512 inline void split_eo_avx512(const __m512* eo, std::uint16_t* hi, std::uint16_t* lo) {
  const __m512i ue = _mm512_castps_si512(eo[0]), uo = _mm512_castps_si512(eo[1]);
  const __m512i half = _mm512_set1_epi32(0x8000);
  __m512i h = pack_eo(_mm512_add_epi32(uo, half), _mm512_srli_epi32(_mm512_add_epi32(ue, half), 16));
  const __m512i mag = _mm512_ternarylogic_epi32(ue, uo, _mm512_set1_epi32(0x7fffffff), 0xa8);  // (A | B) & C
  if (__builtin_expect(_mm512_cmpge_epu32_mask(mag, _mm512_set1_epi32(0x7f7f8000)) != 0, 0))
    h = pack_eo(_mm512_slli_epi32(split_hi32_avx512(uo), 16), split_hi32_avx512(ue));
  put_avx512<NT>(hi, h);
  put_avx512<NT>(lo, pack_eo(_mm512_slli_epi32(uo, 16), ue));
}
#endif  // MPO_X86

}  // namespace

// fp32 <-> (hi, lo) over whole arrays, by the split rule of simd.h (SPLIT in
// adam_kernels.h): for checkpoints (the fp32 master rebuilt from the halves and
// back) and the tests' exhaustive round trip. One range per call, one SIMD path
// per level; ragged tails take the scalar rule, which is the same bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd.h"
#include "simd_level.h"

namespace {

using SplitFn = void (*)(const float*, std::uint16_t*, std::uint16_t*, std::size_t, std::size_t);
using JoinFn = void (*)(const std::uint16_t*, const std::uint16_t*, float*, std::size_t, std::size_t);

void split_scalar(const float* x, std::uint16_t* hi, std::uint16_t* lo, std::size_t b, std::size_t e) {
  for (std::size_t i = b; i < e; ++i) {
    hi[i] = split_hi(x[i]);
    lo[i] = split_lo(x[i]);
  }
}

void join_scalar(const std::uint16_t* hi, const std::uint16_t* lo, float* x, std::size_t b, std::size_t e) {
  for (std::size_t i = b; i < e; ++i) x[i] = join_hi_lo(hi[i], lo[i]);
}

#if defined(MPO_X86)
MPO_AVX2 void split_range_avx2(const float* x, std::uint16_t* hi, std::uint16_t* lo, std::size_t b,
                               std::size_t e) {
  std::size_t i = b;
  for (; i + 8 <= e; i += 8) {
    __m128i h, l;
    split_avx2(_mm256_loadu_ps(x + i), &h, &l);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + i), h);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + i), l);
  }
  split_scalar(x, hi, lo, i, e);
}

MPO_AVX2 void join_range_avx2(const std::uint16_t* hi, const std::uint16_t* lo, float* x, std::size_t b,
                              std::size_t e) {
  std::size_t i = b;
  for (; i + 8 <= e; i += 8)
    _mm256_storeu_ps(x + i, join_avx2(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi + i)),
                                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo + i))));
  join_scalar(hi, lo, x, i, e);
}

MPO_AVX512 void split_range_avx512(const float* x, std::uint16_t* hi, std::uint16_t* lo, std::size_t b,
                                   std::size_t e) {
  std::size_t i = b;
  for (; i + 16 <= e; i += 16) {
    __m256i h, l;
    split_avx512(_mm512_loadu_ps(x + i), &h, &l);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), l);
  }
  split_scalar(x, hi, lo, i, e);
}

MPO_AVX512 void join_range_avx512(const std::uint16_t* hi, const std::uint16_t* lo, float* x, std::size_t b,
                                  std::size_t e) {
  std::size_t i = b;
  for (; i + 16 <= e; i += 16)
    _mm512_storeu_ps(x + i, join_avx512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + i)),
                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + i))));
  join_scalar(hi, lo, x, i, e);
}
#endif  // MPO_X86

inline SplitFn pick_split(int level) {
#if defined(MPO_X86)
  if (level == kAVX512) return &split_range_avx512;
  if (level == kAVX2) return &split_range_avx2;
#endif
  (void)level;
  return &split_scalar;
}

inline JoinFn pick_join(int level) {
#if defined(MPO_X86)
  if (level == kAVX512) return &join_range_avx512;
  if (level == kAVX2) return &join_range_avx2;
#endif
  (void)level;
  return &join_scalar;
}

}  // namespace

// Run-time choice of an extension's SIMD path: what this CPU and build support,
// the best of it, and a level by name (for an MP_OFFLOAD_*_SIMD variable or
// set_simd_level). One binary serves every x86-64 host (see simd.h).
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "simd.h"

namespace {

enum : int { kScalar = 0, kAVX2 = 1, kAVX512 = 2 };
const char* const kLevelNames[] = {"scalar", "avx2", "avx512"};

inline bool level_supported(int level) {
#if defined(MPO_X86)
  __builtin_cpu_init();
  if (level == kAVX512) return __builtin_cpu_supports("avx512f") && level_supported(kAVX2);
  if (level == kAVX2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
  return level == kScalar;
}

inline int best_level() {
  for (int l = kAVX512; l > kScalar; --l)
    if (level_supported(l)) return l;
  return kScalar;
}

inline int parse_level(const std::string& name) {
  if (name == "auto") return best_level();
  for (int l = kScalar; l <= kAVX512; ++l)
    if (name == kLevelNames[l]) {
      if (!level_supported(l))
        throw std::runtime_error("SIMD level '" + name + "' is not supported by this CPU/build");
      return l;
    }
  throw std::invalid_argument("unknown SIMD level '" + name + "' (expected scalar, avx2, avx512 or auto)");
}

inline std::vector<std::string> available_levels() {
  std::vector<std::string> out;
  for (int l = kScalar; l <= kAVX512; ++l)
    if (level_supported(l)) out.emplace_back(kLevelNames[l]);
  return out;
}

}  // namespace

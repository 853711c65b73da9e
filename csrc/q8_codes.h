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
// mid, so k = start[bin] + (mids[start[bin]] < y), start[bin] = #{mids < bin's
// lower edge}. Every y below the first bin (2^-17, 2^-33) lies below mids[0].
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "simd.h"

namespace {

constexpr std::size_t kQ8Block = 256;
constexpr int kQ8 = 5;  // moment dtype code: block-wise 8-bit (after the out codes of simd.h)

struct Q8Code {
  int levels = 0;                 // magnitudes: 128 (exp_avg, + a sign bit) or 256 (exp_avg_sq)
  float dec[256] = {};            // magnitude of code k, dec[levels - 1] = 1
  float mid[257] = {};            // mid[k] between dec[k] and dec[k + 1]; +inf from levels - 1 on
  int bin0 = 0, nbins = 0;        // first bin (float bits >> 19) and how many
  std::uint8_t start[34 * 16 + 1] = {};

  explicit Q8Code(int lv) : levels(lv) {
    for (int k = 1; k < lv; ++k) dec[k] = static_cast<float>(std::exp2((k - (lv - 1)) / 8.0));
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
      start[b] = static_cast<std::uint8_t>(k);
    }
  }

  // y >= 0 (or -0 / negative: code 0) -> its nearest code.
  int encode(float y) const {
    int b = (static_cast<std::int32_t>(f2u(y)) >> 19) - bin0;
    b = b < 0 ? 0 : (b >= nbins ? nbins - 1 : b);
    const int k = start[b];
    return k + (mid[k] < y);
  }
};

const Q8Code kCodeM(128);   // exp_avg magnitudes
const Q8Code kCodeV(256);   // exp_avg_sq

// The 256 values a code byte stands for (times the scale): the table tests share.
inline float q8_value(bool is_m, int c) {
  if (!is_m) return kCodeV.dec[c];
  const float a = kCodeM.dec[c & 0x7f];
  return c & 0x80 ? -a : a;
}

// codes[0, len) with their block's scale -> fp32 x.
inline void q8_decode(const std::uint8_t* codes, float scale, std::size_t len, bool is_m, float* x) {
  if (is_m) {
    for (std::size_t i = 0; i < len; ++i) {
      const float a = kCodeM.dec[codes[i] & 0x7f] * scale;
      x[i] = codes[i] & 0x80 ? -a : a;  // -(a * s) == (-a) * s: negation is exact
    }
  } else {
    for (std::size_t i = 0; i < len; ++i) x[i] = kCodeV.dec[codes[i]] * scale;
  }
}

// x[0, len) (one block) -> codes and its scale (see CODES).
inline void q8_encode(const float* x, std::size_t len, bool is_m, std::uint8_t* codes, float* scale) {
  float amax = 0.0f;
  bool bad = false;
  for (std::size_t i = 0; i < len; ++i) {
    const float a = std::fabs(x[i]);
    bad |= !(a <= std::numeric_limits<float>::max());
    amax = a > amax ? a : amax;
  }
  if (bad || amax == 0.0f) {
    *scale = bad ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    std::memset(codes, 0, len);
    return;
  }
  *scale = amax;
  const Q8Code& c = is_m ? kCodeM : kCodeV;
  for (std::size_t i = 0; i < len; ++i) {
    const float y = x[i] / amax;
    const int k = c.encode(is_m ? std::fabs(y) : y);
    codes[i] = static_cast<std::uint8_t>(is_m && y < 0.0f ? k | 0x80 : k);
  }
}

}  // namespace

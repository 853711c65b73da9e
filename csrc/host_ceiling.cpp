// Host memory-bandwidth ceiling for bench/bench_cpu_adam.py: streams the bytes
// of an optimizer step (any mix of read-only, read-write and write-only arrays
// of 2- or 4-byte elements) with trivial work, in several access patterns, so
// the benchmark can take the best one as the machine's ceiling.
//
// Nothing here is shared with the Adam kernel (csrc/cpu_adam.cpp): its own
// loops, schedules and stores. Built by bench/bench_host_ceiling.py with the
// host's own flags (-O3 -march=native -fopenmp) and loaded through ctypes;
// it is not part of the mp_offload package.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

enum Mode : int { kRead = 1, kWrite = 2, kReadWrite = 3 };
enum Pattern : int {
  kContiguous = 0,  // each thread one contiguous range, all arrays advanced together
  kTiles = 1,       // tiles of `tile` elements dealt round-robin to the threads
  kDynamic = 2,     // tiles of `tile` elements handed out on demand (omp dynamic)
  kSplit = 3,       // each thread one contiguous range, walked in chunks of `tile`
                    // elements one array at a time (fewer concurrent streams)
};

struct Streams {
  char* ptr[8];
  int esize[8];
  int mode[8];
  int count;
};

// One 64-byte line: read (and fold into a sink so the load stays), write, or both.
#if defined(__AVX512F__)
using Line = __m512i;
inline Line load_line(const char* p) { return _mm512_loadu_si512(p); }
inline void store_line(char* p, Line x, bool nt) {
  if (nt) _mm512_stream_si512(reinterpret_cast<__m512i*>(p), x); else _mm512_storeu_si512(p, x);
}
inline Line bump(Line x) { return _mm512_add_epi32(x, _mm512_set1_epi32(1)); }
inline Line fold(Line a, Line b) { return _mm512_xor_si512(a, b); }
inline Line zero_line() { return _mm512_setzero_si512(); }
inline std::uint32_t sink_bits(Line x) { return static_cast<std::uint32_t>(_mm512_reduce_or_epi32(x)); }
#elif defined(__AVX2__)
struct Line { __m256i a, b; };
inline Line load_line(const char* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline void store_line(char* p, Line x, bool nt) {
  if (nt) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x.a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p + 32), x.b);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x.a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32), x.b);
  }
}
inline Line bump(Line x) {
  const __m256i one = _mm256_set1_epi32(1);
  return {_mm256_add_epi32(x.a, one), _mm256_add_epi32(x.b, one)};
}
inline Line fold(Line a, Line b) { return {_mm256_xor_si256(a.a, b.a), _mm256_xor_si256(a.b, b.b)}; }
inline Line zero_line() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline std::uint32_t sink_bits(Line x) {
  return static_cast<std::uint32_t>(_mm256_movemask_epi8(_mm256_or_si256(x.a, x.b)));
}
#else  // portable: 64 bytes as eight 64-bit words
struct Line { std::uint64_t w[8]; };
inline Line load_line(const char* p) { Line x; std::memcpy(x.w, p, 64); return x; }
inline void store_line(char* p, Line x, bool) { std::memcpy(p, x.w, 64); }
inline Line bump(Line x) { for (auto& w : x.w) w += 1; return x; }
inline Line fold(Line a, Line b) { for (int k = 0; k < 8; ++k) a.w[k] ^= b.w[k]; return a; }
inline Line zero_line() { return Line{}; }
inline std::uint32_t sink_bits(Line x) { std::uint64_t s = 0; for (auto w : x.w) s |= w; return s != 0; }
#endif

// Elements [b, e) of every array, one array after the other; b and e are
// multiples of kBlock elements (whole 64-byte lines in 2- and 4-byte arrays)
// except at the very end of the arrays.
constexpr std::size_t kBlock = 64;

void run_block(const Streams& s, std::size_t b, std::size_t e, bool nt, Line& sink) {
  for (int k = 0; k < s.count; ++k) {
    char* base = s.ptr[k];
    const std::size_t es = static_cast<std::size_t>(s.esize[k]);
    std::size_t lo = b * es;
    const std::size_t hi = e * es, whole = lo + (hi - lo) / 64 * 64;
    switch (s.mode[k]) {
      case kRead:
        for (; lo < whole; lo += 64) sink = fold(sink, load_line(base + lo));
        break;
      case kWrite:
        for (; lo < whole; lo += 64) store_line(base + lo, sink, nt);
        break;
      default:
        for (; lo < whole; lo += 64) store_line(base + lo, bump(load_line(base + lo)), nt);
    }
    for (; lo < hi; ++lo)  // ragged end of the whole array
      if (s.mode[k] & kWrite) base[lo] = static_cast<char>(base[lo] + 1);
  }
}

// All arrays advanced together, kBlock elements at a time (4 lines of every
// 4-byte array, 2 of every 2-byte one): the order an optimizer step touches them.
void run_interleaved(const Streams& s, std::size_t b, std::size_t e, bool nt, Line& sink) {
  std::size_t i = b;
  for (; i + kBlock <= e; i += kBlock) run_block(s, i, i + kBlock, nt, sink);
  if (i < e) run_block(s, i, e, nt, sink);
}

}  // namespace

extern "C" {

// Streams `count` arrays of `n` elements once with `threads` threads; returns
// the wall time in seconds (sink written to *out_sink so no load is dead).
// Arrays: ptrs[k] with element size esize[k] (2 or 4) and mode[k] (1 read,
// 2 write, 3 read-write). nt != 0: stores bypass the caches (needs 64-byte-
// aligned arrays). Written arrays get junk.
double mpo_host_stream(int pattern, int count, void** ptrs, const int* esize, const int* mode, std::size_t n,
                       int threads, std::size_t tile, int nt, std::uint32_t* out_sink) {
  Streams s{};
  s.count = std::min(count, 8);
  for (int k = 0; k < s.count; ++k) {
    s.ptr[k] = static_cast<char*>(ptrs[k]);
    s.esize[k] = esize[k];
    s.mode[k] = mode[k];
  }
  tile = std::max(kBlock, tile / kBlock * kBlock);
  const bool use_nt = nt != 0;
  std::uint32_t sink_all = 0;
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(| : sink_all)
  {
    Line sink = zero_line();
    const std::size_t nt_ = static_cast<std::size_t>(omp_get_num_threads());
    const std::size_t t = static_cast<std::size_t>(omp_get_thread_num());
    const std::size_t blocks = (n + kBlock - 1) / kBlock;
    const std::size_t b = std::min(n, blocks * t / nt_ * kBlock), e = std::min(n, blocks * (t + 1) / nt_ * kBlock);
    if (pattern == kContiguous) {
      run_interleaved(s, b, e, use_nt, sink);
    } else if (pattern == kTiles) {
      for (std::size_t lo = t * tile; lo < n; lo += nt_ * tile) run_interleaved(s, lo, std::min(n, lo + tile), use_nt, sink);
    } else if (pattern == kDynamic) {
      const long long tiles = static_cast<long long>((n + tile - 1) / tile);
#pragma omp for schedule(dynamic, 1) nowait
      for (long long k = 0; k < tiles; ++k) {
        const std::size_t lo = static_cast<std::size_t>(k) * tile;
        run_interleaved(s, lo, std::min(n, lo + tile), use_nt, sink);
      }
    } else {  // kSplit
      for (std::size_t lo = b; lo < e; lo += tile) run_block(s, lo, std::min(e, lo + tile), use_nt, sink);
    }
#if defined(__x86_64__)
    if (use_nt) _mm_sfence();
#endif
    sink_all |= sink_bits(sink);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (out_sink) *out_sink = sink_all;
  return secs;
}

}  // extern "C"

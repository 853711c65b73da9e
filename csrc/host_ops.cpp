// Host-side gradient work of ZeRO-Offload with gradient accumulation (k > 1 micro-batches):
// put a reduced chunk that came down in fp32/fp16/bf16 into the fp32 gradient slice
// (overwrite on the first micro-batch, add on the others) and, after the last one, the
// sum of squares of the ranges that count for the gradient norm.
//
// torch's `fp32.add_(bf16)` takes a slow mixed-dtype path (several times the memory
// bound on the machines we measured); these loops are memory-bound: 10 B per element for
// the bf16 add (read 2 + 4, write 4). Like the CPU Adam: raw pointers from Python (checked
// in mp_offload/ops/host_ops.py), OpenMP, the GIL released, no torch headers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

enum : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
int g_threads = 1;

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename Load>
void run(float* dst, const uint16_t* src, int64_t n, bool overwrite, Load load) {
#pragma omp parallel for schedule(static) num_threads(g_threads)
  for (int64_t i = 0; i < n; ++i) {
    const float v = load(src[i]);
    dst[i] = overwrite ? v : dst[i] + v;
  }
}

void accumulate(uintptr_t dst_ptr, uintptr_t src_ptr, int64_t n, int src_dtype, bool overwrite) {
  if (n < 0) throw std::invalid_argument("accumulate: negative length");
  float* dst = reinterpret_cast<float*>(dst_ptr);
  py::gil_scoped_release release;
  if (src_dtype == kF32) {
    const float* src = reinterpret_cast<const float*>(src_ptr);
#pragma omp parallel for schedule(static) num_threads(g_threads)
    for (int64_t i = 0; i < n; ++i) dst[i] = overwrite ? src[i] : dst[i] + src[i];
  } else if (src_dtype == kBF16) {
    run(dst, reinterpret_cast<const uint16_t*>(src_ptr), n, overwrite, bf16_to_f32);
  } else if (src_dtype == kF16) {
    run(dst, reinterpret_cast<const uint16_t*>(src_ptr), n, overwrite, f16_to_f32);
  } else {
    throw std::invalid_argument("accumulate: unknown source dtype code");
  }
}

double sum_squares(uintptr_t ptr, const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  const float* x = reinterpret_cast<const float*>(ptr);
  double total = 0.0;
  py::gil_scoped_release release;
  for (const auto& r : ranges) {
    const int64_t lo = r.first, hi = r.second;
    double part = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : part) num_threads(g_threads)
    for (int64_t i = lo; i < hi; ++i) part += static_cast<double>(x[i]) * x[i];
    total += part;
  }
  return total;
}

}  // namespace

PYBIND11_MODULE(_host_ops, m) {
  m.doc() = "fp32 gradient accumulation and sum of squares for ZeRO-Offload's host side";
  m.attr("DTYPE_FLOAT32") = py::int_(static_cast<int>(kF32));
  m.attr("DTYPE_FLOAT16") = py::int_(static_cast<int>(kF16));
  m.attr("DTYPE_BFLOAT16") = py::int_(static_cast<int>(kBF16));
  m.def("accumulate", &accumulate, py::arg("dst"), py::arg("src"), py::arg("n"),
        py::arg("src_dtype"), py::arg("overwrite"));
  m.def("sum_squares", &sum_squares, py::arg("ptr"), py::arg("ranges"));
  m.def("set_num_threads", [](int n) {
    if (n < 1) throw std::invalid_argument("set_num_threads: n must be >= 1");
    g_threads = n;
  });
  m.def("get_num_threads", [] { return g_threads; });
}

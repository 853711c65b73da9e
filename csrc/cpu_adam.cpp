// Placeholder so the extension builds; the real kernel replaces this file.
#include <pybind11/pybind11.h>
PYBIND11_MODULE(_cpu_adam, m) { m.def("simd_level", []() { return "scalar"; }); }

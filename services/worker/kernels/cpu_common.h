// What the kernel sources (cpu_ops.cpp, quantized_linear.cpp) share: the vector type, float widening and
// rounding, dtype dispatch and argument checks. Header-only, so every definition here is inline.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <type_traits>

namespace meshserve_kernels {

// Round a float through the storage dtype, as a torch op writing a scalar_t tensor does.
template <typename scalar_t>
inline float round_to(float x) {
  return static_cast<float>(static_cast<scalar_t>(x));
}

// at::vec picks the vector width the loader compiled for (kernels/loader.py sets CPU_CAPABILITY_*).
using fVec = at::vec::Vectorized<float>;

// at::vec::convert has no vectorized bf16/fp16 -> float path; this one widens a vector at a time.
template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (at::vec::is_reduced_floating_point_v<scalar_t>) {
    using rVec = at::vec::Vectorized<scalar_t>;
    for (; i + rVec::size() <= n; i += rVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(rVec::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + fVec::size());
    }
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// x <- float(scalar_t(x)), through tmp: the rounding a torch op applies when it writes a scalar_t tensor.
template <typename scalar_t>
inline void round_through(float* x, scalar_t* tmp, int64_t n) {
  if constexpr (!std::is_same_v<scalar_t, float>) {
    at::vec::convert(x, tmp, n);
    at::vec::convert(tmp, x, n);
  }
}

// Runs fn.template operator()<scalar_t>() for the dtypes the model runs in: float32, bfloat16, float16.
template <typename Fn>
void dispatch_dtype(at::ScalarType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case at::kFloat:
      return fn.template operator()<float>();
    case at::kBFloat16:
      return fn.template operator()<at::BFloat16>();
    case at::kHalf:
      return fn.template operator()<at::Half>();
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", dtype, " (float32, bfloat16 or float16)");
  }
}

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

}  // namespace meshserve_kernels

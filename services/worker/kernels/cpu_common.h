// What the kernel sources (cpu_ops.cpp, quantized_linear.cpp) share: the vector type, float widening and
// rounding, dtype dispatch and argument checks. Header-only, so every definition here is inline.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define MESHSERVE_AMX 1
#endif

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

// Two float vectors (2W elements) at a time, in registers: the unit the fused elementwise kernels work in
// (one bf16/fp16 vector widens to two float ones). count < 2W reads and writes only that many elements
// (a row's tail); lanes past it read as zero.
constexpr int64_t kPair = 2 * fVec::size();

template <typename scalar_t>
inline std::pair<fVec, fVec> load_pair(const scalar_t* src, int64_t count = kPair) {
  constexpr int64_t W = fVec::size();
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (count >= kPair) return {fVec::loadu(src), fVec::loadu(src + W)};
    return {fVec::loadu(src, std::min(count, W)), count > W ? fVec::loadu(src + W, count - W) : fVec(0.f)};
  } else {
    using rVec = at::vec::Vectorized<scalar_t>;
    const rVec v = count >= kPair ? rVec::loadu(src) : rVec::loadu(src, count);
    auto [lo, hi] = at::vec::convert_to_float<scalar_t>(v);
    return {lo, hi};
  }
}

template <typename scalar_t>
inline void store_pair(scalar_t* dst, const fVec& lo, const fVec& hi, int64_t count = kPair) {
  constexpr int64_t W = fVec::size();
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (count >= kPair) {
      lo.store(dst);
      hi.store(dst + W);
    } else {
      lo.store(dst, std::min(count, W));
      if (count > W) hi.store(dst + W, count - W);
    }
  } else {
    const auto v = at::vec::convert_from_float<scalar_t>(lo, hi);
    if (count >= kPair) {
      v.store(dst);
    } else {
      v.store(dst, count);
    }
  }
}

// Both vectors rounded through scalar_t, in registers (round_through's rounding).
template <typename scalar_t>
inline std::pair<fVec, fVec> round_pair(const fVec& lo, const fVec& hi) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return {lo, hi};
  } else {
    auto [a, b] = at::vec::convert_to_float<scalar_t>(at::vec::convert_from_float<scalar_t>(lo, hi));
    return {a, b};
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

#if defined(MESHSERVE_AMX)
// Linux hands a process the AMX tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); until then a tile instruction faults. Asked once per process; false sends prefills to
// the vdpbf16ps operands, and tile-packed half weights to half_linear's vdpbf16ps tile path.
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// The tile palette 1 configuration LDTILECFG reads: per tile, its rows and bytes a row.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#endif

}  // namespace meshserve_kernels

// Native weight-only quantised linears for the worker's CPU: int8 rows with float32 scales per group of
// input columns (--quantization int8, and GGUF's Q8_0). Registered into torch.ops.meshserve_cpu beside
// cpu_ops.cpp's kernels; built and loaded by kernels/loader.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "cpu_common.h"

namespace {

using namespace meshserve_kernels;

// --------------------------------------------------------------------------------- int8 weight-only linear

// Rows of x handled per pass over a weight row: each int8 vector is widened once and used for all of
// them, so a decode batch reads the int8 weights from memory once per step (the point of weight-only
// quantisation: decode is bound by the bytes of weights it reads). Blocks of 4 measured best on AVX2;
// wider blocks ran up to twice as long per row (docs/benchmarks.md).
constexpr int64_t kInt8Rows = 4;

// fVec::size() int8 weights widened to float in registers on x86 (sign-extend, convert); a scalar
// widening elsewhere (the portable build, e.g. on a Kunpeng host), which the compiler vectorises.
// (at::vec's own int8 loads of fewer bytes than a vector go through a stack copy: 4x slower here.)
inline fVec widen_int8(const int8_t* w) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return fVec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w));
  return fVec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
#else
  float lanes[fVec::size()];
  for (int64_t i = 0; i < fVec::size(); ++i) lanes[i] = static_cast<float>(w[i]);
  return fVec::loadu(lanes);
#endif
}

// acc[r] = sum_g scale[g] * sum_{k in group g} x[r][k] * w[k] for ROWS rows of x (row stride k_size),
// groups of group_size weights with one scale each: each weight vector is widened once and multiplied
// into every row. An FMA waits on the previous one into the same sum (4-5 cycles), so with few rows the
// k loop is unrolled into independent sums: about 4 chains in flight whatever ROWS.
template <int64_t ROWS>
inline void dot_rows(const float* x, int64_t k_size, const int8_t* w, const float* scales, int64_t group_size,
                     float* acc) {
  constexpr int64_t kUnroll = ROWS == 1 ? 4 : (ROWS <= 4 ? 2 : 1);
  constexpr int64_t kStep = kUnroll * fVec::size();
  fVec totals[ROWS];
  float tails[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) {
    totals[r] = fVec(0.f);
    tails[r] = 0.f;
  }
  for (int64_t g0 = 0; g0 < k_size; g0 += group_size) {
    const int64_t g_end = g0 + group_size;
    const fVec scale(scales[g0 / group_size]);
    fVec sums[ROWS][kUnroll];
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t u = 0; u < kUnroll; ++u) sums[r][u] = fVec(0.f);
    int64_t k = g0;
    for (; k + kStep <= g_end; k += kStep) {
      for (int64_t u = 0; u < kUnroll; ++u) {
        const fVec wv = widen_int8(w + k + u * fVec::size());
        for (int64_t r = 0; r < ROWS; ++r)
          sums[r][u] = at::vec::fmadd(fVec::loadu(x + r * k_size + k + u * fVec::size()), wv, sums[r][u]);
      }
    }
    for (; k + fVec::size() <= g_end; k += fVec::size()) {
      const fVec wv = widen_int8(w + k);
      for (int64_t r = 0; r < ROWS; ++r) sums[r][0] = at::vec::fmadd(fVec::loadu(x + r * k_size + k), wv, sums[r][0]);
    }
    for (int64_t r = 0; r < ROWS; ++r) {
      fVec group_sum = sums[r][0];
      for (int64_t u = 1; u < kUnroll; ++u) group_sum = group_sum + sums[r][u];
      totals[r] = at::vec::fmadd(group_sum, scale, totals[r]);
      float tail = 0.f;
      for (int64_t kk = k; kk < g_end; ++kk) tail += x[r * k_size + kk] * static_cast<float>(w[kk]);
      tails[r] += tail * scales[g0 / group_size];
    }
  }
  for (int64_t r = 0; r < ROWS; ++r) {
    float lanes[fVec::size()];
    totals[r].store(lanes);
    float total = tails[r];
    for (int64_t i = 0; i < fVec::size(); ++i) total += lanes[i];
    acc[r] = total;
  }
}

// dot_rows for a block of 1..kInt8Rows rows. Every block goes through here: inlined straight into the
// parallel loop, dot_rows ran up to 1.7x slower (its sizes reloaded from the lambda's captures).
inline void dot_block(int64_t rows, const float* x, int64_t k_size, const int8_t* w, const float* scales,
                      int64_t group_size, float* acc) {
  switch (rows) {
    case 1: return dot_rows<1>(x, k_size, w, scales, group_size, acc);
    case 2: return dot_rows<2>(x, k_size, w, scales, group_size, acc);
    case 3: return dot_rows<3>(x, k_size, w, scales, group_size, acc);
    case 4: return dot_rows<4>(x, k_size, w, scales, group_size, acc);
    default: TORCH_CHECK(false, "dot_block: ", rows, " rows");
  }
}

// y[M, N] = x[M, K] W^T with W[n, k] = q[n, k] * scales[n, k / group]: float32 accumulation, each output
// rounded once to x's dtype, as a half-precision GEMM with float32 accumulation rounds (the reference
// dequantises and matmuls).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  check_cpu(x, "x");
  check_cpu(qweight, "qweight");
  check_cpu(scales, "scales");
  TORCH_CHECK(x.dim() == 2, "int8_linear: x must be 2-D [rows, in_features]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar, "int8_linear: qweight must be int8 [out, in]");
  TORCH_CHECK(qweight.size(1) == x.size(1), "int8_linear: x has ", x.size(1), " features, qweight ", qweight.size(1));
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == qweight.size(0) && scales.scalar_type() == at::kFloat,
              "int8_linear: scales must be float32 [out, groups]");
  const int64_t rows = x.size(0), k_size = x.size(1), n_size = qweight.size(0), groups = scales.size(1);
  TORCH_CHECK(groups >= 1 && k_size % groups == 0, "int8_linear: ", groups, " scale groups do not divide ", k_size,
              " in_features");
  const int64_t group_size = k_size / groups;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor q = qweight.contiguous(), sc = scales.contiguous();
  at::Tensor out = at::empty({rows, n_size}, x.options());
  dispatch_dtype(x.scalar_type(), "int8_linear", [&]<typename scalar_t>() {
    const float* xp = xf.data_ptr<float>();
    const int8_t* qp = q.data_ptr<int8_t>();
    const float* sp = sc.data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n_size, 16, [&](int64_t begin, int64_t end) {
      float acc[kInt8Rows];
      for (int64_t n = begin; n < end; ++n) {
        const int8_t* wr = qp + n * k_size;
        const float* row_scales = sp + n * groups;
        for (int64_t r = 0; r < rows; r += kInt8Rows) {
          const int64_t block = std::min(kInt8Rows, rows - r);
          dot_block(block, xp + r * k_size, k_size, wr, row_scales, group_size, acc);
          for (int64_t i = 0; i < block; ++i) op[(r + i) * n_size + n] = static_cast<scalar_t>(acc[i]);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(meshserve_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(meshserve_cpu, CPU, m) {
  m.impl("int8_linear", &int8_linear);
}

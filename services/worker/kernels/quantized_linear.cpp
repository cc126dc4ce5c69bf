// Native weight-only linears for the worker's CPU: int8 rows with float32 scales per group of input columns
// (--quantization int8, and GGUF's Q8_0), 4-bit codes with a scale and an offset per block of 32 columns
// (GGUF's Q4_0 and Q4_1, --quantization gguf), and bf16/fp16 weights read as they are for small steps (where
// the CPU has no native half-precision GEMM, or by vdpbf16ps where it has AVX512-BF16). Registered into
// torch.ops.meshserve_cpu beside cpu_ops.cpp's kernels; built and loaded by kernels/loader.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <vector>

#include "cpu_common.h"

namespace {

using namespace meshserve_kernels;

// x's rows as contiguous float32 for the kernels below: x's own data when it is float32, else x widened
// (exactly) into a buffer the calling thread keeps from call to call. A decode step makes ~120 kernel calls,
// and widening into a new tensor each time (an allocation and a dispatched copy) cost ~0.5 ms of a SmolLM2
// step on the Zen 3 EPYC (docs/benchmarks.md). Past kScratchFloats (16 rows of 4,096 columns; the kernels
// take small steps) the widened copy is a tensor of its own, so the retained buffer stays bounded.
constexpr int64_t kScratchFloats = 1 << 16;

struct FloatRows {
  // Holds the widened copy when it did not fit the scratch buffer.
  at::Tensor owned;
  const float* data;
};

inline FloatRows float_rows(const at::Tensor& xc) {
  if (xc.scalar_type() == at::kFloat) return {at::Tensor(), xc.data_ptr<float>()};
  const int64_t n = xc.numel();
  thread_local std::vector<float> scratch;
  at::Tensor owned;
  float* dst;
  if (n <= kScratchFloats) {
    if (static_cast<int64_t>(scratch.size()) < n) scratch.resize(n);
    dst = scratch.data();
  } else {
    owned = at::empty({n}, xc.options().dtype(at::kFloat));
    dst = owned.data_ptr<float>();
  }
  dispatch_dtype(xc.scalar_type(), "float_rows", [&]<typename scalar_t>() { to_float(xc.data_ptr<scalar_t>(), dst, n); });
  return {owned, dst};
}

// --------------------------------------------------------------------------------- int8 weight-only linear

// Rows of x handled per pass over a weight row: each int8 vector is widened once and used for all of
// them, so a decode batch reads the int8 weights from memory once per step (the point of weight-only
// quantisation: decode is bound by the bytes of weights it reads). Blocks of 4 measured best on AVX2;
// wider blocks ran up to twice as long per row (docs/benchmarks.md).
constexpr int64_t kInt8Rows = 4;

// The sum of N vectors' lanes: the vectors added in order, then their lanes one by one.
template <int64_t N>
inline float lane_total(const fVec (&sums)[N]) {
  fVec total_vec = sums[0];
  for (int64_t u = 1; u < N; ++u) total_vec = total_vec + sums[u];
  float lanes[fVec::size()];
  total_vec.store(lanes);
  float total = 0.f;
  for (int64_t i = 0; i < fVec::size(); ++i) total += lanes[i];
  return total;
}

// step(i, u) for every i in [0, count): groups of U with slots u = 0..U-1 (constants once unrolled, so each
// slot's sums stay in registers and U FMA chains run at once), the remainder in slot 0.
template <int64_t U, typename Fn>
inline void unrolled(int64_t count, Fn&& step) {
  int64_t i = 0;
  for (; i + U <= count; i += U)
    for (int64_t u = 0; u < U; ++u) step(i + u, u);
  for (; i < count; ++i) step(i, 0);
}

// Calls fn.template operator()<R>() for R = rows, one of 1..N: a kernel's row count as a template argument,
// so its per-row sums are arrays of constant size that live in registers.
template <int64_t N, typename Fn>
inline void with_rows(int64_t rows, const char* op, Fn&& fn) {
  [&]<int64_t... R>(std::integer_sequence<int64_t, R...>) {
    const bool ran = ((rows == R + 1 ? (fn.template operator()<R + 1>(), true) : false) || ...);
    TORCH_CHECK(ran, op, ": ", rows, " rows");
  }(std::make_integer_sequence<int64_t, N>{});
}

// Weight rows ahead of the one being multiplied whose cache lines are asked for early: a decode step streams
// every weight from memory once, and with the arithmetic between the loads the hardware prefetcher fell
// behind (a SmolLM2 step's int4 matmuls 10.0 -> 8.2 ms; docs/benchmarks.md).
constexpr int64_t kPrefetchRows = 12;

// Asks for the `bytes` bytes at p, a cache line at a time.
inline void prefetch(const void* p, int64_t bytes) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
#else
  (void)p;
  (void)bytes;
#endif
}

// Asks for row n + ahead of each weight array (its base and bytes a row) while it is before end.
inline void prefetch_ahead(int64_t n, int64_t end, std::initializer_list<std::pair<const void*, int64_t>> arrays,
                           int64_t ahead = kPrefetchRows) {
  if (n + ahead >= end) return;
  for (const auto& [base, row_bytes] : arrays)
    prefetch(static_cast<const char*>(base) + (n + ahead) * row_bytes, row_bytes);
}

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

// Groups of up to this many weights (GGUF's Q8_0 has 32) take dot_rows_scaled: with a scale every vector
// or two, dot_rows' per-group sums would chain every FMA of a group into one.
constexpr int64_t kSmallGroup = 64;

// dot_rows for small groups of whole vectors: each weight vector is widened and multiplied by its group's
// scale once (q * scale is exact in float32: 8 by 11 significant bits), then FMA'd into every row's sums,
// which run through the whole row in kUnroll independent chains.
template <int64_t ROWS>
inline void dot_rows_scaled(const float* x, int64_t k_size, const int8_t* w, const float* scales,
                            int64_t group_size, float* acc) {
  constexpr int64_t kUnroll = ROWS == 1 ? 4 : 2;
  fVec sums[ROWS][kUnroll];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t u = 0; u < kUnroll; ++u) sums[r][u] = fVec(0.f);
  // Vectors per group are a power of two (dot_block checks), so a vector's group is a shift away (a
  // division per vector ran the kernel at half speed).
  const int64_t vectors = k_size / fVec::size();
  const int shift = __builtin_ctzll(static_cast<uint64_t>(group_size / fVec::size()));
  auto vector = [&](int64_t v, int64_t u) {
    const int64_t k = v * fVec::size();
    const fVec wv = widen_int8(w + k) * fVec(scales[v >> shift]);
    for (int64_t r = 0; r < ROWS; ++r) sums[r][u] = at::vec::fmadd(fVec::loadu(x + r * k_size + k), wv, sums[r][u]);
  };
  unrolled<kUnroll>(vectors, vector);
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = lane_total(sums[r]);
}

// dot_rows for a block of 1..kInt8Rows rows. Every block goes through here: inlined straight into the
// parallel loop, dot_rows ran up to 1.7x slower (its sizes reloaded from the lambda's captures).
inline void dot_block(int64_t rows, const float* x, int64_t k_size, const int8_t* w, const float* scales,
                      int64_t group_size, float* acc) {
  const int64_t per_group = group_size / fVec::size();
  if (group_size <= kSmallGroup && group_size % fVec::size() == 0 && (per_group & (per_group - 1)) == 0)
    return with_rows<kInt8Rows>(rows, "dot_block", [&]<int64_t R>() {
      dot_rows_scaled<R>(x, k_size, w, scales, group_size, acc);
    });
  with_rows<kInt8Rows>(rows, "dot_block", [&]<int64_t R>() { dot_rows<R>(x, k_size, w, scales, group_size, acc); });
}

// A one-row step (a single decode) against per-row scales in float: fp32 x, or x that is not finite (half
// precision x takes int_dot_row below). kInt8WeightRows weight rows a pass, so each x vector is loaded once
// for all of them and their sums are independent FMA chains. One weight row a pass (dot_rows) ran below the
// memory's rate even with the weights in cache, its serial reduction and dispatch per row on top of the
// widening: int8 was bound by arithmetic (docs/benchmarks.md).
constexpr int64_t kInt8WeightRows = 4;
// Sums per output: with kInt8WeightRows outputs a pass, 2 chains each keep 8 FMAs in flight within 16 registers.
constexpr int64_t kInt8Chains = 2;

// acc[j] = scales[j] * sum_k x[k] * w[j][k] for NB int8 weight rows (row stride k_size). Each output's sums
// run the same way whatever NB, so a weight row's output does not depend on the rows it shares a pass with.
template <int64_t NB>
inline void dot_one_row(const float* x, int64_t k_size, const int8_t* w, const float* scales, float* acc) {
  fVec sums[NB][kInt8Chains];
  for (int64_t j = 0; j < NB; ++j)
    for (int64_t u = 0; u < kInt8Chains; ++u) sums[j][u] = fVec(0.f);
  auto vector = [&](int64_t v, int64_t u) {
    const int64_t k = v * fVec::size();
    const fVec xv = fVec::loadu(x + k);
    for (int64_t j = 0; j < NB; ++j) sums[j][u] = at::vec::fmadd(xv, widen_int8(w + j * k_size + k), sums[j][u]);
  };
  const int64_t vectors = k_size / fVec::size();
  unrolled<kInt8Chains>(vectors, vector);
  for (int64_t j = 0; j < NB; ++j) {
    float total = lane_total(sums[j]);
    for (int64_t k = vectors * fVec::size(); k < k_size; ++k) total += x[k] * static_cast<float>(w[j * k_size + k]);
    acc[j] = total * scales[j];
  }
}

// One-row steps in integers. Widening each int8 weight to float before its FMA (dot_one_row) costs three
// instructions per 8 weights, and on a CPU whose AVX2 units are 128 bits wide (the Zen 1 EPYC) that bound
// the kernel below the memory's rate (~9 GB/s from the L3; docs/benchmarks.md). Rounded to int16, x meets
// the weights in vpmaddwd: three instructions per 16 weights, exact integer sums. The rounding is x's one
// loss: one scale per row (max|x| -> kXLevels), an error of at most max|x| / 65534 an element -- below
// bf16's own rounding of all but x's smallest elements, and far below int8 weights' (docs/benchmarks.md,
// the precision check). Where x is not finite, the float path runs instead, so inf and NaN propagate; so it
// does for float32 x (see int8_linear).
constexpr int64_t kXLevels = 32767;
// Integer sums widened to float and added once per span: an int32 lane adds two products of at most
// 128 * kXLevels per vector of 16 columns, so 128 vectors stay a quarter below 2^31.
constexpr int64_t kIntSpanColumns = 2048;
constexpr int64_t kIntVector = 16;

// x's one row rounded (half to even) to int16 with scale max|x| / kXLevels, into a buffer the calling thread
// keeps; false where x holds inf or NaN. The scale is 0 (and every code 0) for an all-zero row.
inline bool round_row_to(const float* x, int64_t k_size, int16_t* codes, float& scale) {
  float amax = 0.f, poison = 0.f;
  for (int64_t k = 0; k < k_size; ++k) {
    amax = std::max(amax, std::fabs(x[k]));
    poison += x[k] * 0.f;  // NaN once any element is inf or NaN (a comparison would skip a NaN)
  }
  if (!std::isfinite(amax) || std::isnan(poison)) return false;
  scale = amax / static_cast<float>(kXLevels);
  const float inv = amax > 0.f ? static_cast<float>(kXLevels) / amax : 0.f;
  int64_t k = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const __m256 inv_v = _mm256_set1_ps(inv);
  for (; k + 8 <= k_size; k += 8) {
    const __m256i rounded = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), inv_v));
    const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + k), packed);
  }
#endif
  for (; k < k_size; ++k) codes[k] = static_cast<int16_t>(std::nearbyint(x[k] * inv));
  return true;
}

inline bool round_row(const float* x, int64_t k_size, std::vector<int16_t>& codes, float& scale) {
  codes.resize(k_size);
  return round_row_to(x, k_size, codes.data(), scale);
}

// x_scale * scale * sum_k codes[k] * w[k] for one int8 weight row: the sums exact in int32 within each span,
// widened and added in float across spans. One weight row a pass: x's codes come from L1 whatever the
// count, and on the Zen 1 EPYC passes of 4 rows (four memory streams) read a matrix from memory at 9.1
// GB/s against 12.9 for one (docs/benchmarks.md). Integer sums are exact, so an output never depends on the
// rows beside it.
inline float int_dot_row(const int16_t* codes, int64_t k_size, const int8_t* w, float x_scale, float scale) {
  const int64_t vectors = k_size / kIntVector;
  float total = 0.f;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  constexpr int64_t kSpanVectors = kIntSpanColumns / kIntVector;
  auto codes_at = [&](int64_t v) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + v * kIntVector));
  };
  auto product = [&](int64_t v) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + v * kIntVector));
    return _mm256_madd_epi16(codes_at(v), _mm256_cvtepi8_epi16(bytes));
  };
  __m256 fsum = _mm256_setzero_ps();
  for (int64_t v0 = 0; v0 < vectors; v0 += kSpanVectors) {
    const int64_t v1 = std::min(vectors, v0 + kSpanVectors);
    // Two sums (exact integers: how the vectors split between them changes nothing).
    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
    int64_t v = v0;
    for (; v + 2 <= v1; v += 2) {
      even = _mm256_add_epi32(even, product(v));
      odd = _mm256_add_epi32(odd, product(v + 1));
    }
    if (v < v1) even = _mm256_add_epi32(even, product(v));
    fsum = _mm256_add_ps(fsum, _mm256_cvtepi32_ps(_mm256_add_epi32(even, odd)));
  }
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(fsum), _mm256_extractf128_ps(fsum, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  total = _mm_cvtss_f32(_mm_add_ss(four, _mm_shuffle_ps(four, four, 1)));
#else
  // The portable build: each span's exact sum, widened and added in float (the compiler vectorises the span).
  for (int64_t k0 = 0; k0 < vectors * kIntVector; k0 += kIntSpanColumns) {
    const int64_t k1 = std::min(vectors * kIntVector, k0 + kIntSpanColumns);
    int32_t span = 0;
    for (int64_t k = k0; k < k1; ++k) span += static_cast<int32_t>(codes[k]) * w[k];
    total += static_cast<float>(span);
  }
#endif
  int32_t tail = 0;
  for (int64_t k = vectors * kIntVector; k < k_size; ++k) tail += static_cast<int32_t>(codes[k]) * w[k];
  return (total + static_cast<float>(tail)) * x_scale * scale;
}

// ------------------------------------------------------------------------------- int8 weights in tiles

#if defined(CPU_CAPABILITY_AVX512)
// int8 weights (one scale a row) packed as the bf16 tiles are ([N/16, K/32, 16, 16, 2], int8): row p of tile
// (nb, kb) holds 16 weight rows' columns kb*32 + 2p and + 1, so one 32-byte load, widened to int16, is 16 outputs'
// pair of columns, and vpdpwssd (vpmaddwd and vpaddd without VNNI) adds its products with a broadcast pair of x's
// int16 codes into 16 outputs' integer sums at once: no horizontal sum per output, and each weight vector read once
// for a block of rows. The plain layout's one-row path (int_dot_row) read a SmolLM2 step's 135 MB at ~17 GB/s on
// the AMX Xeon where the bf16 tiles read at ~25, and its larger steps widened every weight to float per 4 rows
// (docs/benchmarks.md). Every row of x is rounded to int16 codes (round_row's rounding), so a row's output is
// the same integer sums whatever its batch.
// 16-output tile columns a pass multiplies at once, and rows of x, in the tile kernels without AMX (int8 here,
// bf16 by vdpbf16ps below): 3 x 8 blocks of 16 sums, 3 weight vectors and a broadcast fill 28 of the 32 vector
// registers, and each broadcast of x feeds three products.
constexpr int64_t kDotTileGroup = 3, kDotTileRows = 8;
// Column pairs summed in int32 before the sums are widened to float: a vpdpwssd adds at most 2 * 128 * 32767
// (8,388,352) to a lane, 256 of them at most 2,147,418,112 < 2^31.
constexpr int64_t kInt8TileSpanPairs = 256;
// Bytes asked for ahead of the pair row being multiplied, in each tile column a pass reads (the bf16 tiles' 4 KB).
constexpr int64_t kInt8TilePrefetchBytes = 4096;

// acc[r][b * 16 + i] += sum over column pairs of codes[r] . tile column b's output i, for ROWS rows of codes (row
// stride k_size) and NB consecutive 16-output tile columns (w: the first one's [K/32, 16, 16, 2] int8, tile_bytes
// apart). Each output's integer sums run over the pairs in order and are widened once a span, whatever ROWS and NB.
template <int64_t ROWS, int64_t NB>
inline void int8_dot_tiles(const int16_t* codes, int64_t k_size, const int8_t* w, int64_t tile_bytes, float* acc) {
  const int64_t pairs = k_size / 2;  // a multiple of 16 (whole tiles)
  for (int64_t p0 = 0; p0 < pairs; p0 += kInt8TileSpanPairs) {
    const int64_t p1 = std::min(pairs, p0 + kInt8TileSpanPairs);
    __m512i sums[ROWS][NB];
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t b = 0; b < NB; ++b) sums[r][b] = _mm512_setzero_si512();
    for (int64_t kp = p0; kp < p1; kp += 2) {
      // Two pair rows of 32 bytes: one cache line of each tile column.
      for (int64_t b = 0; b < NB; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(w + b * tile_bytes + kp * 32 + kInt8TilePrefetchBytes), _MM_HINT_T0);
      for (int64_t h = 0; h < 2; ++h) {
        __m512i wv[NB];
        for (int64_t b = 0; b < NB; ++b)
          wv[b] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * tile_bytes + (kp + h) * 32)));
        for (int64_t r = 0; r < ROWS; ++r) {
          int32_t pair;
          std::memcpy(&pair, codes + r * k_size + 2 * (kp + h), sizeof(pair));
          const __m512i xv = _mm512_set1_epi32(pair);
          for (int64_t b = 0; b < NB; ++b) {
#if defined(__AVX512VNNI__)
            sums[r][b] = _mm512_dpwssd_epi32(sums[r][b], xv, wv[b]);
#else
            sums[r][b] = _mm512_add_epi32(sums[r][b], _mm512_madd_epi16(xv, wv[b]));
#endif
          }
        }
      }
    }
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t b = 0; b < NB; ++b) {
        float* a = acc + (r * NB + b) * 16;
        _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_cvtepi32_ps(sums[r][b])));
      }
  }
}

// int8_linear's body for bf16 or fp16 x and a tile-packed int8 weight with one scale a row: x's rows rounded to
// int16 codes, then groups of kDotTileGroup tile columns split over the threads and, in each, blocks of
// kDotTileRows rows (3 x 8 blocks of 16 integer sums, 3 weight vectors and a broadcast: 28 of the 32 registers), the
// group's weights (48 x K bytes) reused from cache after the first block. A row of x that holds inf or NaN has no
// codes: its outputs are NaN.
void int8_linear_tiles(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales, at::Tensor& out) {
  const int64_t rows = x.size(0), k_size = x.size(1), n_tiles = tiles.size(0);
  const int64_t n_size = n_tiles * 16, tile_bytes = 16 * k_size;
  const at::Tensor xc = x.contiguous();
  const FloatRows xf = float_rows(xc);
  // x's codes in a buffer the calling thread keeps, as float_rows keeps x widened, and within the same bound: a
  // larger step's codes are a buffer of this call's own.
  thread_local std::vector<int16_t> kept_codes;
  std::vector<int16_t> own_codes;
  std::vector<int16_t>& codes = rows * k_size <= kScratchFloats ? kept_codes : own_codes;
  codes.resize(rows * k_size);
  std::vector<float> x_scales(rows);
  for (int64_t r = 0; r < rows; ++r)
    if (!round_row_to(xf.data + r * k_size, k_size, codes.data() + r * k_size, x_scales[r]))
      x_scales[r] = std::numeric_limits<float>::quiet_NaN();
  const int16_t* cp = codes.data();
  const float* xs = x_scales.data();
  const int8_t* wp = tiles.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const int64_t groups = (n_tiles + kDotTileGroup - 1) / kDotTileGroup;
  dispatch_dtype(x.scalar_type(), "int8_linear", [&]<typename scalar_t>() {
    scalar_t* yp = out.data_ptr<scalar_t>();
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      alignas(64) float acc[kDotTileRows * kDotTileGroup * 16];
      for (int64_t g = begin; g < end; ++g) {
        const int64_t t0 = g * kDotTileGroup, nb = std::min(kDotTileGroup, n_tiles - t0);
        const int8_t* w = wp + t0 * tile_bytes;
        for (int64_t r = 0; r < rows; r += kDotTileRows) {
          const int64_t block = std::min(kDotTileRows, rows - r);
          std::fill(acc, acc + block * nb * 16, 0.f);
          const int16_t* cr = cp + r * k_size;
          with_rows<kDotTileRows>(block, "int8_linear_tiles", [&]<int64_t R>() {
            if (nb == 3) {
              int8_dot_tiles<R, 3>(cr, k_size, w, tile_bytes, acc);
            } else if (nb == 2) {
              int8_dot_tiles<R, 2>(cr, k_size, w, tile_bytes, acc);
            } else {
              int8_dot_tiles<R, 1>(cr, k_size, w, tile_bytes, acc);
            }
          });
          // As int_dot_row: the exact sums times x's scale, then the weight row's, rounded once to x's dtype.
          for (int64_t i = 0; i < block; ++i) {
            const float x_scale = xs[r + i];
            scalar_t* y = yp + (r + i) * n_size + t0 * 16;
            const float* a = acc + i * nb * 16;
            for (int64_t c = 0; c < nb * 16; ++c) y[c] = static_cast<scalar_t>(a[c] * x_scale * sp[t0 * 16 + c]);
          }
        }
      }
    });
  });
}
#endif

// Whether int8_linear takes tile-packed int8 weights here (an AVX-512 build). The platform packs an int8 model's
// weights of one scale a row into tiles only where it does, and for bf16 or fp16 compute (platforms/cpu_native_ops.py).
bool int8_linear_takes_tiles() {
#if defined(CPU_CAPABILITY_AVX512)
  return true;
#else
  return false;
#endif
}

// y[M, N] = x[M, K] W^T with W[n, k] = q[n, k] * scales[n, k / group]: float32 accumulation, each output
// rounded once to x's dtype, as a half-precision GEMM with float32 accumulation rounds (the reference
// dequantises and matmuls).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  check_cpu(x, "x");
  check_cpu(qweight, "qweight");
  check_cpu(scales, "scales");
  TORCH_CHECK(x.dim() == 2, "int8_linear: x must be 2-D [rows, in_features]");
  if (qweight.dim() == 5) {
    // Tile-packed [N/16, K/32, 16, 16, 2] (int8_linear_takes_tiles), one scale a row, half-precision x.
    TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.size(2) == 16 && qweight.size(3) == 16 &&
                    qweight.size(4) == 2 && qweight.is_contiguous(),
                "int8_linear: a tile-packed qweight must be contiguous int8 [out/16, in/32, 16, 16, 2]");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
                "int8_linear: a tile-packed qweight takes bfloat16 or float16 x, got ", x.scalar_type());
    TORCH_CHECK(qweight.size(1) * 32 == x.size(1), "int8_linear: x has ", x.size(1), " features, the tiles ",
                qweight.size(1) * 32);
    TORCH_CHECK(scales.dim() == 2 && scales.size(0) == qweight.size(0) * 16 && scales.size(1) == 1 &&
                    scales.scalar_type() == at::kFloat && scales.is_contiguous(),
                "int8_linear: a tile-packed qweight takes contiguous float32 scales [out, 1]");
    at::Tensor out = at::empty({x.size(0), qweight.size(0) * 16}, x.options());
    if (x.size(0) == 0) return out;
#if defined(CPU_CAPABILITY_AVX512)
    int8_linear_tiles(x, qweight, scales, out);
    return out;
#else
    TORCH_CHECK(false, "int8_linear: this kernel library was built without AVX-512; a tile-packed qweight needs it "
                "(the platform packs none where int8_linear_takes_tiles() is false)");
#endif
  }
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar, "int8_linear: qweight must be int8 [out, in]");
  TORCH_CHECK(qweight.size(1) == x.size(1), "int8_linear: x has ", x.size(1), " features, qweight ", qweight.size(1));
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == qweight.size(0) && scales.scalar_type() == at::kFloat,
              "int8_linear: scales must be float32 [out, groups]");
  const int64_t rows = x.size(0), k_size = x.size(1), n_size = qweight.size(0), groups = scales.size(1);
  TORCH_CHECK(groups >= 1 && k_size % groups == 0, "int8_linear: ", groups, " scale groups do not divide ", k_size,
              " in_features");
  const int64_t group_size = k_size / groups;
  const at::Tensor xc = x.contiguous();
  const FloatRows xf = float_rows(xc);
  const at::Tensor q = qweight.contiguous(), sc = scales.contiguous();
  at::Tensor out = at::empty({rows, n_size}, x.options());
  dispatch_dtype(x.scalar_type(), "int8_linear", [&]<typename scalar_t>() {
    const float* xp = xf.data;
    const int8_t* qp = q.data_ptr<int8_t>();
    const float* sp = sc.data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    if (rows == 1 && groups == 1) {
      thread_local std::vector<int16_t> codes;
      float x_scale = 0.f;
      // float32 x keeps the float path: an fp32 precision asks for fp32 arithmetic, and a request's
      // output in it then changes with its batch only by the order of sums (larger steps never round x).
      const bool integer = x.scalar_type() != at::kFloat && round_row(xp, k_size, codes, x_scale);
      if (integer) {
        const int16_t* cp = codes.data();
        at::parallel_for(0, n_size, 16, [&](int64_t begin, int64_t end) {
          for (int64_t n = begin; n < end; ++n) {
            prefetch_ahead(n, end, {{qp, k_size}});
            op[n] = static_cast<scalar_t>(int_dot_row(cp, k_size, qp + n * k_size, x_scale, sp[n]));
          }
        });
        return;
      }
      at::parallel_for(0, n_size, 16, [&](int64_t begin, int64_t end) {
        float acc[kInt8WeightRows];
        for (int64_t n = begin; n < end; n += kInt8WeightRows) {
          const int64_t count = std::min(kInt8WeightRows, end - n);
          for (int64_t j = 0; j < count; ++j) prefetch_ahead(n + j, end, {{qp, k_size}});
          if (count == kInt8WeightRows) {
            dot_one_row<kInt8WeightRows>(xp, k_size, qp + n * k_size, sp + n, acc);
          } else {
            for (int64_t j = 0; j < count; ++j) dot_one_row<1>(xp, k_size, qp + (n + j) * k_size, sp + n + j, acc + j);
          }
          for (int64_t j = 0; j < count; ++j) op[n + j] = static_cast<scalar_t>(acc[j]);
        }
      });
      return;
    }
    at::parallel_for(0, n_size, 16, [&](int64_t begin, int64_t end) {
      float acc[kInt8Rows];
      for (int64_t n = begin; n < end; ++n) {
        prefetch_ahead(n, end, {{qp, k_size}, {sp, groups * 4}});
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

// ------------------------------------------------------------------------- half-precision weight linear

// Where the CPU has no native bf16/fp16 GEMM (AVX2 hosts, AVX-512 without BF16, the portable build) the
// packed GEMM runs on fp32 copies of the weights, which doubles the bytes a decode step reads. This one
// reads the bf16/fp16 weight itself and widens it in registers: the same products and float32 sums, half
// the memory traffic.

// fVec::size() bf16 or fp16 weights widened to float: bf16 is the top half of a float32 (a 16-bit shift),
// fp16 goes through F16C's vcvtph2ps. A scalar widening on the portable build.
inline fVec widen_half(const at::BFloat16* w) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return fVec(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return fVec(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
#else
  float lanes[fVec::size()];
  for (int64_t i = 0; i < fVec::size(); ++i) lanes[i] = static_cast<float>(w[i]);
  return fVec::loadu(lanes);
#endif
}

inline fVec widen_half(const at::Half* w) {
#if defined(CPU_CAPABILITY_AVX512)
  return fVec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))));
#elif defined(CPU_CAPABILITY_AVX2)
  return fVec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
#else
  float lanes[fVec::size()];
  for (int64_t i = 0; i < fVec::size(); ++i) lanes[i] = static_cast<float>(w[i]);
  return fVec::loadu(lanes);
#endif
}

// Rows of x per pass over a weight row, as kInt8Rows: each widened vector serves them all.
constexpr int64_t kHalfRows = 4;
// Independent sums per row. The same for every row count, so a row's result never depends on how many
// rows share its pass (one request's logits do not change with the batch it decodes in).
constexpr int64_t kHalfChains = 2;

// acc[r] = sum_k x[r][k] * w[k] for ROWS rows of x (row stride k_size) and one half-precision weight row.
template <int64_t ROWS, typename w_t>
inline void half_dot_rows(const float* x, int64_t k_size, const w_t* w, float* acc) {
  fVec sums[ROWS][kHalfChains];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t u = 0; u < kHalfChains; ++u) sums[r][u] = fVec(0.f);
  auto vector = [&](int64_t v, int64_t u) {
    const int64_t k = v * fVec::size();
    const fVec wv = widen_half(w + k);
    for (int64_t r = 0; r < ROWS; ++r) sums[r][u] = at::vec::fmadd(fVec::loadu(x + r * k_size + k), wv, sums[r][u]);
  };
  const int64_t vectors = k_size / fVec::size();
  unrolled<kHalfChains>(vectors, vector);
  for (int64_t r = 0; r < ROWS; ++r) {
    float total = lane_total(sums[r]);
    for (int64_t k = vectors * fVec::size(); k < k_size; ++k) total += x[r * k_size + k] * static_cast<float>(w[k]);
    acc[r] = total;
  }
}

template <typename w_t>
inline void half_dot_block(int64_t rows, const float* x, int64_t k_size, const w_t* w, float* acc) {
  with_rows<kHalfRows>(rows, "half_dot_block", [&]<int64_t R>() { half_dot_rows<R>(x, k_size, w, acc); });
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// bf16 x against bf16 weights on an AVX512-BF16 CPU: vdpbf16ps multiplies 32 weights by 32 of x's columns at
// once, exactly, into float32 sums, and it pairs adjacent columns, so both operands are read in their natural
// order: nothing is widened or rearranged, and a pass costs a load and one instruction per row for every 32
// weights. oneDNN's bf16 GEMM (AMX or avx512_bf16) is built for larger steps: on a decode step of 1-4 rows it
// reads the weights below the memory's rate (a SmolLM2 step's matmuls at one row on the AMX Xeon: oneDNN
// 14.8 ms, this path 13.3, the floor at the host's 24 GB/s 11.2; docs/benchmarks.md).
constexpr int64_t kBf16Lanes = 32;
// Rows per pass: a row adds a load and a vdpbf16ps per 32 weights, so more rows share one read of the
// weights than the widening path's 4.
constexpr int64_t kHalfBf16Rows = 8;
// Weight rows prefetched ahead: with one instruction per 32 weights a row, kPrefetchRows' 4 rows left the
// loads waiting (a SmolLM2 step's matmuls at one row on the AMX Xeon: 15.1-16.5 ms at 4 ahead, 13.1-13.4 at 8;
// 12 no better). The int kernels' rows are a half or a quarter of the bytes and gained nothing from 8.
constexpr int64_t kHalfBf16Prefetch = 8;

// acc[r] = sum_k x[r][k] * w[k] for ROWS bf16 rows of x (row stride k_size) and one bf16 weight row, in
// kHalfChains sums per row whatever ROWS (a row's result does not depend on the rows beside it); the last
// k_size % 32 columns go through masked loads, whose zeroed lanes add nothing.
template <int64_t ROWS>
inline void half_dot_rows_bf16(const at::BFloat16* x, int64_t k_size, const at::BFloat16* w, float* acc) {
  __m512 sums[ROWS][kHalfChains];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t u = 0; u < kHalfChains; ++u) sums[r][u] = _mm512_setzero_ps();
  auto vector = [&](int64_t v, int64_t u) {
    const int64_t k = v * kBf16Lanes;
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + k));
    for (int64_t r = 0; r < ROWS; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(x + r * k_size + k));
      sums[r][u] = _mm512_dpbf16_ps(sums[r][u], xv, wv);
    }
  };
  const int64_t vectors = k_size / kBf16Lanes;
  unrolled<kHalfChains>(vectors, vector);
  if (const int64_t tail = k_size - vectors * kBf16Lanes; tail > 0) {
    const __mmask32 live = static_cast<__mmask32>((1ull << tail) - 1);
    const int64_t k = vectors * kBf16Lanes;
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(live, w + k);
    for (int64_t r = 0; r < ROWS; ++r)
      sums[r][0] = _mm512_dpbf16_ps(sums[r][0], (__m512bh)_mm512_maskz_loadu_epi16(live, x + r * k_size + k), wv);
  }
  for (int64_t r = 0; r < ROWS; ++r) {
    __m512 total = sums[r][0];
    for (int64_t u = 1; u < kHalfChains; ++u) total = _mm512_add_ps(total, sums[r][u]);
    acc[r] = _mm512_reduce_add_ps(total);
  }
}

inline void half_dot_block_bf16(int64_t rows, const at::BFloat16* x, int64_t k_size, const at::BFloat16* w,
                                float* acc) {
  with_rows<kHalfBf16Rows>(rows, "half_dot_block_bf16", [&]<int64_t R>() { half_dot_rows_bf16<R>(x, k_size, w, acc); });
}

// half_linear's body for bf16 x and bf16 weights on this CPU.
void half_linear_bf16(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const int64_t rows = x.size(0), k_size = x.size(1), n_size = w.size(0);
  const at::Tensor xc = x.contiguous();
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  at::BFloat16* yp = out.data_ptr<at::BFloat16>();
  const int64_t row_bytes = k_size * 2;
  at::parallel_for(0, n_size, 16, [&](int64_t begin, int64_t end) {
    float acc[kHalfBf16Rows];
    for (int64_t n = begin; n < end; ++n) {
      prefetch_ahead(n, end, {{wp, row_bytes}}, kHalfBf16Prefetch);
      for (int64_t r = 0; r < rows; r += kHalfBf16Rows) {
        const int64_t block = std::min(kHalfBf16Rows, rows - r);
        half_dot_block_bf16(block, xp + r * k_size, k_size, wp + n * k_size, acc);
        for (int64_t i = 0; i < block; ++i) yp[(r + i) * n_size + n] = static_cast<at::BFloat16>(acc[i]);
      }
    }
  });
}
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// bf16 weights packed into tiles (layers/quantization.py's tile_half_weight: [N/16, K/32, 16, 16, 2]) on an
// AVX512-BF16 CPU without AMX, or where the process was refused the tile state. A tile's row p is 16 outputs'
// pair of columns 2p, 2p + 1: one vector that vdpbf16ps multiplies by a pair of x's columns broadcast, into 16
// float32 sums at once. So a pass keeps blocks of 16 sums for several rows in registers and reads each weight
// vector once for all of them, where the plain layout's path sums one output at a time and reads the weights
// again every 8 rows. oneDNN's avx512_bf16 GEMM reorders the weights on every call, which costs
// a decode step of a few dozen rows as much as the arithmetic (a SmolLM2 step's matmuls on the Zen 4 EPYC at
// 1 / 32 / 64 rows: oneDNN 14.9 / 29.7 / 57.4 ms; docs/benchmarks.md).
// (kDotTileGroup and kDotTileRows: with the int8 tiles above.)
// Weight rows (64 bytes: a pair of columns for a tile's 16 outputs) asked for ahead of the one multiplied, in
// each tile column a pass reads: 4 KB. SmolLM2's matmuls at 1 / 4 / 32 rows on the Zen 4 EPYC, 16 ahead:
// 8.7 / 9.6 / 20.8 ms; 32: 7.2 / 7.6 / 18.8; 64: 7.2 / 7.8 / 19.2; 128: 7.3 / 7.8 / 19.1 (the fastest of 7).
constexpr int64_t kDotTilePrefetch = 64;

// y[ROWS, NB * 16] = x[ROWS, K] . NB consecutive 16-output tile columns of the weight (w: the first one's
// [K/32, 16, 16, 2], tile_elems elements apart). Each output's sum runs over the column pairs in order, one
// chain whatever ROWS and NB, so a row's result does not depend on the rows or columns beside it.
template <int64_t ROWS, int64_t NB>
inline void dot_tiles(const at::BFloat16* x, int64_t k_size, const at::BFloat16* w, int64_t tile_elems,
                      at::BFloat16* y, int64_t n_size) {
  __m512 sums[ROWS][NB];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t b = 0; b < NB; ++b) sums[r][b] = _mm512_setzero_ps();
  const int64_t pairs = k_size / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512bh wv[NB];
    for (int64_t b = 0; b < NB; ++b) {
      const at::BFloat16* row = w + b * tile_elems + kp * 32;
      _mm_prefetch(reinterpret_cast<const char*>(row + kDotTilePrefetch * 32), _MM_HINT_T0);
      wv[b] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(row));
    }
    for (int64_t r = 0; r < ROWS; ++r) {
      const __m512bh xv = (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(x + r * k_size + 2 * kp));
      for (int64_t b = 0; b < NB; ++b) sums[r][b] = _mm512_dpbf16_ps(sums[r][b], xv, wv[b]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t b = 0; b < NB; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n_size + b * 16), (__m256i)_mm512_cvtneps_pbh(sums[r][b]));
}

// half_linear's body for bf16 x and a tile-packed bf16 weight without AMX: groups of kDotTileGroup tile columns
// split over the threads; in each, blocks of kDotTileRows rows, the group's weights (48 x K bf16) reused from
// cache after the first.
void half_linear_dot_tiles(const at::Tensor& x, const at::Tensor& tiles, at::Tensor& out) {
  const int64_t rows = x.size(0), k_size = x.size(1), n_tiles = tiles.size(0);
  const int64_t n_size = n_tiles * 16, tile_elems = 16 * k_size;
  const at::Tensor xc = x.contiguous();
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = tiles.data_ptr<at::BFloat16>();
  at::BFloat16* yp = out.data_ptr<at::BFloat16>();
  const int64_t groups = (n_tiles + kDotTileGroup - 1) / kDotTileGroup;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t t0 = g * kDotTileGroup, nb = std::min(kDotTileGroup, n_tiles - t0);
      for (int64_t r = 0; r < rows; r += kDotTileRows) {
        const int64_t block = std::min(kDotTileRows, rows - r);
        const at::BFloat16* xr = xp + r * k_size;
        const at::BFloat16* w = wp + t0 * tile_elems;
        at::BFloat16* y = yp + r * n_size + t0 * 16;
        with_rows<kDotTileRows>(block, "half_linear_dot_tiles", [&]<int64_t R>() {
          if (nb == 3) {
            dot_tiles<R, 3>(xr, k_size, w, tile_elems, y, n_size);
          } else if (nb == 2) {
            dot_tiles<R, 2>(xr, k_size, w, tile_elems, y, n_size);
          } else {
            dot_tiles<R, 1>(xr, k_size, w, tile_elems, y, n_size);
          }
        });
      }
    }
  });
}
#endif

#if defined(MESHSERVE_AMX)
// bf16 weights packed for AMX tiles (layers/quantization.py's tile_half_weight): [N/16, K/32, 16, 16, 2], tile
// (nb, kb) holding output rows nb*16.. and input columns kb*32.. as 16 rows of 16 column pairs, which is
// TDPBF16PS's B operand as it lies in memory. x's rows are its A operand as they lie too. oneDNN's AMX GEMM
// reads a decode step's weights well below the memory's rate at these row counts: a SmolLM2 step's matmuls on
// the AMX Xeon took 14.5-17.8 ms at 1-32 rows there against 9.5-12.0 ms here (the memory's rate is ~26 GB/s,
// 10.3 ms for its 269 MB; docs/benchmarks.md).
constexpr int64_t kTileN = 16, kTileK = 32, kTileElems = kTileN * kTileK;
// Rows of x per pass over a pair of weight tiles: two A tiles of 16 rows, four C tiles (2 x 2).
constexpr int64_t kTileChunkRows = 32;
// Weight tiles prefetched ahead of the pair a pass reads (8 KB ahead; 0 and 4 were 2-6% slower at one row).
constexpr int64_t kTilePrefetch = 8;

// Tiles 0-3: C (x rows 0-15 and 16-31 of a chunk against the pair's first and second weight tile); 4, 5: A (those
// x rows); 6, 7: B (the two weight tiles). The A and C tiles have as many rows as the chunk.
inline void configure_linear_tiles(int64_t rows) {
  TileConfig config;
  const uint8_t low = static_cast<uint8_t>(std::min<int64_t>(rows, 16));
  const uint8_t high = static_cast<uint8_t>(std::max<int64_t>(rows - 16, 1));
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64;
  config.rows[0] = config.rows[1] = config.rows[4] = low;
  config.rows[2] = config.rows[3] = config.rows[5] = high;
  config.rows[6] = config.rows[7] = kTileN;
  _tile_loadconfig(&config);
}

// c[32][32] = x[rows, K] . the weight tiles b0 (and b1, unless null) over k_tiles tiles of K, rows <= 32.
inline void tile_chunk(const at::BFloat16* x, int64_t rows, int64_t k_size, const at::BFloat16* b0,
                       const at::BFloat16* b1, int64_t k_tiles, float* c) {
  const bool high = rows > 16, two = b1 != nullptr;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t stride = k_size * static_cast<int64_t>(sizeof(at::BFloat16));
  for (int64_t kb = 0; kb < k_tiles; ++kb) {
    prefetch(reinterpret_cast<const char*>(b0 + (kb + kTilePrefetch) * kTileElems), kTileElems * 2);
    _tile_loadd(6, b0 + kb * kTileElems, 64);
    _tile_loadd(4, x + kb * kTileK, stride);
    _tile_dpbf16ps(0, 4, 6);
    if (two) {
      prefetch(reinterpret_cast<const char*>(b1 + (kb + kTilePrefetch) * kTileElems), kTileElems * 2);
      _tile_loadd(7, b1 + kb * kTileElems, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (high) {
      _tile_loadd(5, x + 16 * k_size + kb * kTileK, stride);
      _tile_dpbf16ps(2, 5, 6);
      if (two) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t kRowBytes = 2 * kTileN * sizeof(float);
  _tile_stored(0, c, kRowBytes);
  if (two) _tile_stored(1, c + kTileN, kRowBytes);
  if (high) {
    _tile_stored(2, c + 16 * 2 * kTileN, kRowBytes);
    if (two) _tile_stored(3, c + 16 * 2 * kTileN + kTileN, kRowBytes);
  }
}

// half_linear's body for bf16 x and a tile-packed bf16 weight. A step of more than 32 rows goes in chunks of 32,
// x padded with zero rows to whole chunks (one tile configuration for every chunk); each row's sums run in the
// same order in any chunk, so a row's result does not depend on the rows beside it.
void half_linear_tiles(const at::Tensor& x, const at::Tensor& tiles, at::Tensor& out) {
  const int64_t rows = x.size(0), k_size = x.size(1), n_tiles = tiles.size(0), k_tiles = tiles.size(1);
  const int64_t n_size = n_tiles * kTileN;
  const int64_t chunks = (rows + kTileChunkRows - 1) / kTileChunkRows;
  at::Tensor xc = x.contiguous();
  if (chunks > 1 && rows % kTileChunkRows != 0) {
    at::Tensor padded = at::zeros({chunks * kTileChunkRows, k_size}, x.options());
    padded.narrow(0, 0, rows).copy_(xc);
    xc = padded;
  }
  const int64_t tile_rows = chunks > 1 ? kTileChunkRows : rows;
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = tiles.data_ptr<at::BFloat16>();
  at::BFloat16* yp = out.data_ptr<at::BFloat16>();
  const int64_t pairs = (n_tiles + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    configure_linear_tiles(tile_rows);
    alignas(64) float c[kTileChunkRows * 2 * kTileN];
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t n0 = 2 * pair;
      const at::BFloat16* b0 = wp + n0 * k_tiles * kTileElems;
      const at::BFloat16* b1 = n0 + 1 < n_tiles ? b0 + k_tiles * kTileElems : nullptr;
      const int64_t width = b1 != nullptr ? 2 * kTileN : kTileN;
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        tile_chunk(xp + chunk * kTileChunkRows * k_size, tile_rows, k_size, b0, b1, k_tiles, c);
        const int64_t live = std::min(kTileChunkRows, rows - chunk * kTileChunkRows);
        for (int64_t r = 0; r < live; ++r) {
          at::BFloat16* y = yp + (chunk * kTileChunkRows + r) * n_size + n0 * kTileN;
          const float* cr = c + r * 2 * kTileN;
          const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(cr + kTileN), _mm512_loadu_ps(cr));
          if (width == 2 * kTileN) {
            _mm512_storeu_si512(y, (__m512i)both);
          } else {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_castsi512_si256((__m512i)both));
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

// Whether half_linear multiplies tile-packed bf16 weights on AMX tiles here: built for AMX and granted the tile
// state.
bool half_linear_on_amx() {
#if defined(MESHSERVE_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

// Whether half_linear takes tile-packed bf16 weights here at all (on AMX tiles or through vdpbf16ps). The
// platform packs a bf16 model's half weights into tiles only where it does (platforms/cpu_native_ops.py).
bool half_linear_takes_tiles() {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  return true;
#else
  return half_linear_on_amx();
#endif
}

// y[M, N] = x[M, K] W^T with W bf16 or fp16 [N, K]: float32 products and accumulation, each output rounded
// once to x's dtype (what a GEMM on the weight widened to float32 computes, up to the order of the sums).
at::Tensor half_linear(const at::Tensor& x, const at::Tensor& weight) {
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK(x.dim() == 2, "half_linear: x must be 2-D [rows, in_features]");
  TORCH_CHECK((weight.dim() == 2 || weight.dim() == 5) &&
                  (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf),
              "half_linear: weight must be bfloat16 or float16 [out, in] (or bfloat16 tiles [out/16, in/32, 16, 16, 2])");
  if (weight.dim() == 5) {
    // Tile-packed [N/16, K/32, 16, 16, 2] (half_linear_takes_tiles): on AMX tiles where the process has them,
    // else through vdpbf16ps.
    TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16 && weight.size(2) == 16 &&
                    weight.size(3) == 16 && weight.size(4) == 2 && weight.is_contiguous(),
                "half_linear: a tile-packed weight must be contiguous bfloat16 [out/16, in/32, 16, 16, 2] with bfloat16 x");
    TORCH_CHECK(weight.size(1) * 32 == x.size(1), "half_linear: x has ", x.size(1), " features, the tiles ",
                weight.size(1) * 32);
    at::Tensor out = at::empty({x.size(0), weight.size(0) * 16}, x.options());
    if (x.size(0) == 0) return out;
#if defined(MESHSERVE_AMX)
    if (amx_permitted()) {
      half_linear_tiles(x, weight, out);
      return out;
    }
#endif
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    half_linear_dot_tiles(x, weight, out);
    return out;
#else
    TORCH_CHECK(false, "half_linear: this kernel library was built without AVX512-BF16; a tile-packed weight needs "
                "it (the platform packs none where half_linear_takes_tiles() is false)");
#endif
  }
  TORCH_CHECK(weight.size(1) == x.size(1), "half_linear: x has ", x.size(1), " features, weight ", weight.size(1));
  const int64_t rows = x.size(0), k_size = x.size(1), n_size = weight.size(0);
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({rows, n_size}, x.options());
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16) {
    half_linear_bf16(x, w, out);
    return out;
  }
#endif
  const at::Tensor xc = x.contiguous();
  const FloatRows xf = float_rows(xc);
  const int64_t row_bytes = k_size * 2;
  auto run = [&]<typename w_t>(const w_t* wp) {
    dispatch_dtype(x.scalar_type(), "half_linear", [&]<typename scalar_t>() {
      const float* xp = xf.data;
      scalar_t* yp = out.data_ptr<scalar_t>();
      at::parallel_for(0, n_size, 16, [&](int64_t begin, int64_t end) {
        float acc[kHalfRows];
        for (int64_t n = begin; n < end; ++n) {
          prefetch_ahead(n, end, {{wp, row_bytes}});
          for (int64_t r = 0; r < rows; r += kHalfRows) {
            const int64_t block = std::min(kHalfRows, rows - r);
            half_dot_block(block, xp + r * k_size, k_size, wp + n * k_size, acc);
            for (int64_t i = 0; i < block; ++i) yp[(r + i) * n_size + n] = static_cast<scalar_t>(acc[i]);
          }
        }
      });
    });
  };
  if (w.scalar_type() == at::kBFloat16)
    run(w.data_ptr<at::BFloat16>());
  else
    run(w.data_ptr<at::Half>());
  return out;
}

// ------------------------------------------------------------------------------ 4-bit weight-only linear

// GGUF's 4-bit block: 32 columns in 16 bytes, byte j holding column j in its low nibble and column j + 16
// in its high one, with one scale and one offset (w = scale * q + offset, q in 0..15; Q4_0's offset is
// -8 * scale).
constexpr int64_t kInt4Block = 32;
constexpr int64_t kInt4BlockBytes = kInt4Block / 2;

// fVec::size() bytes of a block widened to two float vectors of codes: the low nibbles (columns
// c .. c + size) and the high ones (columns 16 + c ..). A scalar widening on the portable build.
inline void widen_nibbles(const uint8_t* bytes, fVec& low, fVec& high) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  low = fVec(_mm512_cvtepi32_ps(_mm512_and_si512(wide, _mm512_set1_epi32(0x0F))));
  high = fVec(_mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 4)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  low = fVec(_mm256_cvtepi32_ps(_mm256_and_si256(wide, _mm256_set1_epi32(0x0F))));
  high = fVec(_mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4)));
#else
  float lo[fVec::size()], hi[fVec::size()];
  for (int64_t i = 0; i < fVec::size(); ++i) {
    lo[i] = static_cast<float>(bytes[i] & 0x0F);
    hi[i] = static_cast<float>(bytes[i] >> 4);
  }
  low = fVec::loadu(lo);
  high = fVec::loadu(hi);
#endif
}

// acc[r] = sum_k x[r][k] * w[k] for ROWS rows of x (row stride k_size) and one weight row of 4-bit blocks.
// Each block's weights are dequantised once in registers, scale * q + offset in one FMA (the exact
// dequantised value: scale * q is exact in float32, so a single rounding of the sum is the reference's
// rounding), then multiplied into every row. An FMA waits on the previous one into the same sum, so with
// few rows kUnroll blocks go at once into sums of their own: 8 chains in flight for one row, 4 for more.
template <int64_t ROWS>
inline void int4_dot_rows(const float* x, int64_t k_size, const uint8_t* w, const float* scales,
                          const float* offsets, float* acc) {
  constexpr int64_t kChunks = kInt4BlockBytes / fVec::size();  // 1 on AVX512, 2 on AVX2
  static_assert(kChunks >= 1 && kInt4BlockBytes % fVec::size() == 0);
  constexpr int64_t kUnroll = ROWS == 1 ? 4 : (ROWS == 2 ? 2 : 1);
  fVec sums[ROWS][2 * kUnroll];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t u = 0; u < 2 * kUnroll; ++u) sums[r][u] = fVec(0.f);
  // One block into the sums of slot u.
  auto block = [&](int64_t b, int64_t u) {
    const fVec scale(scales[b]), offset(offsets[b]);
    const uint8_t* bytes = w + b * kInt4BlockBytes;
    const float* xb = x + b * kInt4Block;
    for (int64_t c = 0; c < kChunks; ++c) {
      fVec low, high;
      widen_nibbles(bytes + c * fVec::size(), low, high);
      low = at::vec::fmadd(low, scale, offset);
      high = at::vec::fmadd(high, scale, offset);
      const int64_t lo_col = c * fVec::size(), hi_col = kInt4BlockBytes + c * fVec::size();
      for (int64_t r = 0; r < ROWS; ++r) {
        sums[r][2 * u] = at::vec::fmadd(fVec::loadu(xb + r * k_size + lo_col), low, sums[r][2 * u]);
        sums[r][2 * u + 1] = at::vec::fmadd(fVec::loadu(xb + r * k_size + hi_col), high, sums[r][2 * u + 1]);
      }
    }
  };
  const int64_t blocks = k_size / kInt4Block;
  unrolled<kUnroll>(blocks, block);
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = lane_total(sums[r]);
}

// int4_dot_rows for a block of 1..kInt8Rows rows (out of line from the parallel loop, as dot_block).
inline void int4_dot_block(int64_t rows, const float* x, int64_t k_size, const uint8_t* w, const float* scales,
                           const float* offsets, float* acc) {
  with_rows<kInt8Rows>(rows, "int4_dot_block", [&]<int64_t R>() {
    int4_dot_rows<R>(x, k_size, w, scales, offsets, acc);
  });
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// bf16 activations on an AVX512-BF16 CPU. A code q (0..15) ORed into the bf16 bits of 128.0 is the bf16
// number 128 + q exactly, so a block's codes become bf16 in two integer ops, and vdpbf16ps multiplies 32
// of them by x's bf16 pairs at once, exactly, into float32 sums: half the instructions of widening to
// float (which left the float path compute-bound, not bandwidth-bound). The 128s come back out per block:
//   sum_j x_j (scale q_j + offset) = scale sum_j x_j (128 + q_j) + (offset - 128 scale) sum_j x_j.
// Two blocks' 32 bytes widen to 32 words: the low nibbles are [block A columns 0..15, block B 0..15], the
// high ones [A 16..31, B 16..31], so x is laid out once per call in that order (arrange_bf16), and float
// lanes 0..7 of a product belong to block A, 8..15 to block B.
constexpr int64_t kInt4Pair = 2 * kInt4Block;

// x [rows, k] (bf16) -> out [rows, pairs * 64] in the order above, and the float32 sum of each block's x.
inline void arrange_bf16(const at::BFloat16* x, int64_t rows, int64_t k_size, at::BFloat16* out, float* sums) {
  const int64_t pairs = k_size / kInt4Pair, blocks = k_size / kInt4Block;
  for (int64_t r = 0; r < rows; ++r) {
    const at::BFloat16* xr = x + r * k_size;
    at::BFloat16* o = out + r * pairs * kInt4Pair;
    for (int64_t p = 0; p < pairs; ++p) {
      const at::BFloat16* c = xr + p * kInt4Pair;
      for (int64_t half = 0; half < 2; ++half)  // low nibbles' partners, then high nibbles'
        for (int64_t block = 0; block < 2; ++block)
          std::memcpy(o + p * kInt4Pair + half * kInt4Block + block * 16, c + block * kInt4Block + half * 16,
                      16 * sizeof(at::BFloat16));
    }
    for (int64_t b = 0; b < blocks; ++b) {
      float total = 0.f;
      for (int64_t j = 0; j < kInt4Block; ++j) total += static_cast<float>(xr[b * kInt4Block + j]);
      sums[r * blocks + b] = total;
    }
  }
}

inline __m512i load_words(const at::BFloat16* p) { return _mm512_loadu_si512(reinterpret_cast<const void*>(p)); }

// acc[r] for ROWS rows: x_arranged rows of stride `pairs * 64`, x_raw the original rows (for an odd last
// block, done in float), block_sums [rows, blocks].
template <int64_t ROWS>
inline void int4_dot_rows_bf16(const at::BFloat16* x_arranged, const at::BFloat16* x_raw, const float* block_sums,
                               int64_t k_size, const uint8_t* w, const float* scales, const float* offsets,
                               float* acc) {
  const int64_t blocks = k_size / kInt4Block, pairs = blocks / 2, stride = pairs * kInt4Pair;
  // Independent totals per row for few rows (the FMA into a row's total waits on the previous one).
  constexpr int64_t kSplit = ROWS == 1 ? 4 : (ROWS == 2 ? 2 : 1);
  __m512 totals[ROWS][kSplit];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t u = 0; u < kSplit; ++u) totals[r][u] = _mm512_setzero_ps();
  const __m512i low_nibble = _mm512_set1_epi16(0x000F), bf16_128 = _mm512_set1_epi16(0x4300);
  // Pair p into the totals of slot u (u a constant once unrolled: a vector array indexed at run time
  // lives on the stack, which put a store and a load on every FMA's chain).
  auto pair = [&](int64_t p, int64_t u) {
    const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32)));
    const __m512i low = _mm512_ternarylogic_epi32(words, low_nibble, bf16_128, 0xEA);  // (words & 0xF) | 128.0
    const __m512i high = _mm512_or_si512(_mm512_srli_epi16(words, 4), bf16_128);
    const __m512 scale = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(scales[2 * p]), _mm512_set1_ps(scales[2 * p + 1]));
    for (int64_t r = 0; r < ROWS; ++r) {
      const at::BFloat16* xp = x_arranged + r * stride + p * kInt4Pair;
      __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)low, (__m512bh)load_words(xp));
      s = _mm512_dpbf16_ps(s, (__m512bh)high, (__m512bh)load_words(xp + kInt4Block));
      totals[r][u] = _mm512_fmadd_ps(s, scale, totals[r][u]);
    }
  };
  unrolled<kSplit>(pairs, pair);
  for (int64_t r = 0; r < ROWS; ++r) {
    // The offsets, less the 128s the codes carried: 16 blocks a vector.
    const float* sums = block_sums + r * blocks;
    __m512 fix = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b < 2 * pairs; b += 16) {
      const __mmask16 live = 2 * pairs - b >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (2 * pairs - b)) - 1);
      const __m512 d = _mm512_maskz_loadu_ps(live, scales + b), m = _mm512_maskz_loadu_ps(live, offsets + b);
      fix = _mm512_fmadd_ps(_mm512_fmadd_ps(d, _mm512_set1_ps(-128.f), m), _mm512_maskz_loadu_ps(live, sums + b), fix);
    }
    for (int64_t u = 0; u < kSplit; ++u) fix = _mm512_add_ps(fix, totals[r][u]);
    float total = _mm512_reduce_add_ps(fix);
    if (blocks % 2) {  // an odd last block, in float
      const int64_t last = blocks - 1;
      const uint8_t* bytes = w + last * kInt4BlockBytes;
      const at::BFloat16* xb = x_raw + r * k_size + last * kInt4Block;
      float tail = 0.f;
      for (int64_t j = 0; j < kInt4BlockBytes; ++j) {
        tail += static_cast<float>(xb[j]) * (scales[last] * (bytes[j] & 0x0F) + offsets[last]);
        tail += static_cast<float>(xb[j + 16]) * (scales[last] * (bytes[j] >> 4) + offsets[last]);
      }
      total += tail;
    }
    acc[r] = total;
  }
}

// Rows per pass of the bf16 path: a row costs three instructions a pair of blocks beside the five that
// dequantise it, so up to 8 rows share one pass over the weights (a step's matmuls of 8 rows: 25.5 ms in
// one pass, 31 ms in two of 4).
constexpr int64_t kInt4Bf16Rows = 8;

inline void int4_dot_block_bf16(int64_t rows, const at::BFloat16* x_arranged, const at::BFloat16* x_raw,
                                const float* block_sums, int64_t k_size, const uint8_t* w, const float* scales,
                                const float* offsets, float* acc) {
  with_rows<kInt4Bf16Rows>(rows, "int4_dot_block_bf16", [&]<int64_t R>() {
    int4_dot_rows_bf16<R>(x_arranged, x_raw, block_sums, k_size, w, scales, offsets, acc);
  });
}

// int4_linear's body for bf16 x on this CPU.
void int4_linear_bf16(const at::Tensor& x, const uint8_t* qp, const float* sp, const float* op_, int64_t n_size,
                      at::Tensor& out) {
  const int64_t rows = x.size(0), k_size = x.size(1), blocks = k_size / kInt4Block;
  const int64_t stride = blocks / 2 * kInt4Pair;
  const at::Tensor xc = x.contiguous();
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  std::vector<at::BFloat16> arranged(static_cast<size_t>(std::max<int64_t>(rows * stride, 1)));
  std::vector<float> block_sums(static_cast<size_t>(rows * blocks));
  arrange_bf16(xp, rows, k_size, arranged.data(), block_sums.data());
  at::BFloat16* yp = out.data_ptr<at::BFloat16>();
  const int64_t row_bytes = k_size / 2;
  at::parallel_for(0, n_size, 16, [&](int64_t begin, int64_t end) {
    float acc[kInt4Bf16Rows];
    for (int64_t n = begin; n < end; ++n) {
      prefetch_ahead(n, end, {{qp, row_bytes}, {sp, blocks * 4}, {op_, blocks * 4}});
      for (int64_t r = 0; r < rows; r += kInt4Bf16Rows) {
        const int64_t block = std::min(kInt4Bf16Rows, rows - r);
        int4_dot_block_bf16(block, arranged.data() + r * stride, xp + r * k_size, block_sums.data() + r * blocks,
                            k_size, qp + n * (k_size / 2), sp + n * blocks, op_ + n * blocks, acc);
        for (int64_t i = 0; i < block; ++i) yp[(r + i) * n_size + n] = static_cast<at::BFloat16>(acc[i]);
      }
    }
  });
}
#endif

// y[M, N] = x[M, K] W^T with W[n, k] = scales[n, k / 32] * q[n, k] + offsets[n, k / 32], q the 4-bit codes
// of packed [N, K / 2] in GGUF's block order: float32 accumulation, each output rounded once to x's dtype.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& offsets) {
  check_cpu(x, "x");
  check_cpu(packed, "packed");
  check_cpu(scales, "scales");
  check_cpu(offsets, "offsets");
  TORCH_CHECK(x.dim() == 2, "int4_linear: x must be 2-D [rows, in_features]");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte, "int4_linear: packed must be uint8 [out, in / 2]");
  const int64_t rows = x.size(0), k_size = x.size(1), n_size = packed.size(0);
  TORCH_CHECK(k_size % kInt4Block == 0, "int4_linear: in_features ", k_size, " is not a multiple of ", kInt4Block);
  TORCH_CHECK(packed.size(1) * 2 == k_size, "int4_linear: x has ", k_size, " features, packed ", packed.size(1) * 2);
  for (const at::Tensor* t : {&scales, &offsets})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == n_size && t->size(1) == k_size / kInt4Block &&
                    t->scalar_type() == at::kFloat,
                "int4_linear: scales and offsets must be float32 [out, in / ", kInt4Block, "]");
  const at::Tensor q = packed.contiguous(), sc = scales.contiguous(), of = offsets.contiguous();
  at::Tensor out = at::empty({rows, n_size}, x.options());
  const int64_t blocks = k_size / kInt4Block;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    int4_linear_bf16(x, q.data_ptr<uint8_t>(), sc.data_ptr<float>(), of.data_ptr<float>(), n_size, out);
    return out;
  }
#endif
  const at::Tensor xc = x.contiguous();
  const FloatRows xf = float_rows(xc);
  dispatch_dtype(x.scalar_type(), "int4_linear", [&]<typename scalar_t>() {
    const float* xp = xf.data;
    const uint8_t* qp = q.data_ptr<uint8_t>();
    const float* sp = sc.data_ptr<float>();
    const float* op_ = of.data_ptr<float>();
    scalar_t* yp = out.data_ptr<scalar_t>();
    at::parallel_for(0, n_size, 16, [&](int64_t begin, int64_t end) {
      float acc[kInt8Rows];
      for (int64_t n = begin; n < end; ++n) {
        prefetch_ahead(n, end, {{qp, k_size / 2}, {sp, blocks * 4}, {op_, blocks * 4}});
        const uint8_t* wr = qp + n * (k_size / 2);
        for (int64_t r = 0; r < rows; r += kInt8Rows) {
          const int64_t block = std::min(kInt8Rows, rows - r);
          int4_dot_block(block, xp + r * k_size, k_size, wr, sp + n * blocks, op_ + n * blocks, acc);
          for (int64_t i = 0; i < block; ++i) yp[(r + i) * n_size + n] = static_cast<scalar_t>(acc[i]);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(meshserve_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor offsets) -> Tensor");
  m.def("half_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("half_linear_on_amx() -> bool", &half_linear_on_amx);
  m.def("half_linear_takes_tiles() -> bool", &half_linear_takes_tiles);
  m.def("int8_linear_takes_tiles() -> bool", &int8_linear_takes_tiles);
}

TORCH_LIBRARY_IMPL(meshserve_cpu, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("half_linear", &half_linear);
}

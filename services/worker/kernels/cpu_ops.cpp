// Native CPU kernels for the worker: paged decode and prefill attention that read KV blocks in place, the KV cache
// write, fused RMSNorm, SwiGLU and rotary ops (the quantised linears are quantized_linear.cpp's). Registered as
// torch.ops.meshserve_cpu.*; built and loaded by kernels/loader.py.
//
// The elementwise ops reproduce the pure-torch reference ops' rounding exactly (each torch op rounds its
// result to the tensor dtype), so swapping them in changes speed, not numbers. Attention keeps scores,
// softmax and the weighted sum in float32 (the reference rounds scores and probabilities to the dtype),
// which is at least as accurate; bf16 prefill attention on an AVX512-BF16 CPU multiplies bf16 pairs into
// float32 sums and rounds only the probabilities to bf16 for the weighted sum, as the reference does.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "cpu_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using namespace meshserve_kernels;

// ----------------------------------------------------------------------------------- decode attention

// One K or V row of NV float vectors, widened in registers from the cache's dtype.
template <typename scalar_t, int NV>
inline void load_row(const scalar_t* src, fVec (&row)[NV]) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    for (int c = 0; c < NV; ++c) row[c] = fVec::loadu(src + c * fVec::size());
  } else {
    using rVec = at::vec::Vectorized<scalar_t>;
    static_assert(rVec::size() == 2 * fVec::size());
    for (int c = 0; c < NV / 2; ++c) {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(rVec::loadu(src + c * rVec::size()));
      row[2 * c] = lo;
      row[2 * c + 1] = hi;
    }
  }
}

struct SequenceView {
  const int64_t* blocks;  // the sequence's block ids
  int64_t seq_len;
  int64_t block_size;
  int64_t block_stride;  // elements between blocks of one head
  int64_t row_stride;    // elements between a block's rows (tokens)
};

// Calls fn(first token, rows, offset of its first row) for each of the sequence's cached blocks, prefetching the
// next block's rows (row_elems each) in every one of `prefetch`: blocks sit anywhere in a cache far larger than
// the CPU's caches, and without the hint every block starts with a full memory latency.
template <typename scalar_t, typename Fn>
inline void for_each_block(const SequenceView& seq, int64_t head_offset,
                           std::initializer_list<const scalar_t*> prefetch, int64_t row_elems, Fn&& fn) {
  constexpr int64_t kLine = 64;
  const int64_t row_bytes = row_elems * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t first = 0, blk = 0; first < seq.seq_len; first += seq.block_size, ++blk) {
    const int64_t base = seq.blocks[blk] * seq.block_stride + head_offset;
    const int64_t rows = std::min(seq.block_size, seq.seq_len - first);
    const int64_t next_first = first + seq.block_size;
    if (next_first < seq.seq_len) {
      const int64_t next = seq.blocks[blk + 1] * seq.block_stride + head_offset;
      const int64_t next_rows = std::min(seq.block_size, seq.seq_len - next_first);
      for (const scalar_t* data : prefetch) {
        for (int64_t j = 0; j < next_rows; ++j) {
          const char* row = reinterpret_cast<const char*>(data + next + j * seq.row_stride);
          for (int64_t byte = 0; byte < row_bytes; byte += kLine) __builtin_prefetch(row + byte);
        }
      }
    }
    fn(first, rows, base);
  }
}

// Calls fn(token, row offset) for each of the sequence's cached rows, block by block (for_each_block).
template <typename scalar_t, typename Fn>
inline void for_each_row(const SequenceView& seq, int64_t head_offset, std::initializer_list<const scalar_t*> prefetch,
                         int64_t row_elems, Fn&& fn) {
  for_each_block(seq, head_offset, prefetch, row_elems, [&](int64_t first, int64_t rows, int64_t base) {
    for (int64_t j = 0; j < rows; ++j) fn(first + j, base + j * seq.row_stride);
  });
}

// Passes 2 and 3 of a decode's attention for the G query heads of one KV head: each head's scores (scores[g * len
// + t], max_score[g] their maximum) turned into exact softmax weights, and the weighted sum of V's rows, read
// once, in place, widened in registers; the accumulators stay in registers (NV = head_dim / fVec::size()).
template <typename scalar_t, int NV, int G>
void weigh_values(const scalar_t* v, const SequenceView& seq, int64_t head_offset, float* scores,
                  const float* max_score, float* out) {
  const int64_t len = seq.seq_len;
  float sum[G];
  for (int g = 0; g < G; ++g) {
    const fVec m(max_score[g]);
    at::vec::map([&](fVec x) { return (x - m).exp(); }, scores + g * len, scores + g * len, len);
    sum[g] = at::vec::reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, scores + g * len, len);
  }
  fVec acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = fVec(0.f);
  for_each_row(seq, head_offset, {v}, NV * fVec::size(), [&](int64_t t, int64_t offset) {
    fVec row[NV];
    load_row<scalar_t, NV>(v + offset, row);
    for (int g = 0; g < G; ++g) {
      const fVec p(scores[g * len + t]);
      for (int c = 0; c < NV; ++c) acc[g][c] = at::vec::fmadd(p, row[c], acc[g][c]);
    }
  });
  for (int g = 0; g < G; ++g) {
    const fVec inv(sum[g] > 0.f ? 1.f / sum[g] : 0.f);
    for (int c = 0; c < NV; ++c) (acc[g][c] * inv).store(out + (g * NV + c) * fVec::size());
  }
}

// The G query heads of one KV head against one sequence: exact softmax in three passes (scores, exp,
// weighted V sum). Each K and V row is read once, in place, and widened in registers; the G heads' query
// rows (pre-scaled, float32) stay in registers.
template <typename scalar_t, int NV, int G>
void attend_group(const float* q, const scalar_t* k, const scalar_t* v, const SequenceView& seq, int64_t head_offset,
                  float* scores, float* out) {
  const int64_t len = seq.seq_len;
  fVec qv[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) qv[g][c] = fVec::loadu(q + (g * NV + c) * fVec::size());
  float max_score[G];
  std::fill(max_score, max_score + G, -std::numeric_limits<float>::infinity());
  // The scores pass prefetches V as well, so the weighted-sum pass finds it in L2.
  for_each_row(seq, head_offset, {k, v}, NV * fVec::size(), [&](int64_t t, int64_t offset) {
    fVec row[NV];
    load_row<scalar_t, NV>(k + offset, row);
    for (int g = 0; g < G; ++g) {
      fVec prod = qv[g][0] * row[0];
      for (int c = 1; c < NV; ++c) prod = at::vec::fmadd(qv[g][c], row[c], prod);
      const float score = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, prod);
      scores[g * len + t] = score;
      max_score[g] = std::max(max_score[g], score);
    }
  });
  weigh_values<scalar_t, NV, G>(v, seq, head_offset, scores, max_score, out);
}

#if defined(MESHSERVE_AMX)
// bf16 decode scores on AMX tiles: a block's 16 K rows, as they lie in the cache, are the A operand of S = K . Q^T
// (16 keys x 16 lanes, the G heads in the first G lanes); Q^T, packed once per task into bf16 pairs along D, is
// the B operand. One tile product per 32 elements of D replaces the vector pass's G dot products and horizontal
// sums a row (the scores pass was most of the kernel's arithmetic, and with a batch's KV coming from memory the
// kernel did not keep up with it). Scores are scaled after the products; rows past the sequence's end in its
// last block are computed and never read. Tiles: 0 the scores, 1 a chunk of K, 2 a chunk of Q^T.
constexpr int64_t kKeyTile = 16;

template <int NV, int G>
void attend_group_amx(const uint32_t* q_t, float scale, const at::BFloat16* k, const at::BFloat16* v,
                      const SequenceView& seq, int64_t head_offset, float* scores, float* out) {
  constexpr int64_t D = NV * fVec::size(), kChunks = D / 32;
  const int64_t len = seq.seq_len;
  const int64_t stride = seq.row_stride * static_cast<int64_t>(sizeof(at::BFloat16));
  alignas(64) float tile[kKeyTile * kKeyTile];
  const __m512i columns = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(kKeyTile));
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 running[G];
  for (int g = 0; g < G; ++g) running[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for_each_block(seq, head_offset, {k, v}, D, [&](int64_t first, int64_t rows, int64_t base) {
    for (int64_t sub = 0; sub < rows; sub += kKeyTile) {
      _tile_zero(0);
      for (int64_t c = 0; c < kChunks; ++c) {
        _tile_loadd(1, k + base + sub * seq.row_stride + c * 32, stride);
        _tile_loadd(2, q_t + c * kKeyTile * kKeyTile, kKeyTile * sizeof(uint32_t));
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, tile, kKeyTile * sizeof(float));
      const int64_t t0 = first + sub, live = std::min(kKeyTile, len - t0);
      const __mmask16 mask = live >= kKeyTile ? __mmask16(0xffff) : __mmask16((1u << live) - 1);
      for (int g = 0; g < G; ++g) {
        const __m512 column = _mm512_mul_ps(_mm512_i32gather_ps(columns, tile + g, 4), vscale);
        _mm512_mask_storeu_ps(scores + g * len + t0, mask, column);
        running[g] = _mm512_mask_max_ps(running[g], mask, running[g], column);
      }
    }
  });
  float max_score[G];
  for (int g = 0; g < G; ++g) max_score[g] = _mm512_reduce_max_ps(running[g]);
  weigh_values<at::BFloat16, NV, G>(v, seq, head_offset, scores, max_score, out);
}

using AttendAmxFn = void (*)(const uint32_t*, float, const at::BFloat16*, const at::BFloat16*, const SequenceView&,
                             int64_t, float*, float*);

template <int NV, int G = 1>
AttendAmxFn pick_group_amx(int64_t group) {
  if constexpr (G > 8) {
    return nullptr;
  } else {
    return group == G ? &attend_group_amx<NV, G> : pick_group_amx<NV, G + 1>(group);
  }
}

// Whole 32-element chunks of D and whole 16-key tiles of a block; null: the vector kernel takes the step.
AttendAmxFn pick_attend_amx(int64_t head_dim, int64_t group, int64_t block_size) {
  if (!amx_permitted() || block_size % kKeyTile != 0) return nullptr;
  switch (head_dim) {
    case 64:
      return pick_group_amx<4>(group);
    case 128:
      return pick_group_amx<8>(group);
    case 256:
      return pick_group_amx<16>(group);
    default:
      return nullptr;
  }
}

// Q^T for one task: word w of head g (elements 2w, 2w + 1) at q_t[((w / 16) * 16 + w % 16) * 16 + g]; lanes past
// the group are zero.
inline void pack_query_t(const at::BFloat16* q, int64_t group, int64_t head_dim, uint32_t* q_t) {
  const int64_t words = head_dim / 2;
  std::fill(q_t, q_t + words * kKeyTile, 0u);
  for (int64_t g = 0; g < group; ++g) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(q + g * head_dim);
    for (int64_t w = 0; w < words; ++w) q_t[w * kKeyTile + g] = row[w];
  }
}
#endif

template <typename scalar_t>
using AttendFn = void (*)(const float*, const scalar_t*, const scalar_t*, const SequenceView&, int64_t, float*,
                          float*);

constexpr int kMaxGroup = 8;

template <typename scalar_t, int NV, int G = 1>
AttendFn<scalar_t> pick_group(int64_t group) {
  if constexpr (G > kMaxGroup) {
    return nullptr;
  } else {
    return group == G ? &attend_group<scalar_t, NV, G> : pick_group<scalar_t, NV, G + 1>(group);
  }
}

// Register-resident kernels exist for head_dim = 4, 8 or 16 vectors and up to kMaxGroup query heads per
// KV head: every Llama-family shape; anything else takes the reference path (decode_attention_supported).
template <typename scalar_t>
AttendFn<scalar_t> pick_attend(int64_t head_dim, int64_t group) {
  if (head_dim % (2 * fVec::size()) != 0) return nullptr;
  switch (head_dim / fVec::size()) {
    case 4:
      return pick_group<scalar_t, 4>(group);
    case 8:
      return pick_group<scalar_t, 8>(group);
    case 16:
      return pick_group<scalar_t, 16>(group);
    default:
      return nullptr;
  }
}

bool decode_attention_supported(int64_t head_dim, int64_t group) {
  return pick_attend<float>(head_dim, group) != nullptr;
}

// Tasks (by their work) split over the threads: largest first to the least-loaded thread. The work of one
// batch's tasks differs tenfold (sequence lengths, causal tiles), where parallel_for's even split of the
// range could leave one thread with most of it.
std::vector<std::vector<int64_t>> assign_tasks(const std::vector<int64_t>& work) {
  const int64_t num_tasks = static_cast<int64_t>(work.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  std::vector<int64_t> order(num_tasks);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return work[a] > work[b]; });
  std::vector<std::vector<int64_t>> assigned(threads);
  std::vector<int64_t> load(threads, 0);
  for (const int64_t task : order) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    assigned[least].push_back(task);
    load[least] += work[task];
  }
  return assigned;
}

template <typename scalar_t>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                           at::Tensor& out) {
  // q, out: [B, Hq, D] contiguous. Caches are head-major views [num_blocks, Hk, block_size, D] with a
  // contiguous last dim; their strides say where a (block, head, offset) row lives in either layout.
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const AttendFn<scalar_t> attend = pick_attend<scalar_t>(head_dim, group);
  TORCH_CHECK(attend != nullptr, "no native decode attention for head_dim ", head_dim, " with ", group,
              " query heads per KV head; run with --cpu-kernels reference");
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const fVec vscale(static_cast<float>(scale));
  const int64_t longest = batch > 0 ? *std::max_element(lens, lens + batch) : 0;

  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 0 && (lens[b] + block_size - 1) / block_size <= max_blocks, "seq_lens[", b, "] = ",
                lens[b], " does not fit block_tables' ", max_blocks, " blocks");
  }
  // A task is a sequence's KV heads (one after another: a block's heads lie side by side, and the hardware
  // prefetcher's neighbouring lines then serve the next head) where the batch has enough sequences to keep
  // every thread busy, else one (sequence, KV head), so a batch of one still uses every thread.
  const int64_t heads_per_task = batch >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks_per_seq = num_kv_heads / heads_per_task;
  std::vector<int64_t> work(batch * tasks_per_seq);
  for (int64_t task = 0; task < static_cast<int64_t>(work.size()); ++task) work[task] = lens[task / tasks_per_seq] + 1;
  const std::vector<std::vector<int64_t>> assigned = assign_tasks(work);
  const int64_t threads = static_cast<int64_t>(assigned.size());
#if defined(MESHSERVE_AMX)
  AttendAmxFn attend_amx = nullptr;
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) attend_amx = pick_attend_amx(head_dim, group, block_size);
#endif
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), of(group * head_dim), scores(group * longest);
#if defined(MESHSERVE_AMX)
    std::vector<uint32_t> q_t(attend_amx != nullptr ? head_dim / 2 * kKeyTile : 0);
    if (attend_amx != nullptr) {
      TileConfig config;
      for (int t = 0; t < 3; ++t) {
        config.rows[t] = kKeyTile;
        config.colsb[t] = 64;
      }
      _tile_loadconfig(&config);
    }
#endif
    for (int64_t thread = begin; thread < end; ++thread) {
      for (const int64_t task : assigned[thread]) {
        for (int64_t h = 0; h < heads_per_task; ++h) {
          const int64_t b = task / tasks_per_seq, kh = (task % tasks_per_seq) * heads_per_task + h;
          const SequenceView seq{tables + b * max_blocks, lens[b], block_size, k_cache.stride(0), k_cache.stride(2)};
          const int64_t first_head = b * num_heads + kh * group;
#if defined(MESHSERVE_AMX)
          if (attend_amx != nullptr) {
            if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
              pack_query_t(q_ptr + first_head * head_dim, group, head_dim, q_t.data());
              attend_amx(q_t.data(), static_cast<float>(scale), k_ptr, v_ptr, seq, kh * k_cache.stride(1),
                         scores.data(), of.data());
              at::vec::convert(of.data(), out_ptr + first_head * head_dim, group * head_dim);
            }
            continue;
          }
#endif
          to_float(q_ptr + first_head * head_dim, qf.data(), group * head_dim);
          at::vec::map([&](fVec x) { return x * vscale; }, qf.data(), qf.data(), group * head_dim);
          attend(qf.data(), k_ptr, v_ptr, seq, kh * k_cache.stride(1), scores.data(), of.data());
          at::vec::convert(of.data(), out_ptr + first_head * head_dim, group * head_dim);
        }
      }
    }
#if defined(MESHSERVE_AMX)
    if (attend_amx != nullptr) _tile_release();
#endif
  });
}

// q [rows, Hq, D] and the head-major cache views both attention kernels read.
void check_paged_attention_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const char* q_shape) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3, "q must be ", q_shape, ", got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(),
              "k_cache and v_cache must be matching [num_blocks, num_kv_heads, block_size, head_dim] views");
  TORCH_CHECK(k_cache.stride(3) == 1, "the caches' head_dim must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "head_dim differs between q and the caches");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  check_paged_attention_args(q, k_cache, v_cache, "[batch, num_heads, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "block_tables [batch, max_blocks] and seq_lens [batch] must match q's batch");
  const at::Tensor qc = q.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  at::Tensor out = at::empty_like(qc);
  dispatch_dtype(q.scalar_type(), "paged_decode_attention", [&]<typename scalar_t>() {
    decode_attention_impl<scalar_t>(qc, k_cache, v_cache, tables, lens, scale, out);
  });
  return out;
}

// ---------------------------------------------------------------------------------- prefill attention

// Prefill chunks: each sequence's query rows (its last q_len cached tokens) against every cached token up
// to their own position, flash-style. A task is one (sequence, KV head, tile of kPrefillTile query
// tokens); its rows are the tile's tokens times the group's query heads, token-major. Keys go kKeyVecs
// float vectors (W keys each) at a time, one step: the step's K and V are laid out once per task for the
// dot products (the Operands below), a row's W scores come from D products of a broadcast query element
// with no horizontal sums, and the softmax runs online per row (running max and sum, float32), one update
// per step.
constexpr int64_t kPrefillTile = 32;
constexpr int kKeyVecs = 4;

// Rows per register block: R rows' scores and NV-vector accumulators stay in registers.
template <int NV>
constexpr int kRowBlock = NV >= 16 ? 1 : 16 / NV;

// The float32 operands: every dtype, every ISA. Queries widened and pre-scaled; each W-key chunk's K widened
// and transposed to [D][W], its V widened to [W][D]; scores and the weighted sum are float FMAs.
template <typename scalar_t, int NV>
class WidenedOperands {
 public:
  static constexpr int64_t W = fVec::size();
  static constexpr int64_t D = NV * W;
  static constexpr int R = kRowBlock<NV>;

  // Room for padded_rows query rows; scores come out multiplied by scale.
  WidenedOperands(int64_t padded_rows, float scale)
      : scale_(scale), q_(padded_rows * D, 0.f), kt_(kKeyVecs * D * W), v_(kKeyVecs * W * D) {}

  // Row r <- q_rows[r] * scale, for `rows` contiguous rows (a token's heads lie side by side).
  void load_queries(int64_t first_row, const scalar_t* q_rows, int64_t rows) {
    float* dst = q_.data() + first_row * D;
    to_float(q_rows, dst, rows * D);
    at::vec::map([&](fVec x) { return x * fVec(scale_); }, dst, dst, rows * D);
  }

  // Chunk c's W keys: rows k + w * row_stride (and v's), the first `valid` of them there, the rest zeros.
  void load_chunk(int c, const scalar_t* k, const scalar_t* v, int64_t row_stride, int64_t valid) {
    float* kt_c = kt_.data() + c * D * W;
    for (int64_t w = 0; w < W; ++w) {
      float* v_row = v_.data() + (c * W + w) * D;
      if (w < valid) {
        to_float(v + w * row_stride, v_row, D);
        const scalar_t* k_row = k + w * row_stride;
        for (int64_t d = 0; d < D; ++d) kt_c[d * W + w] = static_cast<float>(k_row[d]);
      } else {
        std::fill(v_row, v_row + D, 0.f);
        for (int64_t d = 0; d < D; ++d) kt_c[d * W + w] = 0.f;
      }
    }
  }

  // R rows' scores against the step's chunks: s[r][c] = sum over d of q[r][d] * kt[c][d][:]. Every bound is
  // a constant, so the R * kKeyVecs sums stay in registers (local sums, copied out once: through the
  // reference the compiler must assume q or kt alias them and stores every sum on every iteration).
  void scores(int64_t r0, fVec (&s)[R][kKeyVecs]) const {
    const float* q = q_.data() + r0 * D;
    fVec sums[R][kKeyVecs];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kKeyVecs; ++c) sums[r][c] = fVec(0.f);
    for (int64_t d = 0; d < D; ++d) {
      fVec q_d[R];
      for (int r = 0; r < R; ++r) q_d[r] = fVec(q[r * D + d]);
      for (int c = 0; c < kKeyVecs; ++c) {
        const fVec kd = fVec::loadu(kt_.data() + (c * D + d) * W);
        for (int r = 0; r < R; ++r) sums[r][c] = at::vec::fmadd(q_d[r], kd, sums[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kKeyVecs; ++c) s[r][c] = sums[r][c];
  }

  // R rows' accumulators (NV vectors a row, in registers) scaled by their correction, then += p[r][k] * v[k]
  // over the step's `keys` keys.
  void values(const float* p, int64_t p_stride, int64_t keys, const float* correction, float* acc) const {
    fVec a[R][NV];
    for (int r = 0; r < R; ++r) {
      const fVec c(correction[r]);
      for (int j = 0; j < NV; ++j) a[r][j] = fVec::loadu(acc + (r * NV + j) * W) * c;
    }
    for (int64_t k = 0; k < keys; ++k) {
      fVec p_k[R];
      for (int r = 0; r < R; ++r) p_k[r] = fVec(p[r * p_stride + k]);
      for (int j = 0; j < NV; ++j) {
        const fVec vk = fVec::loadu(v_.data() + (k * NV + j) * W);
        for (int r = 0; r < R; ++r) a[r][j] = at::vec::fmadd(p_k[r], vk, a[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NV; ++j) a[r][j].store(acc + (r * NV + j) * W);
  }

 private:
  float scale_;
  std::vector<float> q_, kt_, v_;
};

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define MESHSERVE_BF16_DOT 1
// The bfloat16 operands where the CPU has AVX512-BF16 (the loader builds with -mavx512bf16 there): each
// vdpbf16ps multiplies pairs of bf16 exactly and adds both products to a float lane, twice the work of an
// FMA, so scores and the weighted sum take half the instructions. Operands stay bf16 pairs: a query's
// (d, d+1), a chunk's K as [D/2][W] pairs ([W][D] read as 32-bit words and transposed), V as [key pair][D]
// pairs of two keys' elements. Scores are scaled after the products (a pre-scaled query would round); the
// probabilities are rounded to bf16 for the weighted sum (the reference rounds them to the dtype too),
// their running sum stays float32.
template <int NV>
class Bf16DotOperands {
 public:
  static constexpr int64_t W = 16;
  static constexpr int64_t D = NV * W, D2 = D / 2;
  static constexpr int R = kRowBlock<NV>;
  static_assert(fVec::size() == W);

  Bf16DotOperands(int64_t padded_rows, float scale)
      : scale_(scale), q_(padded_rows * D2, 0), kt_(kKeyVecs * D2 * W), v_(kKeyVecs * W / 2 * D),
        p_(R * kKeyVecs * W / 2) {}

  void load_queries(int64_t first_row, const at::BFloat16* q_rows, int64_t rows) {
    std::memcpy(q_.data() + first_row * D2, q_rows, rows * D * sizeof(at::BFloat16));
  }

  // K: 32-bit words (d pairs) gathered across the W rows, one vector per pair. V: two keys' rows interleaved
  // element by element (vpermt2w), 32 elements at a time.
  void load_chunk(int c, const at::BFloat16* k, const at::BFloat16* v, int64_t row_stride, int64_t valid) {
    const __mmask16 rows = valid >= W ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
    const __m512i row_words = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(row_stride / 2));
    uint32_t* kt_c = kt_.data() + c * D2 * W;
    const int* k_words = reinterpret_cast<const int*>(k);
    for (int64_t d = 0; d < D2; ++d)
      _mm512_storeu_si512(kt_c + d * W, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, row_words,
                                                                     k_words + d, 4));
    // vpermt2w indices, as 16-bit pairs: output word i is (va[i], vb[i]) (vb's elements count from 32), for
    // elements 0-15 of the 32 (low), then 16-31 (high).
    const __m512i low = _mm512_setr_epi32(0x200000, 0x210001, 0x220002, 0x230003, 0x240004, 0x250005, 0x260006,
                                          0x270007, 0x280008, 0x290009, 0x2a000a, 0x2b000b, 0x2c000c, 0x2d000d,
                                          0x2e000e, 0x2f000f);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int64_t pair = 0; pair < W / 2; ++pair) {
      const int64_t first = 2 * pair;
      const at::BFloat16* a = v + first * row_stride;
      const at::BFloat16* b = a + row_stride;
      uint32_t* dst = v_.data() + (c * W / 2 + pair) * D;
      for (int64_t j = 0; j < D; j += 32) {
        const __m512i va = first < valid ? _mm512_loadu_si512(a + j) : _mm512_setzero_si512();
        const __m512i vb = first + 1 < valid ? _mm512_loadu_si512(b + j) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + j, _mm512_permutex2var_epi16(va, low, vb));
        _mm512_storeu_si512(dst + j + 16, _mm512_permutex2var_epi16(va, high, vb));
      }
    }
  }

  void scores(int64_t r0, fVec (&s)[R][kKeyVecs]) const {
    const uint32_t* q = q_.data() + r0 * D2;
    __m512 sums[R][kKeyVecs];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kKeyVecs; ++c) sums[r][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D2; ++d) {
      __m512i q_d[R];
      for (int r = 0; r < R; ++r) q_d[r] = _mm512_set1_epi32(static_cast<int>(q[r * D2 + d]));
      for (int c = 0; c < kKeyVecs; ++c) {
        const __m512i kd = _mm512_loadu_si512(kt_.data() + (c * D2 + d) * W);
        for (int r = 0; r < R; ++r)
          sums[r][c] = _mm512_dpbf16_ps(sums[r][c], (__m512bh)q_d[r], (__m512bh)kd);
      }
    }
    const __m512 scale = _mm512_set1_ps(scale_);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kKeyVecs; ++c) s[r][c] = fVec(_mm512_mul_ps(sums[r][c], scale));
  }

  void values(const float* p, int64_t p_stride, int64_t keys, const float* correction, float* acc) {
    // Each row's probabilities as bf16 pairs (keys is a whole number of W-key chunks).
    for (int r = 0; r < R; ++r)
      for (int64_t k = 0; k < keys; k += W)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_.data() + r * kKeyVecs * W / 2 + k / 2),
                            (__m256i)(_mm512_cvtneps_pbh(_mm512_loadu_ps(p + r * p_stride + k))));
    __m512 a[R][NV];
    for (int r = 0; r < R; ++r) {
      const __m512 c = _mm512_set1_ps(correction[r]);
      for (int j = 0; j < NV; ++j) a[r][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r * NV + j) * W), c);
    }
    for (int64_t pair = 0; pair < keys / 2; ++pair) {
      __m512i p_k[R];
      for (int r = 0; r < R; ++r) p_k[r] = _mm512_set1_epi32(static_cast<int>(p_[r * kKeyVecs * W / 2 + pair]));
      for (int j = 0; j < NV; ++j) {
        const __m512i vk = _mm512_loadu_si512(v_.data() + pair * D + j * W);
        for (int r = 0; r < R; ++r)
          a[r][j] = _mm512_dpbf16_ps(a[r][j], (__m512bh)p_k[r], (__m512bh)vk);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + (r * NV + j) * W, a[r][j]);
  }

 private:
  float scale_;
  std::vector<uint32_t> q_, kt_, v_, p_;
};

#endif

// Lane-wise and whole-vector max and sum for the online softmax. Scores hold no NaN (unused slots' keys are
// zeroed), so AVX512 takes the plain instructions instead of at::vec's NaN-propagating maximum.
inline fVec max_lanes(const fVec& a, const fVec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return fVec(_mm512_max_ps(a, b));
#else
  return at::vec::maximum(a, b);
#endif
}

inline float max_of(const fVec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_max_ps(x);
#else
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, x);
#endif
}

inline float sum_of(const fVec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(x);
#else
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, x);
#endif
}

struct PrefillTask {
  int64_t seq, kv_head, first;  // the tile's first query token, counted within the sequence's query
};

// A step's prefill tasks, one per (sequence, KV head, tile of kPrefillTile query tokens), with their work
// (query rows times the keys they see) for assign_tasks; sequences of one query token are decodes, left out.
void prefill_tasks(const int64_t* lens, const int64_t* starts, int64_t batch, int64_t block_size,
                   int64_t max_blocks, int64_t num_kv_heads, std::vector<PrefillTask>& tasks,
                   std::vector<int64_t>& work) {
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[b], "sequence ", b, " has ", q_len, " query tokens but seq_lens ",
                lens[b]);
    TORCH_CHECK((lens[b] + block_size - 1) / block_size <= max_blocks, "seq_lens[", b, "] = ", lens[b],
                " does not fit block_tables' ", max_blocks, " blocks");
    if (q_len < 2) continue;
    const int64_t context = lens[b] - q_len;
    for (int64_t first = 0; first < q_len; first += kPrefillTile) {
      const int64_t tokens = std::min(kPrefillTile, q_len - first);
      for (int64_t kh = 0; kh < num_kv_heads; ++kh) {
        tasks.push_back({b, kh, first});
        work.push_back(tokens * (context + first + tokens));
      }
    }
  }
}

// A step's prefill chunks as both prefill paths read them: shapes, strides and raw pointers, and the tasks
// split over the threads.
template <typename scalar_t>
struct PrefillBatch {
  int64_t num_heads, num_kv_heads, group, block_size, max_blocks, block_stride, head_stride, row_stride;
  const scalar_t* q;
  const scalar_t* k;
  const scalar_t* v;
  const int64_t* tables;
  const int64_t* lens;
  const int64_t* starts;
  scalar_t* out;
  std::vector<PrefillTask> tasks;
  std::vector<std::vector<int64_t>> assigned;

  PrefillBatch(const at::Tensor& q_, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
               at::Tensor& out_)
      : num_heads(q_.size(1)), num_kv_heads(k_cache.size(1)), group(num_heads / num_kv_heads),
        block_size(k_cache.size(2)), max_blocks(block_tables.size(1)), block_stride(k_cache.stride(0)),
        head_stride(k_cache.stride(1)), row_stride(k_cache.stride(2)), q(q_.data_ptr<scalar_t>()),
        k(k_cache.data_ptr<scalar_t>()), v(v_cache.data_ptr<scalar_t>()), tables(block_tables.data_ptr<int64_t>()),
        lens(seq_lens.data_ptr<int64_t>()), starts(query_start_loc.data_ptr<int64_t>()),
        out(out_.data_ptr<scalar_t>()) {
    std::vector<int64_t> work;
    prefill_tasks(lens, starts, seq_lens.numel(), block_size, max_blocks, num_kv_heads, tasks, work);
    assigned = assign_tasks(work);
  }
};

template <typename scalar_t, typename Operands>
void prefill_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const at::Tensor& query_start_loc, double scale, at::Tensor& out) {
  constexpr int64_t W = fVec::size();
  constexpr int64_t kStepKeys = kKeyVecs * W;
  constexpr int R = Operands::R;
  const PrefillBatch<scalar_t> chunks(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out);
  if (chunks.tasks.empty()) return;
  const int64_t head_dim = q.size(2);
  const fVec lane = [] {
    float idx[W];
    for (int64_t w = 0; w < W; ++w) idx[w] = static_cast<float>(w);
    return fVec::loadu(idx);
  }();
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, static_cast<int64_t>(chunks.assigned.size()), 1, [&](int64_t begin, int64_t end) {
    const int64_t padded_rows = (kPrefillTile * chunks.group + R - 1) / R * R;
    Operands operands(padded_rows, static_cast<float>(scale));
    std::vector<float> acc(padded_rows * head_dim), p(R * kStepKeys), row_max(padded_rows), row_sum(padded_rows),
        correction(R);
    for (int64_t thread = begin; thread < end; ++thread) {
      for (const int64_t index : chunks.assigned[thread]) {
        const PrefillTask& task = chunks.tasks[index];
        const int64_t b = task.seq, q_len = chunks.starts[b + 1] - chunks.starts[b], context = chunks.lens[b] - q_len;
        const int64_t tokens = std::min(kPrefillTile, q_len - task.first), rows = tokens * chunks.group;
        const int64_t* blocks = chunks.tables + b * chunks.max_blocks;
        // Row r is query token first + r / group, head kv_head * group + r % group.
        for (int64_t t = 0; t < tokens; ++t) {
          const int64_t token = chunks.starts[b] + task.first + t;
          const int64_t first_head = task.kv_head * chunks.group;
          operands.load_queries(t * chunks.group, chunks.q + (token * chunks.num_heads + first_head) * head_dim,
                                chunks.group);
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        std::fill(row_max.begin(), row_max.end(), kMinusInf);
        std::fill(row_sum.begin(), row_sum.end(), 0.f);
        const int64_t last_position = context + task.first + tokens - 1;
        for (int64_t step_first = 0; step_first <= last_position; step_first += kStepKeys) {
          // Each W-key chunk lies in one block (block_size is a multiple of W). Keys past the sequence's
          // end (or past the tile's last position) are masked below and their K and V zeroed: a reused
          // block holds anything there.
          const int n = static_cast<int>(std::min<int64_t>(kKeyVecs, (last_position - step_first) / W + 1));
          for (int c = 0; c < kKeyVecs; ++c) {
            const int64_t first_key = step_first + c * W;
            const int64_t valid = c < n ? std::min(W, chunks.lens[b] - first_key) : 0;
            const int64_t base = valid > 0 ? blocks[first_key / chunks.block_size] * chunks.block_stride +
                                                 task.kv_head * chunks.head_stride +
                                                 (first_key % chunks.block_size) * chunks.row_stride
                                           : 0;
            operands.load_chunk(c, chunks.k + base, chunks.v + base, chunks.row_stride, std::max<int64_t>(valid, 0));
          }
          const int64_t step_keys = n * W;
          // Rows whose token precedes the whole step see none of it.
          const int64_t first_row = std::max<int64_t>(0, (step_first - context - task.first) * chunks.group);
          for (int64_t r0 = first_row / R * R; r0 < rows; r0 += R) {
            fVec s[R][kKeyVecs];
            operands.scores(r0, s);
            for (int r = 0; r < R; ++r) {
              const int64_t row = r0 + r;
              float* p_r = p.data() + r * kStepKeys;
              const int64_t position = context + task.first + std::min(row, rows - 1) / chunks.group;
              if (row >= rows || position < step_first) {
                correction[r] = 1.f;
                std::fill(p_r, p_r + step_keys, 0.f);
                continue;
              }
              // Keys after the row's own position (and any past the sequence's end) are masked.
              fVec step_max(kMinusInf);
              for (int c = 0; c < kKeyVecs; ++c) {
                const int64_t after = position - (step_first + c * W);
                if (after < W - 1) s[r][c] = fVec::blendv(s[r][c], fVec(kMinusInf), lane > fVec(static_cast<float>(after)));
                step_max = max_lanes(step_max, s[r][c]);
              }
              const float new_max = std::max(row_max[row], max_of(step_max));
              correction[r] = std::exp(row_max[row] - new_max);
              fVec sum(0.f);
              for (int c = 0; c < kKeyVecs; ++c) {
                const fVec probs = (s[r][c] - fVec(new_max)).exp_u20();
                probs.store(p_r + c * W);
                sum = sum + probs;
              }
              row_sum[row] = row_sum[row] * correction[r] + sum_of(sum);
              row_max[row] = new_max;
            }
            operands.values(p.data(), kStepKeys, step_keys, correction.data(), acc.data() + r0 * head_dim);
          }
        }
        for (int64_t row = 0; row < rows; ++row) {
          const int64_t token = chunks.starts[b] + task.first + row / chunks.group;
          const int64_t head = task.kv_head * chunks.group + row % chunks.group;
          float* a = acc.data() + row * head_dim;
          const fVec inv(row_sum[row] > 0.f ? 1.f / row_sum[row] : 0.f);
          at::vec::map([&](fVec x) { return x * inv; }, a, a, head_dim);
          at::vec::convert(a, chunks.out + (token * chunks.num_heads + head) * head_dim, head_dim);
        }
      }
    }
  });
}

#if defined(MESHSERVE_AMX)
// Prefill attention on AMX tiles, transposed: a tile's 16 lanes are 16 query rows, so the online softmax is
// lane-wise (no horizontal max or sum, one exp for the 16 rows' corrections). Per task (a sequence, a KV
// head, kPrefillTile query tokens; rows token-major, the group's heads side by side) and per step of 32 keys
// (two 16-key chunks, each inside one block):
//   S^T [keys x rows] = K [keys x D] . Q^T: K's rows are tiles as they lie in the cache; Q^T is packed once
//     per task into bf16 pairs along D (a B tile);
//   P^T = exp(S^T * scale - running max), masked past each row's position; packed into pairs of keys;
//   O^T [D x rows] += V^T [D x keys] . P^T: V^T is gathered once per step (pairs of elements along D across
//     the keys, split into rows of D), zero for keys past the sequence's end (a reused block holds anything).
// O^T and the running sums stay float32 in memory, rescaled by each step's corrections.
template <int NV>
void prefill_attention_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, at::Tensor& out) {
  using bf16 = at::BFloat16;
  constexpr int64_t L = 16;            // lanes: query rows of a row block, keys of a chunk, dims of a tile
  constexpr int64_t D = NV * L, D2 = D / 2;
  constexpr int64_t kStep = 2 * L;     // keys a step
  constexpr int64_t kDimTiles = D / L;
  constexpr int64_t kSumTiles = D / (2 * L);  // 32 elements of D a tile of the score sum
  static_assert(NV % 4 == 0);
  const PrefillBatch<bf16> chunks(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out);
  if (chunks.tasks.empty()) return;
  const int64_t row_blocks = (kPrefillTile * chunks.group + L - 1) / L;
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  const fVec vscale(static_cast<float>(scale));
  // vpermt2w indices: the even 16-bit elements of a then b (row d of V^T), and the odd ones (row d + 1).
  alignas(64) int16_t even_idx[32];
  for (int i = 0; i < 32; ++i) even_idx[i] = static_cast<int16_t>(i < 16 ? 2 * i : 32 + 2 * (i - 16));
  const __m512i evens = _mm512_loadu_si512(even_idx);
  const __m512i odds = _mm512_add_epi16(evens, _mm512_set1_epi16(1));
  // vpermw indices interleaving two converted key vectors: (p_even[lane], p_odd[lane]) pairs.
  alignas(64) int16_t pair_idx[32];
  for (int i = 0; i < 32; ++i) pair_idx[i] = static_cast<int16_t>(i % 2 == 0 ? i / 2 : 16 + i / 2);
  const __m512i pairs = _mm512_loadu_si512(pair_idx);
  const __m512i lane_words = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(chunks.row_stride / 2));

  at::parallel_for(0, static_cast<int64_t>(chunks.assigned.size()), 1, [&](int64_t begin, int64_t end) {
    TileConfig config;
    for (int t = 0; t < 8; ++t) {
      config.colsb[t] = 64;
      config.rows[t] = L;
    }
    _tile_loadconfig(&config);
    std::vector<uint32_t> q_t(row_blocks * kSumTiles * L * L);  // [row block][sum tile][word][lane]
    std::vector<float> acc(row_blocks * D * L), row_max(row_blocks * L), row_sum(row_blocks * L),
        position(row_blocks * L);
    std::vector<bf16> v_t(D * kStep);  // [dim][key]
    alignas(64) float scores[kStep * L];
    alignas(64) float pv[4 * L * L];
    alignas(64) uint32_t p_t[L * L];  // [key pair][lane]
    for (int64_t thread = begin; thread < end; ++thread) {
      for (const int64_t index : chunks.assigned[thread]) {
        const PrefillTask& task = chunks.tasks[index];
        const int64_t b = task.seq, q_len = chunks.starts[b + 1] - chunks.starts[b], context = chunks.lens[b] - q_len;
        const int64_t tokens = std::min(kPrefillTile, q_len - task.first), rows = tokens * chunks.group;
        const int64_t blocks_used = (rows + L - 1) / L;
        const int64_t* blocks = chunks.tables + b * chunks.max_blocks;
        const int64_t last_position = context + task.first + tokens - 1;
        // Q^T: word w of row r (elements 2w, 2w + 1) at q_t[((rb * kSumTiles + w / 16) * 16 + w % 16) * 16 + r % 16].
        for (int64_t rb = 0; rb < blocks_used; ++rb) {
          for (int64_t lane = 0; lane < L; ++lane) {
            const int64_t row = rb * L + lane;
            const uint32_t* q_row =
                row < rows ? reinterpret_cast<const uint32_t*>(
                                 chunks.q + ((chunks.starts[b] + task.first + row / chunks.group) * chunks.num_heads +
                                          task.kv_head * chunks.group + row % chunks.group) * D)
                           : nullptr;
            for (int64_t w = 0; w < D2; ++w) q_t[(rb * D2 + w) * L + lane] = q_row != nullptr ? q_row[w] : 0u;
            // Padding rows take the last row's position: they see keys, so their softmax stays finite.
            position[rb * L + lane] =
                static_cast<float>(context + task.first + std::min(row, rows - 1) / chunks.group);
          }
        }
        std::fill(acc.begin(), acc.begin() + blocks_used * D * L, 0.f);
        std::fill(row_max.begin(), row_max.begin() + blocks_used * L, kMinusInf);
        std::fill(row_sum.begin(), row_sum.begin() + blocks_used * L, 0.f);
        const int64_t head_offset = task.kv_head * chunks.head_stride;
        for (int64_t step_first = 0; step_first <= last_position; step_first += kStep) {
          // The two chunks' K and V rows; a chunk wholly past the tile's last position reads chunk 0's rows
          // (its scores are all masked) and gets zero V.
          const bf16* k_rows[2];
          const bf16* v_rows[2];
          __mmask16 valid[2];
          for (int c = 0; c < 2; ++c) {
            const int64_t first_key = step_first + c * L;
            const int64_t count = std::min<int64_t>(L, chunks.lens[b] - first_key);
            if (first_key > last_position || count <= 0) {
              k_rows[c] = k_rows[0];
              v_rows[c] = v_rows[0];
              valid[c] = 0;
              continue;
            }
            const int64_t base = blocks[first_key / chunks.block_size] * chunks.block_stride + head_offset +
                                 (first_key % chunks.block_size) * chunks.row_stride;
            k_rows[c] = chunks.k + base;
            v_rows[c] = chunks.v + base;
            valid[c] = count >= L ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
          }
          // V^T: row d holds the 32 keys' element d.
          for (int64_t w = 0; w < D2; ++w) {
            const __m512i g0 = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid[0], lane_words,
                                                           reinterpret_cast<const int*>(v_rows[0]) + w, 4);
            const __m512i g1 = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid[1], lane_words,
                                                           reinterpret_cast<const int*>(v_rows[1]) + w, 4);
            _mm512_storeu_si512(v_t.data() + (2 * w) * kStep, _mm512_permutex2var_epi16(g0, evens, g1));
            _mm512_storeu_si512(v_t.data() + (2 * w + 1) * kStep, _mm512_permutex2var_epi16(g0, odds, g1));
          }
          for (int64_t rb = 0; rb < blocks_used; ++rb) {
            const fVec pos = fVec::loadu(position.data() + rb * L);
            if (position[rb * L + L - 1] < static_cast<float>(step_first)) continue;  // sees none of the step
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t t = 0; t < kSumTiles; ++t) {
              _tile_loadd(2, k_rows[0] + t * 2 * L, chunks.row_stride * sizeof(bf16));
              _tile_loadd(3, k_rows[1] + t * 2 * L, chunks.row_stride * sizeof(bf16));
              _tile_loadd(4, q_t.data() + (rb * kSumTiles + t) * L * L, L * sizeof(uint32_t));
              _tile_dpbf16ps(0, 2, 4);
              _tile_dpbf16ps(1, 3, 4);
            }
            _tile_stored(0, scores, L * sizeof(float));
            _tile_stored(1, scores + L * L, L * sizeof(float));
            fVec s[kStep];
            fVec step_max(kMinusInf);
            for (int64_t k = 0; k < kStep; ++k) {
              // Keys after a row's own position (and so past the sequence's end) are masked.
              const fVec raw = fVec::loadu(scores + k * L) * vscale;
              s[k] = fVec::blendv(raw, fVec(kMinusInf), pos < fVec(static_cast<float>(step_first + k)));
              step_max = max_lanes(step_max, s[k]);
            }
            float* m = row_max.data() + rb * L;
            const fVec old_max = fVec::loadu(m);
            const fVec new_max = max_lanes(old_max, step_max);
            const fVec correction = (old_max - new_max).exp_u20();
            fVec sum(0.f);
            for (int64_t k = 0; k < kStep; k += 2) {
              const fVec p0 = (s[k] - new_max).exp_u20(), p1 = (s[k + 1] - new_max).exp_u20();
              sum = sum + p0 + p1;
              const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // p0 in words 0-15, p1 in 16-31
              _mm512_storeu_si512(p_t + (k / 2) * L, _mm512_permutexvar_epi16(pairs, both));
            }
            new_max.store(m);
            float* l = row_sum.data() + rb * L;
            (fVec::loadu(l) * correction + sum).store(l);
            _tile_loadd(5, p_t, L * sizeof(uint32_t));
            float* a = acc.data() + rb * D * L;
            for (int64_t j0 = 0; j0 < kDimTiles; j0 += 4) {
              _tile_zero(0);
              _tile_zero(1);
              _tile_zero(2);
              _tile_zero(3);
              _tile_loadd(6, v_t.data() + (j0 + 0) * L * kStep, kStep * sizeof(bf16));
              _tile_dpbf16ps(0, 6, 5);
              _tile_loadd(7, v_t.data() + (j0 + 1) * L * kStep, kStep * sizeof(bf16));
              _tile_dpbf16ps(1, 7, 5);
              _tile_loadd(6, v_t.data() + (j0 + 2) * L * kStep, kStep * sizeof(bf16));
              _tile_dpbf16ps(2, 6, 5);
              _tile_loadd(7, v_t.data() + (j0 + 3) * L * kStep, kStep * sizeof(bf16));
              _tile_dpbf16ps(3, 7, 5);
              _tile_stored(0, pv, L * sizeof(float));
              _tile_stored(1, pv + L * L, L * sizeof(float));
              _tile_stored(2, pv + 2 * L * L, L * sizeof(float));
              _tile_stored(3, pv + 3 * L * L, L * sizeof(float));
              float* a_j = a + j0 * L * L;
              for (int64_t i = 0; i < 4 * L; ++i) {
                const fVec updated = at::vec::fmadd(fVec::loadu(a_j + i * L), correction, fVec::loadu(pv + i * L));
                updated.store(a_j + i * L);
              }
            }
          }
        }
        // O = (O^T)^T / sum, row by row.
        for (int64_t rb = 0; rb < blocks_used; ++rb) {
          alignas(64) float inv[L];
          for (int64_t lane = 0; lane < L; ++lane) {
            const float l = row_sum[rb * L + lane];
            inv[lane] = l > 0.f ? 1.f / l : 0.f;
          }
          const float* a = acc.data() + rb * D * L;
          for (int64_t lane = 0; lane < L && rb * L + lane < rows; ++lane) {
            const int64_t row = rb * L + lane;
            const int64_t token = chunks.starts[b] + task.first + row / chunks.group;
            const int64_t head = task.kv_head * chunks.group + row % chunks.group;
            bf16* dst = chunks.out + (token * chunks.num_heads + head) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<bf16>(a[d * L + lane] * inv[lane]);
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

// The float32 operands, or the bf16 dot products where the build has them.
template <typename scalar_t, int NV>
void prefill_attention_for(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, at::Tensor& out) {
#if defined(MESHSERVE_AMX)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> && NV % 4 == 0) {
    if (amx_permitted()) {
      return prefill_attention_amx<NV>(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out);
    }
  }
#endif
#if defined(MESHSERVE_BF16_DOT)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    return prefill_attention_impl<scalar_t, Bf16DotOperands<NV>>(q, k_cache, v_cache, block_tables, seq_lens,
                                                                 query_start_loc, scale, out);
  }
#endif
  prefill_attention_impl<scalar_t, WidenedOperands<scalar_t, NV>>(q, k_cache, v_cache, block_tables, seq_lens,
                                                                   query_start_loc, scale, out);
}

// Whether bf16 prefill chunks multiply on AMX tiles here: built for them and granted by the kernel. The CPU
// platform sends fewer chunks to torch's SDPA when they do (platforms/cpu.py).
bool prefill_attention_on_amx() {
#if defined(MESHSERVE_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

// Whole float vectors per head and per KV block (a chunk of W keys never straddles two blocks).
bool prefill_attention_supported(int64_t head_dim, int64_t block_size) {
  const int64_t nv = head_dim / fVec::size();
  return head_dim % fVec::size() == 0 && (nv == 4 || nv == 8 || nv == 16) && block_size % fVec::size() == 0;
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                   const at::Tensor& query_start_loc, double scale) {
  check_paged_attention_args(q, k_cache, v_cache, "[tokens, num_heads, head_dim]");
  TORCH_CHECK(prefill_attention_supported(q.size(2), k_cache.size(2)), "no native prefill attention for head_dim ",
              q.size(2), " with block_size ", k_cache.size(2), "; run with --cpu-kernels reference");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong,
              "block_tables, seq_lens and query_start_loc must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == seq_lens.numel() &&
                  query_start_loc.numel() == seq_lens.numel() + 1,
              "block_tables [batch, max_blocks], seq_lens [batch] and query_start_loc [batch + 1] must agree");
  const at::Tensor qc = q.contiguous();
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const at::Tensor starts = query_start_loc.contiguous();
  TORCH_CHECK(starts.numel() == 0 || (starts.data_ptr<int64_t>()[0] >= 0 &&
                                      starts.data_ptr<int64_t>()[starts.numel() - 1] <= q.size(0)),
              "query_start_loc must lie within q's ", q.size(0), " tokens");
  at::Tensor out = at::empty_like(qc);
  dispatch_dtype(q.scalar_type(), "paged_prefill_attention", [&]<typename scalar_t>() {
    switch (q.size(2) / fVec::size()) {
      case 4:
        return prefill_attention_for<scalar_t, 4>(qc, k_cache, v_cache, tables, lens, starts, scale, out);
      case 8:
        return prefill_attention_for<scalar_t, 8>(qc, k_cache, v_cache, tables, lens, starts, scale, out);
      default:
        return prefill_attention_for<scalar_t, 16>(qc, k_cache, v_cache, tables, lens, starts, scale, out);
    }
  });
  return out;
}

// -------------------------------------------------------------------------------------------- RMSNorm

template <typename scalar_t>
std::vector<float> floats_of(const at::Tensor& t) {
  std::vector<float> out(t.numel());
  to_float(t.data_ptr<scalar_t>(), out.data(), t.numel());
  return out;
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  check_cpu(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "weight must be [hidden], matching x's last dim");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must share a dtype");
}

// rms_norm of each row of x, or of x + residual when new_residual is given (which then receives that
// sum, rounded to the dtype as the reference's add rounds it); out gets the normed rows.
void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
               at::Tensor& out, at::Tensor* new_residual) {
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const at::Tensor rc = residual != nullptr ? residual->contiguous() : at::Tensor();
  const int64_t n = xc.size(-1), rows = xc.numel() / std::max<int64_t>(n, 1);
  dispatch_dtype(x.scalar_type(), "rms_norm", [&]<typename scalar_t>() {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* rp = residual != nullptr ? rc.data_ptr<scalar_t>() : nullptr;
    const std::vector<float> w = floats_of<scalar_t>(wc);
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* np = new_residual != nullptr ? new_residual->data_ptr<scalar_t>() : nullptr;
    // Two passes over a row, a pair of vectors at a time: the (rounded) sum and its squares, then the scaled,
    // rounded, weighted output. The row waits in a float buffer (L1) between them.
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(n + kPair);
      for (int64_t r = begin; r < end; ++r) {
        fVec sq0(0.f), sq1(0.f);
        for (int64_t j = 0; j < n; j += kPair) {
          const int64_t count = std::min(kPair, n - j);
          auto [a, b] = load_pair(xp + r * n + j, count);
          if (rp != nullptr) {
            const auto [ra, rb] = load_pair(rp + r * n + j, count);
            std::tie(a, b) = round_pair<scalar_t>(a + ra, b + rb);  // the reference's add rounds
            store_pair(np + r * n + j, a, b, count);
          }
          a.store(row.data() + j);
          b.store(row.data() + j + fVec::size());
          sq0 = at::vec::fmadd(a, a, sq0);
          sq1 = at::vec::fmadd(b, b, sq1);
        }
        const float sq = sum_of(sq0 + sq1);
        const fVec scale(1.f / std::sqrt(sq / static_cast<float>(n) + static_cast<float>(eps)));
        for (int64_t j = 0; j < n; j += kPair) {
          const int64_t count = std::min(kPair, n - j);
          const auto [a, b] = round_pair<scalar_t>(fVec::loadu(row.data() + j) * scale,
                                                   fVec::loadu(row.data() + j + fVec::size()) * scale);
          const auto [wa, wb] = load_pair(w.data() + j, count);
          store_pair(op + r * n + j, a * wa, b * wb, count);
        }
      }
    });
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  at::Tensor out = at::empty(x.sizes(), x.options());
  norm_rows(x, nullptr, weight, eps, out, nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must match x's shape and dtype");
  at::Tensor out = at::empty(x.sizes(), x.options()), new_residual = at::empty(x.sizes(), x.options());
  norm_rows(x, &residual, weight, eps, out, &new_residual);
  return {out, new_residual};
}

// --------------------------------------------------------------------------------------------- SwiGLU

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "gate_up's last dim must be even (gate and up halves)");
  const at::Tensor in = gate_up.contiguous();
  const int64_t n = in.size(-1) / 2, rows = in.numel() / std::max<int64_t>(2 * n, 1);
  std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, in.options());
  dispatch_dtype(in.scalar_type(), "silu_and_mul", [&]<typename scalar_t>() {
    const scalar_t* ip = in.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    // F.silu's own formula, and its rounding to the dtype before the multiply; one pass, in registers.
    const auto silu = [](const fVec& x) { return x / (fVec(1.f) + x.neg().exp()); };
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = ip + r * 2 * n;
        const scalar_t* up = gate + n;
        scalar_t* dst = op + r * n;
        for (int64_t j = 0; j < n; j += kPair) {
          const int64_t count = std::min(kPair, n - j);
          const auto [g0, g1] = load_pair(gate + j, count);
          const auto [u0, u1] = load_pair(up + j, count);
          const auto [s0, s1] = round_pair<scalar_t>(silu(g0), silu(g1));
          store_pair(dst + j, s0 * u0, s1 * u1, count);
        }
      }
    });
  });
  return out;
}

// --------------------------------------------------------------------------------------------- rotary

// x [T, H, D] rotated by cos/sin [T, D] (rotate_half convention) with rotary.apply_rotary's roundings:
// cos and sin rounded to the dtype, each product rounded, then their sum.
// x may be a strided view (q and k are slices of the fused QKV output): read through its strides, write a
// contiguous result.
template <typename scalar_t>
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor xc = x.stride(2) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  const int64_t tokens = xc.size(0), heads = xc.size(1), dim = xc.size(2), half = dim / 2;
  const int64_t st = xc.stride(0), sh = xc.stride(1);
  const scalar_t* xp = xc.data_ptr<scalar_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  scalar_t* op = out.data_ptr<scalar_t>();
  // Halves of whole vector pairs go a pair at a time: rotate_half only moves whole pairs then.
  const bool paired = half % kPair == 0;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> rounded(2 * dim);  // the token's cos and sin, rounded to the dtype
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * dim;
      const float* s = sp + t * dim;
      if (paired) {
        for (int64_t d = 0; d < dim; d += kPair) {
          const auto [c0, c1] = round_pair<scalar_t>(fVec::loadu(c + d), fVec::loadu(c + d + fVec::size()));
          const auto [s0, s1] = round_pair<scalar_t>(fVec::loadu(s + d), fVec::loadu(s + d + fVec::size()));
          c0.store(rounded.data() + d);
          c1.store(rounded.data() + d + fVec::size());
          s0.store(rounded.data() + dim + d);
          s1.store(rounded.data() + dim + d + fVec::size());
        }
        const float* rc = rounded.data();
        const float* rs = rounded.data() + dim;
        const auto pair_at = [](const float* p) { return std::pair{fVec::loadu(p), fVec::loadu(p + fVec::size())}; };
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* src = xp + t * st + h * sh;
          scalar_t* dst = op + (t * heads + h) * dim;
          for (int64_t d = 0; d < half; d += kPair) {
            const auto [x0, x1] = load_pair(src + d);         // first half
            const auto [y0, y1] = load_pair(src + half + d);  // second half
            const auto [c0, c1] = pair_at(rc + d);
            const auto [s0, s1] = pair_at(rs + d);
            const auto [c2, c3] = pair_at(rc + half + d);
            const auto [s2, s3] = pair_at(rs + half + d);
            // out[d] = x[d] * cos[d] + (-x[d + half]) * sin[d]; out[d + half] = x[d + half] * cos + x[d] * sin.
            const auto [a0, a1] = round_pair<scalar_t>(x0 * c0, x1 * c1);
            const auto [b0, b1] = round_pair<scalar_t>(y0.neg() * s0, y1.neg() * s1);
            store_pair(dst + d, a0 + b0, a1 + b1);
            const auto [e0, e1] = round_pair<scalar_t>(y0 * c2, y1 * c3);
            const auto [f0, f1] = round_pair<scalar_t>(x0 * s2, x1 * s3);
            store_pair(dst + half + d, e0 + f0, e1 + f1);
          }
        }
        continue;
      }
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* src = xp + t * st + h * sh;
        scalar_t* dst = op + (t * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) {
          // rotate_half: (x1, x2) -> (-x2, x1).
          const float rot = d < half ? -static_cast<float>(src[d + half]) : static_cast<float>(src[d - half]);
          const float a = round_to<scalar_t>(static_cast<float>(src[d]) * round_to<scalar_t>(c[d]));
          const float b = round_to<scalar_t>(rot * round_to<scalar_t>(s[d]));
          dst[d] = static_cast<scalar_t>(a + b);
        }
      }
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                const at::Tensor& sin) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "q [T, Hq, D] and k [T, Hk, D] must share T and D");
  TORCH_CHECK(q.size(2) % 2 == 0, "head_dim must be even");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "q and k must share a dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "cos and sin must be float32");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == q.size(0) && cos.size(1) == q.size(2) && sin.sizes() == cos.sizes(),
              "cos and sin must be [T, D]");
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor q_out, k_out;
  dispatch_dtype(q.scalar_type(), "apply_rotary", [&]<typename scalar_t>() {
    q_out = rotate<scalar_t>(q, cc, sc);
    k_out = rotate<scalar_t>(k, cc, sc);
  });
  return {q_out, k_out};
}

// ----------------------------------------------------------------------------------- KV cache write

// Writes k, v [T, Hk, D] (strided views allowed, head_dim contiguous) into head-major cache views at
// slot_mapping [T] (slot = block * block_size + offset): one row copy per (token, head), no index tensors.
void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& slot_mapping) {
  check_cpu(k, "k");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k and v must both be [T, num_kv_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(),
              "k_cache and v_cache must be matching [num_blocks, num_kv_heads, block_size, head_dim] views");
  TORCH_CHECK(k_cache.size(1) == k.size(1) && k_cache.size(3) == k.size(2), "k's heads and head_dim must match the cache's");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(),
              "k, v and the caches must share a dtype");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == k.size(0),
              "slot_mapping must be int64 [T]");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2), block_size = k_cache.size(2);
  const int64_t num_slots = k_cache.size(0) * block_size;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot_mapping[", t, "] = ", sp[t], " is outside the cache's ",
                num_slots, " slots");
  }
  dispatch_dtype(k.scalar_type(), "reshape_and_cache", [&]<typename scalar_t>() {
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t block = sp[t] / block_size, offset = sp[t] % block_size;
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t dst = block * k_cache.stride(0) + h * k_cache.stride(1) + offset * k_cache.stride(2);
          std::copy_n(kp + t * k.stride(0) + h * k.stride(1), dim, kc + dst);
          std::copy_n(vp + t * v.stride(0) + h * v.stride(1), dim, vc + dst);
        }
      }
    });
  });
}


}  // namespace

TORCH_LIBRARY(meshserve_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
  m.def("decode_attention_supported(int head_dim, int group) -> bool", &decode_attention_supported);
  m.def("prefill_attention_on_amx() -> bool", &prefill_attention_on_amx);
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale) -> Tensor");
  m.def("prefill_attention_supported(int head_dim, int block_size) -> bool", &prefill_attention_supported);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("reshape_and_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("apply_rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  }

TORCH_LIBRARY_IMPL(meshserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("apply_rotary", &apply_rotary);
}

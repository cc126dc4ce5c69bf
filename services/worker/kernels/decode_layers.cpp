// A decode step's decoder layers in one call: for each layer the fused input norm, QKV linear, rotary, KV cache
// write, paged decode attention, output linear, fused post-attention norm, gate/up linear, SwiGLU and down linear,
// each through the same registered kernel (cpu_ops.cpp, quantized_linear.cpp) that models/llama.py's bound
// layer calls, in the same order and dtypes, so a step's numbers do not change. What goes is the Python between
// the kernels: ~16 calls a layer through torch.ops, each 3-11 us of interpreter and dispatch on the Zen 3 EPYC,
// where a one-row step's kernels take ~15-20 ms in all (docs/benchmarks.md, twentieth step).
//
// The caller (platforms/cpu_native_ops.py) takes this path only where every linear runs its small-step kernel and
// every sequence has one query token; anything else stays on the per-layer path.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> kernel(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The registered kernels a layer calls, looked up once: a typed call costs a dispatch-key lookup, not a
// Python round trip.
struct Kernels {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      kernel<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("meshserve_cpu::rms_norm");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, double)>
      add_rms_norm = kernel<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, double)>(
          "meshserve_cpu::add_rms_norm");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, const at::Tensor&)>
      apply_rotary = kernel<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, const at::Tensor&)>(
          "meshserve_cpu::apply_rotary");
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&)>
      reshape_and_cache = kernel<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&)>("meshserve_cpu::reshape_and_cache");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, double)>
      decode_attention = kernel<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, const at::Tensor&, double)>(
          "meshserve_cpu::paged_decode_attention");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul =
      kernel<at::Tensor(const at::Tensor&)>("meshserve_cpu::silu_and_mul");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)> half_linear =
      kernel<at::Tensor(const at::Tensor&, const at::Tensor&)>("meshserve_cpu::half_linear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)> int8_linear =
      kernel<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>("meshserve_cpu::int8_linear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>
      int4_linear = kernel<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "meshserve_cpu::int4_linear");
};

const Kernels& kernels() {
  static const Kernels instance;
  return instance;
}

// The linears of one layer, in the order a layer runs them.
constexpr int64_t kLinearsPerLayer = 4;  // qkv, o, gate_up, down
constexpr int64_t kNormsPerLayer = 2;    // input, post-attention

// One linear's weight operands, read in order from the flat list. Its kernel is told by how many it has, which is
// each kernel's own signature: half_linear(x, weight), int8_linear(x, qweight, scales), int4_linear(x, packed,
// scales, offsets).
at::Tensor run_linear(const Kernels& k, const at::Tensor& x, const at::Tensor* operands, int64_t count,
                      const std::optional<at::Tensor>& bias) {
  at::Tensor out;
  switch (count) {
    case 1:
      out = k.half_linear.call(x, operands[0]);
      break;
    case 2:
      out = k.int8_linear.call(x, operands[0], operands[1]);
      break;
    case 3:
      out = k.int4_linear.call(x, operands[0], operands[1], operands[2]);
      break;
    default:
      TORCH_CHECK(false, "decode_layers: a linear has 1 (half), 2 (int8) or 3 (int4) weight operands, got ", count);
  }
  // The bias arrives in the compute dtype, added after the kernel, as the per-layer path adds it.
  return bias.has_value() ? out + *bias : out;
}

// x in dtype: x itself when it has it, as layers/dtypes.to_dtype.
at::Tensor to_dtype(const at::Tensor& x, at::ScalarType dtype) { return x.scalar_type() == dtype ? x : x.to(dtype); }

// The layers over hidden [T, hidden] (and the residual stream carried in, or none before the first layer); returns
// (hidden, residual) after the last layer, as the per-layer loop does: the final norm is the caller's.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden_in, const std::optional<at::Tensor>& residual_in, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList norms, at::TensorList weights, at::IntArrayRef operand_counts,
    const c10::List<std::optional<at::Tensor>>& biases, at::TensorList k_caches, at::TensorList v_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens, double eps,
    double scale, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::ScalarType accum,
    at::ScalarType compute) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(v_caches.size() == k_caches.size(), "decode_layers: one k and one v cache a layer");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == kNormsPerLayer * layers, "decode_layers: two norms a layer");
  TORCH_CHECK(static_cast<int64_t>(operand_counts.size()) == kLinearsPerLayer * layers &&
                  static_cast<int64_t>(biases.size()) == kLinearsPerLayer * layers,
              "decode_layers: four linears (operand counts and biases) a layer");
  int64_t total_operands = 0;
  for (const int64_t count : operand_counts) total_operands += count;
  TORCH_CHECK(total_operands == static_cast<int64_t>(weights.size()), "decode_layers: ", weights.size(),
              " weight operands for linears that take ", total_operands);
  TORCH_CHECK(hidden_in.dim() == 2 && seq_lens.numel() == hidden_in.size(0),
              "decode_layers: one query token a sequence (hidden [T, hidden], seq_lens [T])");
  const int64_t tokens = hidden_in.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const Kernels& k = kernels();

  // The fused norm: in the accumulation dtype, its output in the compute dtype (models/llama.RMSNorm.bind).
  const auto norm = [&](const at::Tensor& x_in, std::optional<at::Tensor>& residual, const at::Tensor& weight) {
    const at::Tensor x = to_dtype(x_in, accum);
    if (!residual.has_value()) {
      residual = x;
      return to_dtype(k.rms_norm.call(x, weight, eps), compute);
    }
    auto [normed, summed] = k.add_rms_norm.call(x, *residual, weight, eps);
    residual = summed;
    return to_dtype(normed, compute);
  };

  at::Tensor hidden = hidden_in;
  std::optional<at::Tensor> residual = residual_in;
  const at::Tensor* operand = weights.data();
  for (int64_t layer = 0; layer < layers; ++layer) {
    const int64_t* counts = operand_counts.data() + kLinearsPerLayer * layer;
    const auto linear = [&](int64_t index, const at::Tensor& x) {
      const at::Tensor* first = operand;
      operand += counts[index];
      const std::optional<at::Tensor> bias = biases.get(kLinearsPerLayer * layer + index);
      return run_linear(k, x, first, counts[index], bias);
    };
    // Attention (models/llama.LlamaAttention.bind).
    at::Tensor x = norm(hidden, residual, norms[kNormsPerLayer * layer]);
    const at::Tensor qkv = linear(0, x);
    const at::Tensor q = qkv.narrow(1, 0, q_size).reshape({tokens, num_heads, head_dim});
    const at::Tensor key = qkv.narrow(1, q_size, kv_size).reshape({tokens, num_kv_heads, head_dim});
    const at::Tensor value = qkv.narrow(1, q_size + kv_size, kv_size).reshape({tokens, num_kv_heads, head_dim});
    auto [q_rot, k_rot] = k.apply_rotary.call(q, key, cos, sin);
    k.reshape_and_cache.call(k_rot, value, k_caches[layer], v_caches[layer], slot_mapping);
    const at::Tensor attended =
        k.decode_attention.call(q_rot, k_caches[layer], v_caches[layer], block_tables, seq_lens, scale);
    hidden = linear(1, attended.reshape({tokens, q_size}));
    // MLP (models/llama.LlamaMLP.bind).
    x = norm(hidden, residual, norms[kNormsPerLayer * layer + 1]);
    const at::Tensor gate_up = linear(2, x);  // before down: linear() reads the operands in order
    hidden = linear(3, k.silu_and_mul.call(gate_up));
  }
  TORCH_CHECK(residual.has_value(), "decode_layers: no layers to run");
  return {hidden, *residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(meshserve_cpu, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor? residual, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] weights, "
      "int[] operand_counts, Tensor?[] biases, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, float eps, float scale, int num_heads, int num_kv_heads, int head_dim, "
      "ScalarType accum_dtype, ScalarType compute_dtype) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(meshserve_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }

// A decode-only CPU step's decoder layers in one op call (engine/model/decode_stack.py). It calls the very ops the
// Python layer loop of engine/model/decoder.py calls, in the same order on the same tensors, so its output is the
// loop's bit for bit; what it saves is the loop's Python: ~12 calls a layer through wrappers and torch.ops, each
// costing more than the op itself at batch 1 (measured in docs/performance.md). The ops live in kvloom's other
// libraries (and oneDNN's linear in ATen) and are reached through the dispatcher, looked up on first use.
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>
#include <cstdint>
#include <optional>

namespace {

// how a linear runs: as engine/model/decode_stack.py's LINEAR_KINDS numbers them
enum Kind : int64_t { QUANTIZED = 0, QUANTIZED_INT8 = 1, BLOCKED = 2, ONEDNN = 3, DENSE = 4 };

using OptionalTensor = std::optional<at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t bits, int64_t N,
                        const OptionalTensor& bias, bool int8) {
  static const auto handle = op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                           const OptionalTensor&, bool)>("kvloom::quant_linear");
  return handle.call(x, tiles, bits, N, bias, int8);
}

at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& weight, int64_t N, const OptionalTensor& bias) {
  static const auto handle = op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptionalTensor&)>(
      "kvloom::blocked_linear");
  return handle.call(x, weight, N, bias);
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias) {
  // boxed: its schema's string and scalar-list arguments have no stable C++ signature across torch versions
  static const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, weight, bias, c10::IValue("none"), c10::List<std::optional<at::Scalar>>(),
                          c10::IValue("")};
  handle.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor linear(const at::Tensor& x, int64_t kind, const at::Tensor& weight, const OptionalTensor& bias,
                  int64_t N, int64_t bits) {
  const at::Tensor rows = x.contiguous();
  switch (kind) {
    case QUANTIZED: return quant_linear(rows, weight, bits, N, bias, false);
    case QUANTIZED_INT8: return quant_linear(rows, weight, bits, N, bias, true);
    case BLOCKED: return blocked_linear(rows, weight, N, bias);
    case ONEDNN: return onednn_linear(rows, weight, bias);
    case DENSE: return at::linear(x, weight, bias);
    default: TORCH_CHECK(false, "decode_stack: unknown linear kind ", kind);
  }
}

at::Tensor add_rms_norm_(const at::Tensor& residual, const OptionalTensor& delta, const at::Tensor& weight,
                         double eps, at::ScalarType out_dtype) {
  static const auto handle = op<at::Tensor(const at::Tensor&, const OptionalTensor&, const at::Tensor&, double,
                                           at::ScalarType)>("kvloom::add_rms_norm_");
  return handle.call(residual, delta, weight, eps, out_dtype);
}

void rotary_embedding_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                       int64_t head_dim) {
  static const auto handle = op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t)>(
      "kvloom::rotary_embedding_");
  handle.call(qkv, cos, sin, heads, head_dim);
}

void write_kv(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& key,
              const at::Tensor& value, const at::Tensor& slot_mapping) {
  static const auto handle = op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&)>("kvloom::write_kv");
  handle.call(key_cache, value_cache, key, value, slot_mapping);
}

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  static const auto handle = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, const at::Tensor&, double)>("kvloom::paged_decode");
  return handle.call(query, key_cache, value_cache, block_tables, seq_lens, scale);
}

void lora_add_(const at::Tensor& y, const at::Tensor& x, const at::Tensor& tables, const at::Tensor& rows,
               int64_t linear) {
  static const auto handle = op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     int64_t, int64_t)>("kvloom::lora_add_");
  handle.call(y, x, tables, rows, linear, 0);
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  static const auto handle = op<at::Tensor(const at::Tensor&)>("kvloom::silu_and_mul");
  return handle.call(gate_up);
}

// Layers 0..L-1 (L = len(key_caches)) of a step whose T rows are each one request's one new token. `hidden`: layer
// 0's normalized input, `residual` [T, hidden] float32 updated in place; the linears four a layer (qkv, o_proj,
// gate|up, down) as (kind, weight, bias, out features, bits), each followed by its LoRA deltas where `lora_tables`
// and `lora_rows` are given (cpu_lora.cpp's lora_add_; table row 4 * layer + linear); the last layer's output is
// normalized by `final_norm`. Returns the normalized hidden states after layer L-1, as the Python loop does.
at::Tensor decode_stack(const at::Tensor& residual, const at::Tensor& hidden, const at::Tensor& cos,
                        const at::Tensor& sin, at::TensorList input_norms, at::TensorList post_norms,
                        const at::Tensor& final_norm, at::TensorList key_caches, at::TensorList value_caches,
                        const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        const OptionalTensor& lora_tables, const OptionalTensor& lora_rows, at::IntArrayRef kinds, at::TensorList weights, const c10::List<OptionalTensor>& biases,
                        at::IntArrayRef out_features, at::IntArrayRef bits, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, double scale, double eps, at::ScalarType dtype) {
  const int64_t L = static_cast<int64_t>(key_caches.size()), T = residual.size(0);
  TORCH_CHECK(value_caches.size() == key_caches.size() && static_cast<int64_t>(input_norms.size()) >= L &&
                  static_cast<int64_t>(post_norms.size()) >= L,
              "decode_stack: a cache pair and two norms a layer");
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) >= 4 * L && static_cast<int64_t>(weights.size()) >= 4 * L &&
                  static_cast<int64_t>(biases.size()) >= 4 * L && static_cast<int64_t>(out_features.size()) >= 4 * L &&
                  static_cast<int64_t>(bits.size()) >= 4 * L,
              "decode_stack: four linears a layer");
  TORCH_CHECK(hidden.size(0) == T && slot_mapping.size(0) == T && block_tables.size(0) == T && seq_lens.size(0) == T,
              "decode_stack: one new token a request");
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  TORCH_CHECK(lora_tables.has_value() == lora_rows.has_value(), "decode_stack: LoRA tables come with their rows");
  const auto run = [&](int64_t index, const at::Tensor& x) {
    at::Tensor y = linear(x, kinds[index], weights[index], biases.get(index), out_features[index], bits[index]);
    if (lora_tables.has_value()) lora_add_(y, x, *lora_tables, *lora_rows, index);
    return y;
  };
  at::Tensor normed = hidden;
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor qkv = run(4 * i, normed);
    rotary_embedding_(qkv, cos, sin, heads + kv_heads, head_dim);
    const at::Tensor query = qkv.narrow(1, 0, q_width).view({T, heads, head_dim});
    const at::Tensor key = qkv.narrow(1, q_width, kv_width).view({T, kv_heads, head_dim});
    const at::Tensor value = qkv.narrow(1, q_width + kv_width, kv_width).view({T, kv_heads, head_dim});
    write_kv(key_caches[i], value_caches[i], key, value, slot_mapping);
    const at::Tensor attention =
        paged_decode(query, key_caches[i], value_caches[i], block_tables, seq_lens, scale).reshape({T, -1});
    normed = add_rms_norm_(residual, run(4 * i + 1, attention), post_norms[i], eps, dtype);
    const at::Tensor activated = silu_and_mul(run(4 * i + 2, normed));
    normed = add_rms_norm_(residual, run(4 * i + 3, activated), i + 1 < L ? input_norms[i + 1] : final_norm, eps,
                           dtype);
  }
  return normed;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("decode_stack(Tensor(a!) residual, Tensor hidden, Tensor cos, Tensor sin, Tensor[] input_norms, "
        "Tensor[] post_norms, Tensor final_norm, Tensor(b!)[] key_caches, Tensor(c!)[] value_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor? lora_tables, Tensor? lora_rows, "
        "int[] kinds, Tensor[] weights, Tensor?[] biases, int[] out_features, int[] bits, int heads, int kv_heads, "
        "int head_dim, float scale, float eps, ScalarType dtype) -> Tensor",
        &decode_stack);
}

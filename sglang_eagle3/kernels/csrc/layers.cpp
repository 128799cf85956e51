// Whole decoder layers of a decode, verify or draft step, composed from the kernels of linear.cpp / amx_linear.cpp
// (linear_bf16), attention.cpp (qkv_attention) and elementwise.cpp (norms, SiLU) in one call each (no Python between
// them), in the same order as the layer-by-layer paths (target.py, draft.py), so both give bit-identical results.
// A layer's weights come as one LayerWeights, built once when the model is prepared.
#include <torch/extension.h>

#include "ops.h"

// Python's LayerWeights(...) constructor: the shapes are checked here, once per layer, not on every step.
LayerWeights make_layer_weights(at::Tensor input_norm, at::Tensor post_norm, double eps, at::Tensor wqkv,
                                at::Tensor wo, at::Tensor w_gate_up, at::Tensor w_down, int64_t qkv_features,
                                int64_t gate_up_features, int64_t num_heads, int64_t num_kv_heads,
                                c10::optional<at::Tensor> hidden_norm, c10::optional<at::Tensor> wqkv_bias,
                                c10::optional<at::Tensor> wo_bias) {
  const int64_t H = input_norm.numel();
  for (const at::Tensor* norm : {&input_norm, &post_norm, hidden_norm ? &*hidden_norm : &input_norm})
    TORCH_CHECK(norm->dim() == 1 && norm->numel() == H && norm->is_contiguous() &&
                norm->scalar_type() == at::kBFloat16, "LayerWeights: the norms must be bf16 [H] of one size");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
              qkv_features % (num_heads + 2 * num_kv_heads) == 0 && gate_up_features % 2 == 0,
              "LayerWeights: qkv_features must be (num_heads + 2 num_kv_heads) * head_dim, gate_up_features 2 * I");
  return {std::move(input_norm), std::move(post_norm), std::move(hidden_norm), eps, std::move(wqkv),
          std::move(wo), std::move(w_gate_up), std::move(w_down), std::move(wqkv_bias), std::move(wo_bias),
          qkv_features, gate_up_features, num_heads, num_kv_heads};
}

namespace {
// o_proj(attention(qkv_proj(h))): h [B, T, K] or packed [1, M, K] -> [B, T, H] or [1, M, H]; rotary embedding, KV store and tree mask as qkv_attention.
// The step's layout is new_mask's [B, T]: M = B * T tokens, or, packed, M = sum(row_tokens) real tokens (row b's
// first row_tokens[b]) at flat indices packed [M] of that layout; the attention reads them in place and skips the rest.
at::Tensor attention_block(const at::Tensor& h, const LayerWeights& w, int64_t H, const at::Tensor& cos,
                           const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& rows,
                           const at::Tensor& lens, const at::Tensor& write_start, const at::Tensor& new_mask,
                           double scale, const c10::optional<at::Tensor>& packed = c10::nullopt,
                           const c10::optional<at::Tensor>& row_tokens = c10::nullopt) {
  const int64_t B = new_mask.size(0), T = new_mask.size(1), M = h.numel() / h.size(-1);
  at::Tensor qkv = linear_bf16(h.view({M, h.size(-1)}), w.wqkv, w.qkv_features, w.wqkv_bias);   // [M, W]
  if (packed) {                                       // into the [B, T] layout (padding left unset: never read)
    at::Tensor laid = at::empty({B * T, w.qkv_features}, qkv.options());
    laid.index_copy_(0, *packed, qkv);
    qkv = laid;
  }
  at::Tensor o = qkv_attention(qkv.view({B, T, w.qkv_features}), cos, sin, w.num_heads, w.num_kv_heads, k_cache,
                               v_cache, rows, lens, write_start, new_mask, scale, row_tokens);   // [B, T, nH * D]
  o = o.view({B * T, o.size(2)});
  if (packed) o = o.index_select(0, *packed);
  return linear_bf16(o, w.wo, H, w.wo_bias).view({h.size(0), h.size(1), H});
}

// down(silu(gate) * up)(h): h [B, T, H] -> [B, T, H]
at::Tensor mlp_block(const at::Tensor& h, const LayerWeights& w) {
  const int64_t B = h.size(0), T = h.size(1), H = h.size(2);
  at::Tensor act = silu_and_mul(linear_bf16(h.view({B * T, H}), w.w_gate_up, w.gate_up_features, c10::nullopt));
  return linear_bf16(act, w.w_down, H, c10::nullopt).view({B, T, H});
}
}  // namespace

// One decoder layer of a decode or verify step, the same kernels as the step-by-step path in one call (no Python
// between them). x [B, T, H] is the residual stream, updated in place:
//   x += delta (when given); captured = a copy of x (when asked, an auxiliary feature); h = RMSNorm(x)
//   x += o_proj(attention(qkv_proj(h)))  (rotary embedding, KV store and tree mask as qkv_attention)
//   returns [down(silu(gate) * up)(RMSNorm(x)), captured?]: the next layer's delta.
// A ragged step (rows with fewer tree nodes than others): x [1, M, H] holds only the real tokens, row b's first
// row_tokens[b] of new_mask's [B, T] layout, at its flat indices packed [M]; cos / sin / new_mask keep the layout.
// Padding costs no product and no attention, and each real token's numbers are those of the unpacked step.
std::vector<at::Tensor> layer_step(at::Tensor x, const c10::optional<at::Tensor>& delta, bool capture,
                                   const LayerWeights& w, const at::Tensor& cos, const at::Tensor& sin,
                                   at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& rows,
                                   const at::Tensor& lens, const at::Tensor& write_start, const at::Tensor& new_mask,
                                   double scale, const c10::optional<at::Tensor>& packed,
                                   const c10::optional<at::Tensor>& row_tokens) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "layer_step: x [B, T, H] bf16");
  const bool ragged = packed && packed->defined();
  TORCH_CHECK(ragged == (row_tokens && row_tokens->defined()), "layer_step: packed and row_tokens come together");
  if (ragged)
    TORCH_CHECK(packed->scalar_type() == at::kLong && packed->dim() == 1 && x.size(0) == 1 &&
                x.size(1) == packed->numel(), "layer_step: packed must be int64 [M] for x [1, M, H]");
  at::Tensor h = delta && delta->defined() ? add_rms_norm(x, *delta, w.input_norm, w.eps)
                                           : rms_norm(x, w.input_norm, w.eps);
  std::vector<at::Tensor> out;
  at::Tensor captured = capture ? x.clone() : at::Tensor();
  at::Tensor attn = attention_block(h, w, x.size(2), cos, sin, k_cache, v_cache, rows, lens, write_start, new_mask,
                                    scale, ragged ? packed : c10::nullopt, ragged ? row_tokens : c10::nullopt);
  out.push_back(mlp_block(add_rms_norm(x, attn, w.post_norm, w.eps), w));
  if (capture) out.push_back(captured);
  return out;
}

// The EAGLE-3 draft's decoder layer (draft.py's Eagle3DecoderLayer with its fused weights) over the draft's KV pool:
//   x = cat(RMSNorm_input(embeds), RMSNorm_hidden(hidden))               [B, T, 2H]
//   out = hidden + o_proj(attention(qkv_proj(x)))   (rotary, KV store and tree mask as qkv_attention)
//   out += down(silu(gate) * up)(RMSNorm_post(out))
// returns out [B, T, H] (the pre-norm output; logits and the next step's input are the caller's).
at::Tensor draft_layer(const at::Tensor& embeds, const at::Tensor& hidden, const LayerWeights& w,
                       const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                       const at::Tensor& rows, const at::Tensor& lens, const at::Tensor& write_start,
                       const at::Tensor& new_mask, double scale) {
  TORCH_CHECK(embeds.dim() == 3 && hidden.sizes() == embeds.sizes() && embeds.scalar_type() == at::kBFloat16 &&
              hidden.scalar_type() == at::kBFloat16, "draft_layer: embeds and hidden [B, T, H] bf16");
  TORCH_CHECK(w.hidden_norm.has_value(), "draft_layer: LayerWeights without a hidden_norm");
  at::Tensor x = at::cat({rms_norm(embeds.contiguous(), w.input_norm, w.eps),
                          rms_norm(hidden.contiguous(), *w.hidden_norm, w.eps)}, -1);
  at::Tensor attn = attention_block(x, w, embeds.size(2), cos, sin, k_cache, v_cache, rows, lens, write_start,
                                    new_mask, scale);
  at::Tensor out = hidden.contiguous().clone();
  at::Tensor h = add_rms_norm(out, attn, w.post_norm, w.eps);                 // out = hidden + attention
  out.add_(mlp_block(h, w));
  return out;
}

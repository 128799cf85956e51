// Whole decoder layers of a decode, verify or draft step, composed from the kernels of cpu_ops.cpp and
// amx_linear.cpp in one call each (no Python between them), in the same order as the layer-by-layer paths
// (target.py, draft.py), so both give bit-identical results.
#include <torch/extension.h>

#include "ops.h"

// One decoder layer of a decode or verify step, the same kernels as the step-by-step path in one call (no Python
// between them). x [B, T, H] is the residual stream, updated in place:
//   x += delta (when given); captured = a copy of x (when asked, an auxiliary feature); h = RMSNorm(x)
//   x += o_proj(attention(qkv_proj(h)))  (rotary embedding, KV store and tree mask as qkv_attention)
//   returns [down(silu(gate) * up)(RMSNorm(x)), captured?]: the next layer's delta.
std::vector<at::Tensor> layer_step(at::Tensor x, const c10::optional<at::Tensor>& delta, bool capture,
                                   const at::Tensor& in_norm, const at::Tensor& post_norm, double eps,
                                   const at::Tensor& w_qkv, int64_t n_qkv, const c10::optional<at::Tensor>& b_qkv,
                                   const at::Tensor& w_o, const c10::optional<at::Tensor>& b_o,
                                   const at::Tensor& w_gate_up, int64_t n_gate_up, const at::Tensor& w_down,
                                   const at::Tensor& cos, const at::Tensor& sin, int64_t nH, int64_t nKV,
                                   at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& rows,
                                   const at::Tensor& lens, const at::Tensor& write_start, const at::Tensor& new_mask,
                                   double scale) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "layer_step: x [B, T, H] bf16");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), M = B * T;
  at::Tensor h = delta && delta->defined() ? add_rms_norm(x, *delta, in_norm, eps) : rms_norm(x, in_norm, eps);
  std::vector<at::Tensor> out;
  at::Tensor captured = capture ? x.clone() : at::Tensor();
  at::Tensor qkv = linear_bf16(h.view({M, H}), w_qkv, n_qkv, b_qkv).view({B, T, n_qkv});
  at::Tensor o = qkv_attention(qkv, cos, sin, nH, nKV, k_cache, v_cache, rows, lens, write_start, new_mask, scale);
  at::Tensor attn = linear_bf16(o.view({M, o.size(2)}), w_o, H, b_o).view({B, T, H});
  h = add_rms_norm(x, attn, post_norm, eps);
  at::Tensor act = silu_and_mul(linear_bf16(h.view({M, H}), w_gate_up, n_gate_up, c10::nullopt));
  out.push_back(linear_bf16(act, w_down, H, c10::nullopt).view({B, T, H}));
  if (capture) out.push_back(captured);
  return out;
}

// The EAGLE-3 draft's decoder layer (draft.py's Eagle3DecoderLayer with its fused weights) over the draft's KV pool:
//   x = cat(RMSNorm_e(embeds), RMSNorm_h(hidden))                         [B, T, 2H]
//   out = hidden + o_proj(attention(qkv_proj(x)))   (rotary, KV store and tree mask as qkv_attention)
//   out += down(silu(gate) * up)(RMSNorm_post(out))
// returns out [B, T, H] (the pre-norm output; logits and the next step's input are the caller's).
at::Tensor draft_layer(const at::Tensor& embeds, const at::Tensor& hidden, const at::Tensor& embed_norm,
                       const at::Tensor& hidden_norm, const at::Tensor& post_norm, double eps,
                       const at::Tensor& w_qkv, int64_t n_qkv, const at::Tensor& w_o, const at::Tensor& w_gate_up,
                       int64_t n_gate_up, const at::Tensor& w_down, const at::Tensor& cos, const at::Tensor& sin,
                       int64_t nH, int64_t nKV, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& rows,
                       const at::Tensor& lens, const at::Tensor& write_start, const at::Tensor& new_mask, double scale) {
  TORCH_CHECK(embeds.dim() == 3 && hidden.sizes() == embeds.sizes() && embeds.scalar_type() == at::kBFloat16 &&
              hidden.scalar_type() == at::kBFloat16, "draft_layer: embeds and hidden [B, T, H] bf16");
  const int64_t B = embeds.size(0), T = embeds.size(1), H = embeds.size(2), M = B * T;
  at::Tensor x = at::cat({rms_norm(embeds.contiguous(), embed_norm, eps), rms_norm(hidden.contiguous(), hidden_norm, eps)}, -1);
  at::Tensor qkv = linear_bf16(x.view({M, 2 * H}), w_qkv, n_qkv, c10::nullopt).view({B, T, n_qkv});
  at::Tensor o = qkv_attention(qkv, cos, sin, nH, nKV, k_cache, v_cache, rows, lens, write_start, new_mask, scale);
  at::Tensor out = hidden.contiguous().clone();
  at::Tensor h = add_rms_norm(out, linear_bf16(o.view({M, o.size(2)}), w_o, H, c10::nullopt).view({B, T, H}),
                              post_norm, eps);                                  // out = hidden + attention
  at::Tensor act = silu_and_mul(linear_bf16(h.view({M, H}), w_gate_up, n_gate_up, c10::nullopt));
  out.add_(linear_bf16(act, w_down, H, c10::nullopt).view({B, T, H}));
  return out;
}

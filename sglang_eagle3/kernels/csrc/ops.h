// Declarations shared by the extension's sources, which bindings.cpp binds for Python.
// Decode: attention.cpp (tree attention over the KV pool), elementwise.cpp (norms, SiLU), linear.cpp and
// linear_avx512f.cpp (few-row bf16 products), amx_linear.cpp (AMX tile products), layers.cpp (whole decoder layers
// over a LayerWeights), tree_ops.cpp (draft tree selection, acceptance). Training: train_ops.cpp (TTT's soft
// cross-entropy, the target's distribution).
#pragma once
#include <torch/extension.h>

// ---- decode --------------------------------------------------------------------------------------------------
// attention.cpp
at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor k_cache,
                          at::Tensor v_cache, const at::Tensor& rows, const at::Tensor& lens,
                          const at::Tensor& write_start, const at::Tensor& new_mask, double scale);
at::Tensor qkv_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t nH, int64_t nKV,
                         at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& rows, const at::Tensor& lens,
                         const at::Tensor& write_start, const at::Tensor& new_mask, double scale,
                         const c10::optional<at::Tensor>& row_tokens);

// elementwise.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& residual, const at::Tensor& w, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// linear.cpp
std::string few_row_isa();                           // the default: "avx512_bf16", "avx512f", "avx2" or "" (none)
std::vector<std::string> few_row_kernels();          // every few-row kernel of this build, the fastest first
at::Tensor pack_bf16(const at::Tensor& w, const std::string& kernel);   // kernel "" : few_row_isa()
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias);

// linear_avx512f.cpp (AVX-512F builds; called by linear_bf16): y [M, N] = xf [M, Kx] fp32 @ W^T (+ bias), W packed
// as int32 [NG, KP, 2, 16]
void linear_widen16(const float* xf, int64_t M, int64_t Kx, const int32_t* P, int64_t NG, int64_t KP,
                    const float* bias, at::BFloat16* y, int64_t N);

// amx_linear.cpp
bool amx_usable();                                   // built with AMX and the OS grants tile data
at::Tensor pack_amx(const at::Tensor& w);            // [N, K] bf16 -> [N/64, K/32, 4, 16, 16, 2]
bool is_amx_packed(const at::Tensor& packed);
at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias);

// layers.cpp
// One decoder layer's weights as layer_step (the target's layers) and draft_layer (the EAGLE-3 draft's) read them,
// built once per layer when a model is prepared (kernels/decode.py layer_weights) and passed whole to every step.
struct LayerWeights {
  at::Tensor input_norm, post_norm;           // [H] bf16 RMSNorm weights (the draft's input_norm: its embeddings')
  c10::optional<at::Tensor> hidden_norm;      // [H] bf16: the draft's RMSNorm of the fed hidden state; none: target
  double eps;                                 // the norms' epsilon
  at::Tensor wqkv, wo, w_gate_up, w_down;     // packed for linear_bf16 (pack_bf16 / pack_amx)
  c10::optional<at::Tensor> wqkv_bias, wo_bias;   // fp32 [N]; none: no bias
  int64_t qkv_features, gate_up_features;     // out features of wqkv ((nH + 2 nKV) * D) and w_gate_up (2 I)
  int64_t num_heads, num_kv_heads;
};
LayerWeights make_layer_weights(at::Tensor input_norm, at::Tensor post_norm, double eps, at::Tensor wqkv,
                                at::Tensor wo, at::Tensor w_gate_up, at::Tensor w_down, int64_t qkv_features,
                                int64_t gate_up_features, int64_t num_heads, int64_t num_kv_heads,
                                c10::optional<at::Tensor> hidden_norm, c10::optional<at::Tensor> wqkv_bias,
                                c10::optional<at::Tensor> wo_bias);
std::vector<at::Tensor> layer_step(at::Tensor x, const c10::optional<at::Tensor>& delta, bool capture,
                                   const LayerWeights& w, const at::Tensor& cos, const at::Tensor& sin,
                                   at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& rows,
                                   const at::Tensor& lens, const at::Tensor& write_start, const at::Tensor& new_mask,
                                   double scale, const c10::optional<at::Tensor>& packed,
                                   const c10::optional<at::Tensor>& row_tokens);
at::Tensor draft_layer(const at::Tensor& embeds, const at::Tensor& hidden, const LayerWeights& w,
                       const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                       const at::Tensor& rows, const at::Tensor& lens, const at::Tensor& write_start,
                       const at::Tensor& new_mask, double scale);

// tree_ops.cpp
std::vector<at::Tensor> topk_logprobs(const at::Tensor& logits, int64_t k);
std::vector<at::Tensor> build_tree(const at::Tensor& cand_tokens, const at::Tensor& cand_scores,
                                   const at::Tensor& cand_parents, const at::Tensor& root_tokens,
                                   const at::Tensor& root_positions, int64_t num_draft_tokens,
                                   const c10::optional<at::Tensor>& row_nodes);
std::vector<at::Tensor> accept_greedy(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& logits);
std::vector<at::Tensor> accept_sampling(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& logits,
                                        double temperature, int64_t top_k, double top_p, const at::Tensor& uniforms);
std::vector<at::Tensor> accept_sampled_tree(const at::Tensor& tokens, const at::Tensor& parents,
                                            const at::Tensor& drawn_from, const at::Tensor& logits, double temperature,
                                            int64_t top_k, double top_p, const at::Tensor& draft_q,
                                            const at::Tensor& draft_targets, const at::Tensor& uniforms);
std::vector<at::Tensor> draft_children(const at::Tensor& logits, double temperature, int64_t top_k, double top_p,
                                       int64_t k, const at::Tensor& excluded, const at::Tensor& uniforms);

// ---- training ------------------------------------------------------------------------------------------------
// train_ops.cpp
std::vector<at::Tensor> soft_ce_forward(const at::Tensor& z, const at::Tensor& p, const at::Tensor& rows);
at::Tensor soft_ce_backward(const at::Tensor& z, const at::Tensor& p, const at::Tensor& rows, const at::Tensor& lse,
                            const at::Tensor& grad);
std::vector<at::Tensor> target_distribution(const at::Tensor& logits, const at::Tensor& draft_ids);

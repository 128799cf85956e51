// The extension's Python module: every op the package calls, bound in one place. Python reaches them only
// through kernels/decode.py and kernels/training.py, which hold their PyTorch twins.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // decode: linears
  m.def("pack_bf16", &pack_bf16, "pack a bf16 [N, K] weight for linear_bf16's few-row kernel (default: few_row_isa)",
        pybind11::arg("w"), pybind11::arg("kernel") = "");
  m.def("linear_bf16", &linear_bf16, "few-row bf16 matrix product against a packed weight (the kernel it was packed for)");
  m.def("few_row_isa", &few_row_isa, "the build's default few-row kernel (avx512_bf16, avx512f, avx2 or none)");
  m.def("few_row_kernels", &few_row_kernels, "every few-row kernel of this build, the fastest first");
  m.def("pack_amx", &pack_amx, "pack a bf16 [N, K] weight for the AMX tile kernel (linear_bf16 dispatches on it)");
  m.def("amx_usable", &amx_usable, "built with AMX and the OS grants tile data");
  // decode: layers, attention, element-wise
  m.def("layer_step", &layer_step, "one decoder layer of a decode/verify step (bf16, packed weights)");
  m.def("draft_layer", &draft_layer, "the EAGLE-3 draft's decoder layer over its KV pool (bf16, packed weights)");
  m.def("tree_attention", &tree_attention, "attention over a row-indexed KV pool with a tree mask (writes k/v)");
  m.def("qkv_attention", &qkv_attention, "rotary embedding + tree_attention from the fused qkv projection");
  m.def("rms_norm", &rms_norm, "RMSNorm (transformers' rounding)");
  m.def("add_rms_norm", &add_rms_norm, "x += residual in place; returns RMSNorm(x)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  // decode: draft trees and acceptance
  m.def("topk_logprobs", &topk_logprobs, "the k largest log-probabilities of each row and their indices");
  m.def("build_tree", &build_tree, "draft tree selection and layout (tree.build_draft_tree)");
  m.def("accept_greedy", &accept_greedy, "greedy acceptance of a tree from the target's logits");
  m.def("accept_sampling", &accept_sampling, "tree speculative sampling of one row from the target's logits");
  // training
  m.def("soft_ce_forward", &soft_ce_forward, "soft cross-entropy over rows of p (-> loss, logsumexp)");
  m.def("soft_ce_backward", &soft_ce_backward, "(softmax(z) - p[rows]) * grad");
  m.def("target_distribution", &target_distribution, "argmax over V and softmax at the draft's ids (fp32)");
}

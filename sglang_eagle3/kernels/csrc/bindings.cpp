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
  namespace py = pybind11;
  py::class_<LayerWeights>(m, "LayerWeights", "one decoder layer's norms, packed weights, biases and sizes")
      .def(py::init(&make_layer_weights), py::kw_only(), py::arg("input_norm"), py::arg("post_norm"), py::arg("eps"),
           py::arg("wqkv"), py::arg("wo"), py::arg("w_gate_up"), py::arg("w_down"), py::arg("qkv_features"),
           py::arg("gate_up_features"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("hidden_norm") = py::none(), py::arg("wqkv_bias") = py::none(), py::arg("wo_bias") = py::none())
      .def_readonly("input_norm", &LayerWeights::input_norm)
      .def_readonly("post_norm", &LayerWeights::post_norm)
      .def_readonly("hidden_norm", &LayerWeights::hidden_norm)
      .def_readonly("eps", &LayerWeights::eps)
      .def_readonly("wqkv", &LayerWeights::wqkv)
      .def_readonly("wo", &LayerWeights::wo)
      .def_readonly("w_gate_up", &LayerWeights::w_gate_up)
      .def_readonly("w_down", &LayerWeights::w_down)
      .def_readonly("wqkv_bias", &LayerWeights::wqkv_bias)
      .def_readonly("wo_bias", &LayerWeights::wo_bias)
      .def_readonly("qkv_features", &LayerWeights::qkv_features)
      .def_readonly("gate_up_features", &LayerWeights::gate_up_features)
      .def_readonly("num_heads", &LayerWeights::num_heads)
      .def_readonly("num_kv_heads", &LayerWeights::num_kv_heads);
  m.def("layer_step", &layer_step, "one decoder layer of a decode/verify step (bf16, a LayerWeights)");
  m.def("draft_layer", &draft_layer, "the EAGLE-3 draft's decoder layer over its KV pool (bf16, a LayerWeights)");
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
  m.def("accept_sampled_tree", &accept_sampled_tree,
        "recursive rejection sampling of one row's tree with sampled children, from the target's logits");
  m.def("draft_children", &draft_children, "a sampling row's draft children: q, scores by rank, draws without replacement");
  // training
  m.def("soft_ce_forward", &soft_ce_forward, "soft cross-entropy over rows of p (-> loss, logsumexp)");
  m.def("soft_ce_backward", &soft_ce_backward, "(softmax(z) - p[rows]) * grad");
  m.def("target_distribution", &target_distribution, "argmax over V and softmax at the draft's ids (fp32)");
}

// The few-row bf16 linear kernels shared by cpu_ops.cpp (layer_step, linear_bf16) and amx_linear.cpp.
#pragma once
#include <torch/extension.h>

bool amx_usable();                                   // built with AMX and the OS grants tile data
at::Tensor pack_amx(const at::Tensor& w);            // [N, K] bf16 -> [N/64, K/32, 4, 16, 16, 2]
bool is_amx_packed(const at::Tensor& packed);
at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias);

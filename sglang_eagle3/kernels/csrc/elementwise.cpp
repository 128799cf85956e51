// The small fused element-wise ops around the decode step's matmuls: RMSNorm (transformers' rounding),
// residual add + RMSNorm, SiLU * up.
//
// Built by sglang_eagle3/kernels/extension.py; the Python wrappers and their PyTorch twins are in
// kernels/decode.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"

using namespace e3;

namespace {
#ifdef E3_AVX512
// v rounded to the storage dtype's precision (kept in fp32 lanes): bf16 round-to-nearest-even, float as is
inline __m512 round_to(__m512 v, const float*) { return v; }
inline __m512 round_to(__m512 v, const at::BFloat16*) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                               _mm512_set1_epi32((int)0xffff0000));
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v);
}
#endif

// out = w * to_dtype(x * rsqrt(mean(x^2) + eps)), as transformers' LlamaRMSNorm; optionally x += residual first
template <typename E>
void rms_norm_impl(at::Tensor& x, const at::Tensor* residual, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t H = x.size(-1), N = x.numel() / H;
  E* xp = x.data_ptr<E>();
  const E* rp = residual ? residual->data_ptr<E>() : nullptr;
  const E* wp = w.data_ptr<E>();
  E* op = out.data_ptr<E>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(H);
    for (int64_t i = begin; i < end; ++i) {
      E* row = xp + i * H;
      E* orow = op + i * H;
#ifdef E3_AVX512
      if (H % 16 == 0) {
        __m512 ss = _mm512_setzero_ps();
        for (int64_t j = 0; j < H; j += 16) {
          __m512 v = load16(row + j);
          if (rp) {
            v = round_to(_mm512_add_ps(v, load16(rp + i * H + j)), row);   // the residual stays in the storage dtype
            store16(row + j, v);
          }
          _mm512_storeu_ps(xf.data() + j, v);
          ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(H) +
                                                         static_cast<float>(eps)));
        for (int64_t j = 0; j < H; j += 16) {
          __m512 n = round_to(_mm512_mul_ps(_mm512_loadu_ps(xf.data() + j), r), row);
          store16(orow + j, _mm512_mul_ps(load16(wp + j), n));
        }
        continue;
      }
#endif
      float ss = 0.f;
      for (int64_t j = 0; j < H; ++j) {
        float v = to_f(row[j]);
        if (rp) {
          v = to_f(from_f<E>(v + to_f(rp[i * H + j])));
          row[j] = from_f<E>(v);
        }
        xf[j] = v;
        ss += v * v;
      }
      const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      for (int64_t j = 0; j < H; ++j) orow[j] = from_f<E>(to_f(wp[j]) * to_f(from_f<E>(xf[j] * r)));
    }
  });
}
}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.scalar_type() == w.scalar_type() && x.size(-1) == w.numel(),
              "rms_norm: contiguous x [.., H] and w [H] of one dtype");
  at::Tensor out = at::empty_like(x), xx = x;
  E3_DISPATCH(x.scalar_type(), "rms_norm",
                                  [&] { rms_norm_impl<scalar_t>(xx, nullptr, w, eps, out); });
  return out;
}

// x += residual (in place), returns rms_norm(x)
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& residual, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && w.is_contiguous() && x.sizes() == residual.sizes() &&
              x.scalar_type() == residual.scalar_type() && x.scalar_type() == w.scalar_type() && x.size(-1) == w.numel(),
              "add_rms_norm: contiguous x, residual [.., H] and w [H] of one dtype");
  at::Tensor out = at::empty_like(x);
  E3_DISPATCH(x.scalar_type(), "add_rms_norm",
                                  [&] { rms_norm_impl<scalar_t>(x, &residual, w, eps, out); });
  return out;
}

// gate_up [.., 2I] -> silu(gate) * up [.., I]
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "silu_and_mul: contiguous [.., 2I]");
  const int64_t I = gate_up.size(-1) / 2, N = gate_up.numel() / (2 * I);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  at::Tensor out = at::empty(sizes, gate_up.options());
  E3_DISPATCH(gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* g_row = gp + i * 2 * I;
        const scalar_t* u_row = g_row + I;
        scalar_t* o_row = op + i * I;
        int64_t j = 0;
#ifdef E3_AVX512
        // as torch: silu rounded to the storage dtype, then the product rounded again
        for (; j + 16 <= I; j += 16) {
          const __m512 g = load16(g_row + j);
          const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
          const __m512 s = round_to(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), o_row);
          store16(o_row + j, _mm512_mul_ps(s, load16(u_row + j)));
        }
#endif
        for (; j < I; ++j) {
          const float g = to_f(g_row[j]);
          const float s = to_f(from_f<scalar_t>(g / (1.f + std::exp(-g))));
          o_row[j] = from_f<scalar_t>(s * to_f(u_row[j]));
        }
      }
    });
  });
  return out;
}

// Training kernels: the soft cross-entropy of TTT's per-step loss (forward and gradient) and the target's
// distribution over the draft vocabulary.
//
// Built by sglang_eagle3/kernels/extension.py; the Python wrappers and their PyTorch twins are in
// kernels/training.py.
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

// ---- training: soft cross-entropy over the draft vocabulary (TTT's per-step loss) --------------------------
//
// loss[i] = logsumexp(z[i]) - <p[rows[i]], z[i]>    (p rows are softmaxes: they sum to 1)
// grad_z[i] = (softmax(z[i]) - p[rows[i]]) * grad[i], rounded to z's dtype
// z [S, V] logits (float or bf16), p [N, V] fp32 target distributions read through rows [S] (no gathered copy),
// fp32 arithmetic. One row of z (V = 8192 bf16: 16 KB) stays in L1/L2 between the max pass and the exp pass.
namespace {
template <typename E>
void soft_ce_forward_impl(const E* z, const float* p, const int64_t* rows, int64_t S, int64_t V, float* loss,
                          float* lse) {
  at::parallel_for(0, S, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const E* zi = z + i * V;
      const float* pi = p + rows[i] * V;
      const float mx = row_max(zi, V);
      float sum = 0.f, dot = 0.f;
      int64_t j = 0;
#ifdef E3_AVX512
      __m512 vs = _mm512_setzero_ps(), vd = _mm512_setzero_ps();
      const __m512 vm = _mm512_set1_ps(mx);
      for (; j + 16 <= V; j += 16) {
        const __m512 v = load16(zi + j);
        vs = _mm512_add_ps(vs, exp16(_mm512_sub_ps(v, vm)));
        vd = _mm512_fmadd_ps(_mm512_loadu_ps(pi + j), v, vd);
      }
      sum = _mm512_reduce_add_ps(vs);
      dot = _mm512_reduce_add_ps(vd);
#endif
      for (; j < V; ++j) {
        const float v = to_f(zi[j]);
        sum += std::exp(v - mx);
        dot += pi[j] * v;
      }
      lse[i] = mx + std::log(sum);
      loss[i] = lse[i] - dot;
    }
  });
}

template <typename E>
void soft_ce_backward_impl(const E* z, const float* p, const int64_t* rows, const float* lse, const float* grad,
                           int64_t S, int64_t V, E* out) {
  at::parallel_for(0, S, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const E* zi = z + i * V;
      const float* pi = p + rows[i] * V;
      E* oi = out + i * V;
      const float g = grad[i], l = lse[i];
      int64_t j = 0;
#ifdef E3_AVX512
      const __m512 vg = _mm512_set1_ps(g), vl = _mm512_set1_ps(l);
      for (; j + 16 <= V; j += 16) {
        const __m512 e = exp16(_mm512_sub_ps(load16(zi + j), vl));
        store16(oi + j, _mm512_mul_ps(_mm512_sub_ps(e, _mm512_loadu_ps(pi + j)), vg));
      }
#endif
      for (; j < V; ++j) oi[j] = from_f<E>((std::exp(to_f(zi[j]) - l) - pi[j]) * g);
    }
  });
}

void check_soft_ce(const at::Tensor& z, const at::Tensor& p, const at::Tensor& rows) {
  TORCH_CHECK(z.dim() == 2 && p.dim() == 2 && z.size(1) == p.size(1) && z.is_contiguous() && p.is_contiguous() &&
                  p.scalar_type() == at::kFloat,
              "soft_ce: contiguous z [S, V] and fp32 p [N, V]");
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == z.size(0) && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "soft_ce: rows [S] int64");
  if (rows.numel() > 0) {
    const int64_t lo = rows.min().item<int64_t>(), hi = rows.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < p.size(0), "soft_ce: rows out of range of p");
  }
}
}  // namespace

// -> (loss [S], lse [S]) fp32
std::vector<at::Tensor> soft_ce_forward(const at::Tensor& z, const at::Tensor& p, const at::Tensor& rows) {
  check_soft_ce(z, p, rows);
  const int64_t S = z.size(0), V = z.size(1);
  at::Tensor loss = at::empty({S}, z.options().dtype(at::kFloat)), lse = at::empty_like(loss);
  E3_DISPATCH(z.scalar_type(), "soft_ce_forward", [&] {
    soft_ce_forward_impl<scalar_t>(z.data_ptr<scalar_t>(), p.data_ptr<float>(), rows.data_ptr<int64_t>(), S, V,
                                   loss.data_ptr<float>(), lse.data_ptr<float>());
  });
  return {loss, lse};
}

// -> grad_z [S, V] in z's dtype
at::Tensor soft_ce_backward(const at::Tensor& z, const at::Tensor& p, const at::Tensor& rows, const at::Tensor& lse,
                            const at::Tensor& grad) {
  check_soft_ce(z, p, rows);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && grad.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  grad.is_contiguous() && lse.numel() == z.size(0) && grad.numel() == z.size(0),
              "soft_ce_backward: fp32 lse [S] and grad [S]");
  at::Tensor out = at::empty_like(z);
  E3_DISPATCH(z.scalar_type(), "soft_ce_backward", [&] {
    soft_ce_backward_impl<scalar_t>(z.data_ptr<scalar_t>(), p.data_ptr<float>(), rows.data_ptr<int64_t>(),
                                    lse.data_ptr<float>(), grad.data_ptr<float>(), z.size(0), z.size(1),
                                    out.data_ptr<scalar_t>());
  });
  return out;
}

// Target side of the same loss, once per row: the target's full-vocabulary logits [N, V] -> its argmax over all
// V (first maximum, as torch) and p [N, Vd] = softmax of the logits at the draft's target ids (fp32), without the
// gathered [N, Vd] copy, its fp32 cast and a separate softmax pass over memory.
namespace {
template <typename E>
void target_distribution_impl(const E* logits, const int64_t* draft_ids, int64_t N, int64_t V, int64_t Vd, float* p,
                              int64_t* top) {
  at::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const E* zi = logits + i * V;
      const int64_t arg = argmax_row(zi, V);
      top[i] = arg;
      float* pi = p + i * Vd;
      for (int64_t k = 0; k < Vd; ++k) pi[k] = to_f(zi[draft_ids[k]]);
      const float sum = softmax_unnormalised(pi, Vd);
      const float inv = 1.f / sum;
      for (int64_t k = 0; k < Vd; ++k) pi[k] *= inv;
    }
  });
}

}  // namespace

// logits [N, V] (float or bf16), draft_ids [Vd] int64 -> (p [N, Vd] fp32, top [N] int64)
std::vector<at::Tensor> target_distribution(const at::Tensor& logits, const at::Tensor& draft_ids) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "target_distribution: contiguous logits [N, V]");
  TORCH_CHECK(draft_ids.dim() == 1 && draft_ids.scalar_type() == at::kLong && draft_ids.is_contiguous(),
              "target_distribution: draft_ids [Vd] int64");
  const int64_t N = logits.size(0), V = logits.size(1), Vd = draft_ids.size(0);
  if (Vd > 0) {
    TORCH_CHECK(draft_ids.min().item<int64_t>() >= 0 && draft_ids.max().item<int64_t>() < V,
                "target_distribution: draft_ids out of range of the logits");
  }
  at::Tensor p = at::empty({N, Vd}, logits.options().dtype(at::kFloat));
  at::Tensor top = at::empty({N}, logits.options().dtype(at::kLong));
  E3_DISPATCH(logits.scalar_type(), "target_distribution", [&] {
    target_distribution_impl<scalar_t>(logits.data_ptr<scalar_t>(), draft_ids.data_ptr<int64_t>(), N, V, Vd,
                                       p.data_ptr<float>(), top.data_ptr<int64_t>());
  });
  return {p, top};
}

// CPU kernels for the decode step: attention over a row-indexed KV pool with a tree mask, and the
// small fused element-wise ops around the matmuls (RMSNorm, residual add + RMSNorm, SiLU * up); and two for
// training: the soft cross-entropy of TTT's per-step loss (forward and gradient) and the target's distribution.
//
// Built at install time (or on first use) by sglang_eagle3/kernels.py with torch.utils.cpp_extension.
// Every op has a plain-PyTorch twin in kernels.py; tests check that both agree.
//
// Layouts (one layer of the pool):
//   k_cache, v_cache  [R, n_kv, S, D]   R rows (requests), committed slots 0..lens[b]-1 of row rows[b]
//   q                 [B, n_h, T, D]    T new tokens per row (decode: 1, verify: tree size)
//   k_new, v_new      [B, n_kv, T, D]   written to slots write_start[b] + t of row rows[b]
//   new_mask          [B, T, F] bool    query t sees uncommitted slot lens[b] + f iff new_mask[b, t, f]
//   out               [B, n_h, T, D]
// Scores, softmax and the weighted sum are computed in fp32 whatever the storage dtype (bf16 scores by AVX-512 BF16
// dot products where the CPU has them: bf16 x bf16 products are exact in fp32, summed in fp32).
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

namespace {

using namespace e3;

// dot(q, k) over D, q already in fp32
template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
#ifdef E3_AVX512
  if (D % 16 == 0 && D > 0) {           // dot16's sums for one key: a score is the same in a block of 16 or alone
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), load16(k));
    for (int64_t d = 16; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
    return hsum16_one(acc);
  }
#elif defined(E3_AVX2)
  if (D % 8 == 0) {                      // dot8's sums for one key: a score is the same in a block of 8 or alone
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a);
    return hsum8_pairs(a);
  }
#endif
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += q[d] * to_f(k[d]);
  return s;
}

#ifdef E3_AVX512
// lane i of the result = sum of the 16 lanes of a[i] (a 16 x 16 transpose-add: ~3 instructions per sum)
inline __m512 hsum16(const __m512* a) {
  __m512 t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
}

// scores[0:16] = q . k[s] for 16 consecutive keys (D a multiple of 16, at most 256)
template <typename T>
inline void dot16(const float* q, const T* k, int64_t D, float* out) {
  __m512 acc[16];
  const int64_t nd = D / 16;
  __m512 qv[16];
  for (int64_t c = 0; c < nd; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int i = 0; i < 16; ++i) {
    __m512 a = _mm512_mul_ps(qv[0], load16(k + i * D));
    for (int64_t c = 1; c < nd; ++c) a = _mm512_fmadd_ps(qv[c], load16(k + i * D + 16 * c), a);
    acc[i] = a;
  }
  _mm512_storeu_ps(out, hsum16(acc));
}

// dot16 for a head size of 16 * ND known at compile time (queries and keys stay in registers)
template <int ND, typename T>
inline void dot16_fixed(const float* q, const T* k, float* out) {
  __m512 acc[16], qv[ND];
#pragma GCC unroll 16
  for (int c = 0; c < ND; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    __m512 a = _mm512_mul_ps(qv[0], load16(k + i * 16 * ND));
#pragma GCC unroll 16
    for (int c = 1; c < ND; ++c) a = _mm512_fmadd_ps(qv[c], load16(k + i * 16 * ND + 16 * c), a);
    acc[i] = a;
  }
  _mm512_storeu_ps(out, hsum16(acc));
}

#ifdef E3_BF16DOT
// bf16 keys against a bf16 query (NP vectors of 32 values: D = 32 NP): each product of two bf16 values is exact
// in fp32 and _mm512_dpbf16_ps adds pairs of them into fp32 lanes, so a score is the fp32 dot product up to the
// order of its sums, at half the instructions of converting the keys and using fp32 FMAs.
template <int NP>
inline float dot_bf16(const __m512bh* qv, const at::BFloat16* k) {
  __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int c = 0; c < NP; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
  return hsum16_one(a);                 // as dot16_bf16 sums a key's lanes
}

// scores[0:16] = q . k[s] for 16 consecutive bf16 keys (D = 32 NP)
template <int NP>
inline void dot16_bf16(const __m512bh* qv, const at::BFloat16* k, float* out) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < NP; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(k + i * 32 * NP + 32 * c));
    acc[i] = a;
  }
  _mm512_storeu_ps(out, hsum16(acc));
}

// scores of nq queries (bf16, row i at q + i * D) against committed keys 0..L-1, then the F uncommitted slots the
// mask allows (-inf others), times scale: s + i * ld. Key blocks outermost: a block stays in L1 for every query.
template <int NP>
inline void scores_bf16(const at::BFloat16* q, int64_t nq, const at::BFloat16* K, int64_t L, int64_t F,
                        const bool* const* masks, float scale, float* s, int64_t ld) {
  constexpr int64_t D = 32 * NP;
  auto qvec = [&](int64_t i, __m512bh* qv) {
    for (int c = 0; c < NP; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + i * D + 32 * c);
  };
  __m512bh qv[NP];
  int64_t j = 0;
  for (; j + 16 <= L; j += 16)
    for (int64_t i = 0; i < nq; ++i) {
      qvec(i, qv);
      dot16_bf16<NP>(qv, K + j * D, s + i * ld + j);
    }
  const __m512 vs = _mm512_set1_ps(scale);
  const int64_t n = L + F;
  for (int64_t i = 0; i < nq; ++i) {
    qvec(i, qv);
    float* si = s + i * ld;
    for (int64_t r = j; r < L; ++r) si[r] = dot_bf16<NP>(qv, K + r * D);
    for (int64_t f = 0; f < F; ++f)
      si[L + f] = masks[i][f] ? dot_bf16<NP>(qv, K + (L + f) * D) : -std::numeric_limits<float>::infinity();
    int64_t r = 0;
    for (; r + 16 <= n; r += 16) _mm512_storeu_ps(si + r, _mm512_mul_ps(_mm512_loadu_ps(si + r), vs));
    for (; r < n; ++r) si[r] *= scale;
  }
}
#endif

// out[q][0:16 ND] = sum over s < n of p[q * ld + s] * V[s] for QB queries at once: each value row is loaded
// (and converted) once for the block, the accumulators stay in registers; sums in the order of s, as axpy's.
template <int ND, int QB, typename T>
inline void weighted_sum_block(const float* p, int64_t ld, const T* V, int64_t n, float* out) {
  __m512 acc[QB][ND];
#pragma GCC unroll 16
  for (int q = 0; q < QB; ++q)
#pragma GCC unroll 16
    for (int c = 0; c < ND; ++c) acc[q][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < n; ++s) {
    __m512 v[ND];
#pragma GCC unroll 16
    for (int c = 0; c < ND; ++c) v[c] = load16(V + s * 16 * ND + 16 * c);
#pragma GCC unroll 16
    for (int q = 0; q < QB; ++q) {
      const __m512 pq = _mm512_set1_ps(p[q * ld + s]);
#pragma GCC unroll 16
      for (int c = 0; c < ND; ++c) acc[q][c] = _mm512_fmadd_ps(pq, v[c], acc[q][c]);
    }
  }
#pragma GCC unroll 16
  for (int q = 0; q < QB; ++q)
#pragma GCC unroll 16
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(out + q * 16 * ND + 16 * c, acc[q][c]);
}
#endif

#if defined(E3_AVX2) && !defined(E3_AVX512)
// out[0:8] = q . k[j] for 8 consecutive keys k + j * D (D a multiple of 8; fp32, or bf16 widened on the fly): per
// key one 8-lane FMA chain in the order of d, its lanes summed as hsum8_pairs sums them (dot's order: a key's
// score does not depend on whether it is scored in a block or alone); 8 independent chains fill both FMA pipes.
template <typename T>
inline void dot8(const float* q, const T* k, int64_t D, float* out) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(k + j * D + d), acc[j]);
  }
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31)));
}

// out[q][0:D] = sum over s < n of p[q * ld + s] * V[s] for QB queries (D a multiple of 32): 32 values at a time,
// the accumulators in registers, each value row converted once for the QB queries; per value the sums run in the
// order of s with one FMA each, as axpy's.
template <int QB, typename T>
inline void weighted_sum8(const float* p, int64_t ld, const T* V, int64_t D, int64_t n, float* out) {
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    __m256 acc[QB][4];
#pragma GCC unroll 4
    for (int q = 0; q < QB; ++q)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[q][c] = _mm256_setzero_ps();
    for (int64_t s = 0; s < n; ++s) {
      __m256 v[4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) v[c] = load8(V + s * D + d0 + 8 * c);
#pragma GCC unroll 4
      for (int q = 0; q < QB; ++q) {
        const __m256 pq = _mm256_set1_ps(p[q * ld + s]);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) acc[q][c] = _mm256_fmadd_ps(pq, v[c], acc[q][c]);
      }
    }
#pragma GCC unroll 4
    for (int q = 0; q < QB; ++q)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + q * D + d0 + 8 * c, acc[q][c]);
  }
}
#endif

// acc[0:D] += p * v[0:D]
template <typename T>
inline void axpy(float* acc, float p, const T* v, int64_t D) {
#ifdef E3_AVX512
  if (D % 16 == 0) {
    __m512 pv = _mm512_set1_ps(p);
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, load16(v + d), _mm512_loadu_ps(acc + d)));
    return;
  }
#elif defined(E3_AVX2)
  if (D % 8 == 0) {                      // one FMA per value, as weighted_sum8
    const __m256 pv = _mm256_set1_ps(p);
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, load8(v + d), _mm256_loadu_ps(acc + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) acc[d] += p * to_f(v[d]);
}

// scores[0:n] = exp(scores - max) in place; returns the sum (entries at -inf become 0). Entries [0, dense) are
// known finite (an attention row's committed slots; default: all of them).
inline float softmax_unnormalised(float* s, int64_t n, int64_t dense = -1) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#ifdef E3_AVX512
  // The maximum, a vector at a time (a scalar loop is one dependent compare per entry, ~4 cycles: it was a fifth
  // of an 8-token verify's attention on a Xeon with AMX). max_ps(x, m) is x > m ? x : m per lane, the scalar rule
  // below, and a maximum does not depend on the order it is taken in: the same value.
  if (n >= 16) {
    __m512 vm = _mm512_set1_ps(mx);
    for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(_mm512_loadu_ps(s + i), vm);
    mx = _mm512_reduce_max_ps(vm);
  }
#elif defined(E3_AVX2)
  if (n >= 8) {
    __m256 vm = _mm256_set1_ps(mx);
    for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(_mm256_loadu_ps(s + i), vm);
    alignas(32) float lanes8[8];
    _mm256_store_ps(lanes8, vm);
    for (float v : lanes8) mx = v > mx ? v : mx;
  }
#endif
  for (; i < n; ++i) mx = s[i] > mx ? s[i] : mx;
  float sum = 0.f;
  i = 0;
  // Lane = the entry's index among the unmasked ones, mod the vector width (masked entries are -inf, exactly 0
  // after exp): a tree node's query sums the committed slots, its ancestors and itself in the lanes the one-token
  // step that decodes the same token uses (there, they are all committed), wherever its siblings sit in the tree,
  // so speculative and vanilla decoding normalise alike. Whole vectors inside [0, dense) add as vectors; the rest
  // lane by lane.
  dense = dense < 0 ? n : std::min(dense, n);
#ifdef E3_AVX512
  const int64_t dense16 = dense / 16 * 16;
  alignas(64) float lanes[16];
  int64_t lane = 0;                                                // next lane of the lane-by-lane part
  const __m512 vm = _mm512_set1_ps(mx), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 vs = _mm512_setzero_ps();
  for (; i < n; i += 16) {
    const int64_t r = std::min<int64_t>(16, n - i);
    const __mmask16 in_row = static_cast<__mmask16>(r == 16 ? 0xffff : (1u << r) - 1);
    const __m512 x = _mm512_mask_loadu_ps(ninf, in_row, s + i);  // padding lanes: -inf, like masked entries
    const __mmask16 unmasked = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(unmasked, exp16(_mm512_sub_ps(x, vm)));
    _mm512_mask_storeu_ps(s + i, in_row, e);
    if (i < dense16) {
      vs = _mm512_add_ps(vs, e);
      continue;
    }
    if (i == dense16) _mm512_store_ps(lanes, vs);                  // dense16 is a multiple of 16: lanes start at 0
    for (int j = 0; j < r; ++j)
      if (unmasked >> j & 1) lanes[lane++ % 16] += s[i + j];
  }
  if (dense16 < n) vs = _mm512_load_ps(lanes);
  sum = _mm512_reduce_add_ps(vs);
#elif defined(E3_AVX2)
  const int64_t dense8 = dense / 8 * 8;
  alignas(32) float lanes[8];
  int64_t lane = 0;                                                // next lane of the lane-by-lane part
  const __m256 vm = _mm256_set1_ps(mx), ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 vs = _mm256_setzero_ps();
  for (; i < n; i += 8) {
    const int64_t r = std::min<int64_t>(8, n - i);
    alignas(32) float tmp[8];
    __m256 x;
    if (r == 8) {
      x = _mm256_loadu_ps(s + i);
    } else {
      for (int j = 0; j < 8; ++j) tmp[j] = j < r ? s[i + j] : -std::numeric_limits<float>::infinity();
      x = _mm256_load_ps(tmp);
    }
    const __m256 is_masked = _mm256_cmp_ps(x, ninf, _CMP_EQ_OQ);
    const __m256 e = _mm256_andnot_ps(is_masked, exp8(_mm256_sub_ps(x, vm)));
    if (r == 8) {
      _mm256_storeu_ps(s + i, e);
    } else {
      _mm256_store_ps(tmp, e);
      std::memcpy(s + i, tmp, r * sizeof(float));
    }
    if (i < dense8) {
      vs = _mm256_add_ps(vs, e);
      continue;
    }
    if (i == dense8) _mm256_store_ps(lanes, vs);                   // dense8 is a multiple of 8: lanes start at 0
    const int masked_bits = _mm256_movemask_ps(is_masked);
    for (int j = 0; j < r; ++j)
      if (!(masked_bits >> j & 1)) lanes[lane++ % 8] += s[i + j];
  }
  if (dense8 < n) vs = _mm256_load_ps(lanes);
  sum = hsum8(vs);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  return sum;
}

// A strided [B, heads, T, D] view: element (b, h, t, d) at p[b * sb + h * sh + t * st + d].
template <typename E>
struct HeadView {
  E* p;
  int64_t sb, sh, st;
  E* at(int64_t b, int64_t h, int64_t t) const { return p + b * sb + h * sh + t * st; }
};

// x (D values) -> fp32 rotary embedding of x, rounded as transformers rounds it in the storage dtype:
// round(round(x * cos) + round(rotate_half(x) * sin)); without cos, x itself.
template <typename E>
inline void load_rope(const E* x, const E* cos, const E* sin, int64_t D, float* out) {
  if (cos == nullptr) {
    for (int64_t d = 0; d < D; ++d) out[d] = to_f(x[d]);
    return;
  }
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rot = d < half ? -to_f(x[d + half]) : to_f(x[d - half]);
    const float a = to_f(from_f<E>(to_f(x[d]) * to_f(cos[d])));
    const float b = to_f(from_f<E>(rot * to_f(sin[d])));
    out[d] = to_f(from_f<E>(a + b));
  }
}

// Stores the new keys (rotated when cos/sin are given) and values, then attends; one task per (row, head).
template <typename E>
void attention_impl(HeadView<E> q, HeadView<E> kn, HeadView<E> vn, HeadView<E> out, const E* cos, const E* sin,
                    int64_t B, int64_t nH, int64_t nKV, int64_t T, int64_t D, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& rows, const at::Tensor& lens,
                    const at::Tensor& write_start, const at::Tensor& new_mask, double scale) {
  const int64_t S = k_cache.size(2), F = new_mask.size(2), G = nH / nKV;
  const int64_t* rows_p = rows.data_ptr<int64_t>();
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  const int64_t* ws_p = write_start.data_ptr<int64_t>();
  const bool* mask_p = new_mask.data_ptr<bool>();
  E* kc = k_cache.data_ptr<E>();
  E* vc = v_cache.data_ptr<E>();
  const int64_t row_stride = nKV * S * D, head_stride = S * D;
  auto cs_at = [&](const E* base, int64_t b, int64_t t) { return base ? base + (b * T + t) * D : nullptr; };

  // 1. store the new keys and values
  {
    std::vector<float> kf(D);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < nKV; ++h)
        for (int64_t t = 0; t < T; ++t) {
          const int64_t dst = rows_p[b] * row_stride + h * head_stride + (ws_p[b] + t) * D;
          load_rope(kn.at(b, h, t), cs_at(cos, b, t), cs_at(sin, b, t), D, kf.data());
          for (int64_t d = 0; d < D; ++d) kc[dst + d] = from_f<E>(kf[d]);
          std::memcpy(vc + dst, vn.at(b, h, t), D * sizeof(E));
        }
  }
  // 2. attend. A task is a chunk of the G * T queries that share one KV head of one row (query r = g * T + t,
  // head h = kvh * G + g): each committed key block is converted to fp32 once per chunk and scored against every
  // query of the chunk, each value row once and added into every query's accumulator. Chunks are sized so that
  // there are a few tasks per thread even at batch 1. Per query, the sums run in the same order as for a lone
  // query, so results do not depend on the chunking.
  const int64_t GT = G * T, threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(GT, (B * nKV * GT + 4 * threads - 1) / (4 * threads)));
  const int64_t chunks_per_head = (GT + chunk - 1) / chunk;
  at::parallel_for(0, B * nKV * chunks_per_head, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(chunk * D), acc(chunk * D), kblock(16 * D), vrow(D), inv(chunk);
    std::vector<E> qb(chunk * D);
    std::vector<const bool*> masks(chunk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (nKV * chunks_per_head), kvh = (task / chunks_per_head) % nKV;
      const int64_t r0 = (task % chunks_per_head) * chunk, nq = std::min(chunk, GT - r0);
      const int64_t L = lens_p[b], n = L + F;
      const E* K = kc + rows_p[b] * row_stride + kvh * head_stride;
      const E* V = vc + rows_p[b] * row_stride + kvh * head_stride;
      scores.resize(nq * n);
      bool scored = false;
#ifdef E3_BF16DOT
      if constexpr (std::is_same<E, at::BFloat16>::value) {
        if (D == 64 || D == 128) {                     // bf16 dot products: the rotated query is bf16 already
          for (int64_t i = 0; i < nq; ++i) {
            const int64_t h = kvh * G + (r0 + i) / T, t = (r0 + i) % T;
            float* qi = qf.data() + i * D;
            load_rope(q.at(b, h, t), cs_at(cos, b, t), cs_at(sin, b, t), D, qi);
            for (int64_t d = 0; d < D; ++d) qb[i * D + d] = from_f<E>(qi[d]);
            masks[i] = mask_p + (b * T + t) * F;
          }
          if (D == 64) scores_bf16<2>(qb.data(), nq, K, L, F, masks.data(), static_cast<float>(scale), scores.data(), n);
          else scores_bf16<4>(qb.data(), nq, K, L, F, masks.data(), static_cast<float>(scale), scores.data(), n);
          for (int64_t i = 0; i < nq; ++i) inv[i] = 1.f / softmax_unnormalised(scores.data() + i * n, n, L);
          scored = true;
        }
      }
#endif
      if (!scored) {                                     // fp32 scores
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t h = kvh * G + (r0 + i) / T, t = (r0 + i) % T;
          float* qi = qf.data() + i * D;
          load_rope(q.at(b, h, t), cs_at(cos, b, t), cs_at(sin, b, t), D, qi);
          for (int64_t d = 0; d < D; ++d) qi[d] *= static_cast<float>(scale);
        }
        int64_t s0 = 0;
#ifdef E3_AVX512
        if (D % 16 == 0 && D <= 256)
          for (; s0 + 16 <= L; s0 += 16) {
            const E* kb = K + s0 * D;
            const float* kf = kblock.data();
            if (nq > 2)                                    // convert the block once for many queries
              for (int64_t j = 0; j < 16 * D; j += 16) _mm512_storeu_ps(kblock.data() + j, load16(kb + j));
            for (int64_t i = 0; i < nq; ++i) {
              float* si = scores.data() + i * n + s0;
              const float* qi = qf.data() + i * D;
              if (D == 64) nq > 2 ? dot16_fixed<4>(qi, kf, si) : dot16_fixed<4>(qi, kb, si);
              else if (D == 128) nq > 2 ? dot16_fixed<8>(qi, kf, si) : dot16_fixed<8>(qi, kb, si);
              else nq > 2 ? dot16(qi, kf, D, si) : dot16(qi, kb, D, si);
            }
          }
#endif
#if defined(E3_AVX2) && !defined(E3_AVX512)
        if (D % 8 == 0 && D <= 256)
          for (; s0 + 8 <= L; s0 += 8) {
            const E* kb = K + s0 * D;
            if (nq > 2) {                                  // convert the block once for the chunk's queries
              for (int64_t j = 0; j < 8 * D; j += 8) _mm256_storeu_ps(kblock.data() + j, load8(kb + j));
              for (int64_t i = 0; i < nq; ++i) dot8(qf.data() + i * D, kblock.data(), D, scores.data() + i * n + s0);
            } else {
              for (int64_t i = 0; i < nq; ++i) dot8(qf.data() + i * D, kb, D, scores.data() + i * n + s0);
            }
          }
#endif
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t t = (r0 + i) % T;
          const float* qi = qf.data() + i * D;
          float* si = scores.data() + i * n;
          for (int64_t s = s0; s < L; ++s) si[s] = dot(qi, K + s * D, D);
          const bool* m = mask_p + (b * T + t) * F;
          for (int64_t f = 0; f < F; ++f)
            si[L + f] = m[f] ? dot(qi, K + (L + f) * D, D) : -std::numeric_limits<float>::infinity();
          inv[i] = 1.f / softmax_unnormalised(si, n, L);
        }
      }
      std::fill(acc.begin(), acc.begin() + nq * D, 0.f);
      int64_t s_done = 0;                                // committed slots: all finite, no mask
#ifdef E3_AVX512
      if (D == 64 || D == 128) {
        int64_t i = 0;
        // D = 64: blocks of 6 queries (24 accumulators, 4 value vectors and a weight in the 32 registers), then
        // one block of the 1-5 left: each value row is read once per block
        for (; D == 64 && i + 6 <= nq; i += 6)
          weighted_sum_block<4, 6>(scores.data() + i * n, n, V, L, acc.data() + i * D);
        if (D == 64) {
          float* pi = scores.data() + i * n;
          float* ai = acc.data() + i * D;
          switch (nq - i) {
            case 5: weighted_sum_block<4, 5>(pi, n, V, L, ai); break;
            case 4: weighted_sum_block<4, 4>(pi, n, V, L, ai); break;
            case 3: weighted_sum_block<4, 3>(pi, n, V, L, ai); break;
            case 2: weighted_sum_block<4, 2>(pi, n, V, L, ai); break;
            case 1: weighted_sum_block<4, 1>(pi, n, V, L, ai); break;
          }
          i = nq;
        }
        for (; D == 128 && i + 2 <= nq; i += 2)
          weighted_sum_block<8, 2>(scores.data() + i * n, n, V, L, acc.data() + i * D);
        for (; i < nq; ++i)
          D == 64 ? weighted_sum_block<4, 1>(scores.data() + i * n, n, V, L, acc.data() + i * D)
                  : weighted_sum_block<8, 1>(scores.data() + i * n, n, V, L, acc.data() + i * D);
        s_done = L;
      }
#elif defined(E3_AVX2)
      if (D % 32 == 0) {
        int64_t i = 0;
        for (; i + 2 <= nq; i += 2) weighted_sum8<2>(scores.data() + i * n, n, V, D, L, acc.data() + i * D);
        for (; i < nq; ++i) weighted_sum8<1>(scores.data() + i * n, n, V, D, L, acc.data() + i * D);
        s_done = L;
      }
#endif
      for (int64_t s = s_done; s < n; ++s) {
        int64_t d0 = 0;
#ifdef E3_AVX512
        if (D % 16 == 0)
          for (; d0 < D; d0 += 16) _mm512_storeu_ps(vrow.data() + d0, load16(V + s * D + d0));
#endif
        for (int64_t d = d0; d < D; ++d) vrow[d] = to_f(V[s * D + d]);
        for (int64_t i = 0; i < nq; ++i) {
          const float p = scores[i * n + s];
          if (p != 0.f) axpy(acc.data() + i * D, p, vrow.data(), D);
        }
      }
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t h = kvh * G + (r0 + i) / T, t = (r0 + i) % T;
        const float* ai = acc.data() + i * D;
        E* orow = out.at(b, h, t);
        int64_t d = 0;
#ifdef E3_AVX512
        if (D % 16 == 0) {
          __m512 vi = _mm512_set1_ps(inv[i]);
          for (; d < D; d += 16) store16(orow + d, _mm512_mul_ps(_mm512_loadu_ps(ai + d), vi));
        }
#endif
        for (; d < D; ++d) orow[d] = from_f<E>(ai[d] * inv[i]);
      }
    }
  });
}

void check_pool_args(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& rows,
                     const at::Tensor& lens, const at::Tensor& write_start, const at::Tensor& new_mask,
                     int64_t B, int64_t nKV, int64_t T, int64_t D, at::ScalarType dtype) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache, v_cache must be [R, n_kv, S, D]");
  for (const auto* t : {&k_cache, &v_cache})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == dtype && t->device().is_cpu(),
                "KV pool tensors must be contiguous CPU tensors of the activations' dtype");
  TORCH_CHECK(k_cache.size(1) == nKV && k_cache.size(3) == D, "KV pool shape mismatch");
  TORCH_CHECK(rows.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
              write_start.scalar_type() == at::kLong, "rows, lens, write_start must be int64");
  TORCH_CHECK(rows.numel() == B && lens.numel() == B && write_start.numel() == B, "rows/lens/write_start need B entries");
  TORCH_CHECK(new_mask.scalar_type() == at::kBool && new_mask.dim() == 3 && new_mask.is_contiguous() &&
              new_mask.size(0) == B && new_mask.size(1) == T, "new_mask must be a contiguous bool [B, T, F]");
  const int64_t F = new_mask.size(2), R = k_cache.size(0), S = k_cache.size(2);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t r = rows.data_ptr<int64_t>()[b], L = lens.data_ptr<int64_t>()[b], w = write_start.data_ptr<int64_t>()[b];
    TORCH_CHECK(r >= 0 && r < R, "row index out of range");
    TORCH_CHECK(L >= 0 && w >= L && w + T <= L + F && L + F <= S, "KV slots out of range: lens ", L, " write_start ",
                w, " T ", T, " F ", F, " cache slots ", S);
  }
}

}  // namespace

// q [B, n_h, T, D], k_new / v_new [B, n_kv, T, D] (already rotated): store k/v, attend -> [B, n_h, T, D].
at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor k_cache,
                          at::Tensor v_cache, const at::Tensor& rows, const at::Tensor& lens,
                          const at::Tensor& write_start, const at::Tensor& new_mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k_new.dim() == 4 && v_new.dim() == 4, "q, k_new, v_new must be [B, h, T, D]");
  for (const auto* t : {&q, &k_new, &v_new})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == q.scalar_type(), "q, k_new, v_new: contiguous, one dtype");
  const int64_t B = q.size(0), nH = q.size(1), T = q.size(2), D = q.size(3), nKV = k_new.size(1);
  TORCH_CHECK(nH % nKV == 0 && k_new.size(0) == B && k_new.size(2) == T && k_new.size(3) == D &&
              v_new.sizes() == k_new.sizes(), "q / k_new / v_new shape mismatch");
  check_pool_args(k_cache, v_cache, rows, lens, write_start, new_mask, B, nKV, T, D, q.scalar_type());
  at::Tensor out = at::empty_like(q);
  E3_DISPATCH(q.scalar_type(), "tree_attention", [&] {
    using E = scalar_t;
    auto view = [&](const at::Tensor& x) {
      return HeadView<E>{const_cast<E*>(x.data_ptr<E>()), x.size(1) * T * D, T * D, D};
    };
    attention_impl<E>(view(q), view(k_new), view(v_new), view(out), nullptr, nullptr, B, nH, nKV, T, D, k_cache,
                      v_cache, rows, lens, write_start, new_mask, scale);
  });
  return out;
}

// qkv [B, T, (n_h + 2 n_kv) * D] straight from the fused projection; cos / sin [B, T, D]: rotary embedding
// of q and k (as transformers computes it) fused in. Returns [B, T, n_h * D], ready for o_proj.
at::Tensor qkv_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t nH, int64_t nKV,
                         at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& rows, const at::Tensor& lens,
                         const at::Tensor& write_start, const at::Tensor& new_mask, double scale) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous(), "qkv must be a contiguous [B, T, (n_h + 2 n_kv) * D]");
  const int64_t B = qkv.size(0), T = qkv.size(1), W = qkv.size(2), D = W / (nH + 2 * nKV);
  TORCH_CHECK(D * (nH + 2 * nKV) == W && nH % nKV == 0 && D % 2 == 0, "qkv width does not split into heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type() &&
              sin.scalar_type() == qkv.scalar_type() && cos.numel() == B * T * D && sin.numel() == B * T * D,
              "cos / sin must be contiguous [B, T, D] of qkv's dtype");
  check_pool_args(k_cache, v_cache, rows, lens, write_start, new_mask, B, nKV, T, D, qkv.scalar_type());
  at::Tensor out = at::empty({B, T, nH * D}, qkv.options());
  E3_DISPATCH(qkv.scalar_type(), "qkv_attention", [&] {
    using E = scalar_t;
    E* base = const_cast<E*>(qkv.data_ptr<E>());
    HeadView<E> q{base, T * W, D, W}, k{base + nH * D, T * W, D, W}, v{base + (nH + nKV) * D, T * W, D, W};
    HeadView<E> o{out.data_ptr<E>(), T * nH * D, D, nH * D};
    attention_impl<E>(q, k, v, o, cos.data_ptr<E>(), sin.data_ptr<E>(), B, nH, nKV, T, D, k_cache, v_cache, rows,
                      lens, write_start, new_mask, scale);
  });
  return out;
}

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

// ---- bf16 matrix products for few rows (decode, verify, draft): weights packed for AVX-512 BF16 dot products --
//
// pack_bf16(W [N, K]) -> P [N/32, K/2, 2, 16, 2]: output rows in groups of 32 (two blocks of 16). For group g,
// input pair p and block b, the 32 bf16 values W[32g + 16b + i, 2p + {0, 1}] (i = 0..15) are one 64-byte vector,
// so _mm512_dpbf16_ps(acc, P[g, p, b], x[2p, 2p+1] broadcast) adds both products of the pair into the 16 output
// lanes of block b: no horizontal sums, fp32 accumulation. The kernel reads a group's weights as one sequential
// stream (the hardware prefetcher keeps up with one stream per core better than with a stream per block), once
// per call: rows are processed in passes of up to 12 while the group's weights (K * 128 bytes) stay in L2.
// N and K are padded to 32 and 2 with zeros.
at::Tensor pack_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_bf16: a [N, K] bfloat16 weight");
  const int64_t N = w.size(0), K = w.size(1), NG = (N + 31) / 32, KP = (K + 1) / 2;
  at::Tensor wc = w.contiguous();
  at::Tensor out = at::zeros({NG, KP, 2, 16, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, NG, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t p = 0; p < KP; ++p)
        for (int64_t i = 0; i < 32; ++i) {
          const int64_t n = 32 * g + i;
          if (n >= N) continue;
          uint16_t* d = dst + ((g * KP + p) * 32 + i) * 2;
          d[0] = src[n * K + 2 * p];
          d[1] = 2 * p + 1 < K ? src[n * K + 2 * p + 1] : 0;
        }
  });
  return out;
}

namespace {
#ifdef E3_BF16DOT
// rows m0..m0+MT of x against output group g: 2 x MT accumulator chains, the pair of x values broadcast once
// for both blocks. The sum over k runs in the same order whatever MT is, so a row's result does not depend on
// how many rows come with it (decode and verify round alike).
template <int MT>
inline void dot_group(const uint16_t* x, int64_t K, const __m512bh* G, int64_t KP, const float* bias,
                      at::BFloat16* y, int64_t N, int64_t n0, int64_t m0) {
  __m512 acc[2][MT];
#pragma GCC unroll 16
  for (int t = 0; t < MT; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < KP; ++p) {
    const __m512bh w0 = G[2 * p], w1 = G[2 * p + 1];
    // both 64-byte lines of the pair: 2 KB ahead into L1 and 16 KB ahead into L2. (Prefetching only the first
    // line, as before, cost a Zen 4 EPYC 1.4x at 8 rows: 11.3 ms -> 7.3 ms for SmolLM2's linears + head.)
    _mm_prefetch(reinterpret_cast<const char*>(G + 2 * p + 32), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(G + 2 * p + 33), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(G + 2 * p + 256), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(G + 2 * p + 257), _MM_HINT_T1);
#pragma GCC unroll 16
    for (int t = 0; t < MT; ++t) {
      uint32_t pair;
      std::memcpy(&pair, x + (m0 + t) * K + 2 * p, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair);
      acc[0][t] = _mm512_dpbf16_ps(acc[0][t], w0, xb);
      acc[1][t] = _mm512_dpbf16_ps(acc[1][t], w1, xb);
    }
  }
#pragma GCC unroll 2
  for (int b = 0; b < 2; ++b) {
    const int64_t nb = n0 + 16 * b, valid = std::min<int64_t>(16, N - nb);
    if (valid <= 0) break;
    const __mmask16 keep = valid == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + nb) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int t = 0; t < MT; ++t) {
      __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[b][t], bv));    // round to nearest even
      _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(y + (m0 + t) * N + nb), keep, h);
    }
  }
}

inline void dot_rows(int64_t rows, const uint16_t* x, int64_t K, const __m512bh* G, int64_t KP, const float* bias,
                     at::BFloat16* y, int64_t N, int64_t n0, int64_t m0) {
  switch (rows) {
    case 12: return dot_group<12>(x, K, G, KP, bias, y, N, n0, m0);
    case 11: return dot_group<11>(x, K, G, KP, bias, y, N, n0, m0);
    case 10: return dot_group<10>(x, K, G, KP, bias, y, N, n0, m0);
    case 9: return dot_group<9>(x, K, G, KP, bias, y, N, n0, m0);
    case 8: return dot_group<8>(x, K, G, KP, bias, y, N, n0, m0);
    case 7: return dot_group<7>(x, K, G, KP, bias, y, N, n0, m0);
    case 6: return dot_group<6>(x, K, G, KP, bias, y, N, n0, m0);
    case 5: return dot_group<5>(x, K, G, KP, bias, y, N, n0, m0);
    case 4: return dot_group<4>(x, K, G, KP, bias, y, N, n0, m0);
    case 3: return dot_group<3>(x, K, G, KP, bias, y, N, n0, m0);
    case 2: return dot_group<2>(x, K, G, KP, bias, y, N, n0, m0);
    case 1: return dot_group<1>(x, K, G, KP, bias, y, N, n0, m0);
    default: return;
  }
}
#elif defined(E3_AVX2)
// AVX2 + FMA, no bf16 instructions (e.g. AMD Zen 2/3): the same packed layout. A 32-byte load holds, for 8 outputs,
// the pair k = 2p, 2p + 1 as the low and high half of each 32-bit lane, so the lane shifted up by 16 and the lane
// with its low half cleared are those two weights as fp32: two FMAs per 8 outputs and pair, the weights read once
// as bf16 (half fp32's bytes: decode is bound by them). x comes widened to fp32 (xf [M, Kx], exact), so each
// row's pair is two broadcast loads. One sweep over k covers CH of the group's 4 chunks of 8 outputs for MT rows:
// CH x MT accumulator chains (two dependent FMAs per pair each), enough of them to fill both FMA pipes once
// CH * MT >= 8, and few enough (<= 11) to stay in the 16 registers. A group's packed block (KP x 128 bytes, 36 KB
// at K = 576) stays in L2 between its sweeps, so memory reads each weight once whatever the rows. Every output's
// sum over k runs in the same order whatever CH and MT are: a row's result does not depend on the rows beside it.
// Prefetch at two distances keeps memory busy while the FMAs run: the first sweep asks for both lines of the pair
// PF ahead into L1, and the sweeps of a group's last pass spread the requests for the next group's lines (Gn, the
// group this thread takes next; null for its last) into L2 over their pairs, so a sweep that only computes from L2
// (the second of two) still has reads in flight. (Measured on a Zen 3 EPYC, all linears + head of SmolLM2 against
// one line of prefetch per pair, 2 KB ahead: one row 22% less time, 2 rows 25%, 3-5 rows 3-13%.)
template <int CH, int MT>
inline void fma_sweep(const float* xf, int64_t Kx, const uint16_t* G, int64_t KP, const float* bias,
                      at::BFloat16* y, int64_t N, int64_t n0, int64_t m0, int c0, const uint16_t* Gn) {
  __m256 acc[CH][MT];
#pragma GCC unroll 4
  for (int c = 0; c < CH; ++c)
#pragma GCC unroll 11
    for (int t = 0; t < MT; ++t) acc[c][t] = _mm256_setzero_ps();
  constexpr int64_t PF = 32;             // pairs ahead (4 KB)
  constexpr int NS = 4 / CH;             // sweeps per pass; this one is sweep c0 / CH
  const char* next = Gn ? reinterpret_cast<const char*>(Gn) + (c0 / CH) * (KP * 128 / NS) : nullptr;  // its share
  constexpr bool HOLD = CH * MT + 2 * MT + 3 <= 16;   // accumulators + broadcasts + w0, w1, mask fit in 16 ymm
  const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
  const float* xr = xf + m0 * Kx;
  for (int64_t p = 0; p < KP; ++p) {
    const __m256i* W = reinterpret_cast<const __m256i*>(G + p * 64);     // 4 chunks x 8 outputs x 2 values
    const char* ahead = reinterpret_cast<const char*>(G + (p + PF) * 64);
    if (c0 == 0) {                       // both lines of the pair block: the later sweeps find them in L2
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
    } else {
      _mm_prefetch(ahead + c0 * 32, _MM_HINT_T0);
    }
    if (next && (2 * p) % NS == 0) {       // 2 / NS lines of the next group per pair: all of it over the NS sweeps
      _mm_prefetch(next + (2 * p / NS) * 64, _MM_HINT_T1);
      if (NS == 1) _mm_prefetch(next + (2 * p + 1) * 64, _MM_HINT_T1);
    }
    __m256 x0[MT], x1[MT];                 // the rows' pair, broadcast: held across chunks where registers allow
#pragma GCC unroll 11
    for (int t = 0; t < MT; ++t)
      if (HOLD) x0[t] = _mm256_broadcast_ss(xr + t * Kx + 2 * p), x1[t] = _mm256_broadcast_ss(xr + t * Kx + 2 * p + 1);
#pragma GCC unroll 4
    for (int c = 0; c < CH; ++c) {
      const __m256i w = _mm256_loadu_si256(W + c0 + c);
      const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
      const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
#pragma GCC unroll 11
      for (int t = 0; t < MT; ++t) {
        const __m256 a = HOLD ? x0[t] : _mm256_broadcast_ss(xr + t * Kx + 2 * p);
        const __m256 b = HOLD ? x1[t] : _mm256_broadcast_ss(xr + t * Kx + 2 * p + 1);
        acc[c][t] = _mm256_fmadd_ps(w1, b, _mm256_fmadd_ps(w0, a, acc[c][t]));
      }
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < CH; ++c) {
    const int64_t nb = n0 + 8 * (c0 + c), valid = std::min<int64_t>(8, N - nb);
    if (valid <= 0) continue;                                            // padding of the last group
    for (int t = 0; t < MT; ++t) {
      alignas(32) float out[8];
      _mm256_store_ps(out, acc[c][t]);
      at::BFloat16* yr = y + (m0 + t) * N + nb;
      for (int64_t i = 0; i < valid; ++i) yr[i] = at::BFloat16(out[i] + (bias ? bias[nb + i] : 0.f));   // RNE once
    }
  }
}

// MT rows against the group's 4 chunks in 4 / CH sweeps, CH chosen so that CH * MT chains fill the FMA pipes
template <int MT>
inline void fma_group(const float* xf, int64_t Kx, const uint16_t* G, int64_t KP, const float* bias,
                      at::BFloat16* y, int64_t N, int64_t n0, int64_t m0, const uint16_t* Gn) {
  constexpr int CH = MT <= 2 ? 4 : MT <= 5 ? 2 : 1;
  for (int c0 = 0; c0 < 4; c0 += CH) fma_sweep<CH, MT>(xf, Kx, G, KP, bias, y, N, n0, m0, c0, Gn);
}

inline void fma_rows(int64_t rows, const float* xf, int64_t Kx, const uint16_t* G, int64_t KP, const float* bias,
                     at::BFloat16* y, int64_t N, int64_t n0, int64_t m0, const uint16_t* Gn) {
  switch (rows) {
    case 11: return fma_group<11>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn);
    case 10: return fma_group<10>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn);
    case 9: return fma_group<9>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn);
    case 8: return fma_group<8>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn);
    case 7: return fma_group<7>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn);
    case 6: return fma_group<6>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn);
    case 5: return fma_group<5>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn);
    case 4: return fma_group<4>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn);
    case 3: return fma_group<3>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn);
    case 2: return fma_group<2>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn);
    case 1: return fma_group<1>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn);
    default: return;
  }
}
#endif
}  // namespace

// x [M, K] bf16 @ W^T with W packed by pack_bf16 -> y [M, N] bf16 (fp32 accumulation; bias fp32 or none)
// (a weight packed by pack_amx goes to amx_linear.cpp's tile kernel)
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
  if (is_amx_packed(packed)) return linear_amx(x, packed, N, bias);
#if defined(E3_BF16DOT) || defined(E3_AVX2)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
              packed.dim() == 5 && packed.size(2) == 2 && packed.size(3) == 16 && packed.size(4) == 2,
              "linear_bf16: x [M, K] and a packed weight");
  const int64_t M = x.size(0), K = x.size(1), NG = packed.size(0), KP = packed.size(1);
  TORCH_CHECK((K + 1) / 2 == KP && (N + 31) / 32 == NG, "linear_bf16: weight packed for another shape");
  at::Tensor xc = x.contiguous();
  if (K % 2) xc = at::constant_pad_nd(xc, {0, 1});
  const int64_t Kx = xc.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor bf;
  if (bias && bias->defined()) bf = bias->to(at::kFloat).contiguous();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const uint16_t* P = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());   // 64 values per (g, p)
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
#ifdef E3_BF16DOT
  constexpr int64_t MT_MAX = 12;   // 2 x 12 accumulators of 16 lanes
  // passes of up to MT_MAX rows, as even as possible (16 rows with 12: 8 + 8, not 12 + 4)
  const int64_t passes = (M + MT_MAX - 1) / MT_MAX, per_pass = (M + passes - 1) / passes;
  at::parallel_for(0, NG, 2, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t m0 = 0; m0 < M; m0 += per_pass)
        dot_rows(std::min(per_pass, M - m0), xp, Kx, reinterpret_cast<const __m512bh*>(P) + g * KP * 2, KP, bp, yp,
                 N, 32 * g, m0);
  });
#else
  std::vector<float> xw(M * Kx);                                            // [M, Kx] fp32 (exact)
  for (int64_t i = 0; i < M * Kx; ++i) {
    const uint32_t bits = uint32_t(xp[i]) << 16;                             // bf16 is fp32's upper half
    std::memcpy(&xw[i], &bits, 4);
  }
  const float* xf = xw.data();
  // passes whose sweeps all have >= 8 accumulator chains where possible: 6 rows as 4 + 2, 7 as 5 + 2, 8 to 11 in one
  std::vector<int64_t> starts;
  for (int64_t m0 = 0; m0 < M;) {
    starts.push_back(m0);
    const int64_t left = M - m0;
    m0 += left >= 8 ? std::min<int64_t>(left, 11) : left >= 6 ? left - 2 : left;
  }
  starts.push_back(M);
  at::parallel_for(0, NG, 2, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (size_t i = 0; i + 1 < starts.size(); ++i)
        fma_rows(starts[i + 1] - starts[i], xf, Kx, P + g * KP * 64, KP, bp, yp, N, 32 * g, starts[i],
                 i + 2 == starts.size() && g + 1 < g1 ? P + (g + 1) * KP * 64 : nullptr);   // last pass: next group
  });
#endif
  return y;
#else
  TORCH_CHECK(false, "linear_bf16: this build has neither AVX-512 BF16 nor AVX2 + FMA (compile with -march=native)");
#endif
}

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

// the instructions linear_bf16's few-row kernel was built with: "avx512_bf16", "avx2" or "" (none)
std::string few_row_isa() {
#if defined(E3_BF16DOT)
  return "avx512_bf16";
#elif defined(E3_AVX2)
  return "avx2";
#else
  return "";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_bf16", &pack_bf16, "pack a bf16 [N, K] weight for linear_bf16");
  m.def("linear_bf16", &linear_bf16, "few-row bf16 matrix product against a packed weight");
  m.def("few_row_isa", &few_row_isa, "the instructions linear_bf16 was built with (avx512_bf16, avx2 or none)");
  m.def("pack_amx", &pack_amx, "pack a bf16 [N, K] weight for the AMX tile kernel (linear_bf16 dispatches on it)");
  m.def("amx_usable", &amx_usable, "built with AMX and the OS grants tile data");
  m.def("layer_step", &layer_step, "one decoder layer of a decode/verify step (bf16, packed weights)");
  m.def("draft_layer", &draft_layer, "the EAGLE-3 draft's decoder layer over its KV pool (bf16, packed weights)");
  m.def("tree_attention", &tree_attention, "attention over a row-indexed KV pool with a tree mask (writes k/v)");
  m.def("qkv_attention", &qkv_attention, "rotary embedding + tree_attention from the fused qkv projection");
  m.def("rms_norm", &rms_norm, "RMSNorm (transformers' rounding)");
  m.def("add_rms_norm", &add_rms_norm, "x += residual in place; returns RMSNorm(x)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("soft_ce_forward", &soft_ce_forward, "soft cross-entropy over rows of p (-> loss, logsumexp)");
  m.def("soft_ce_backward", &soft_ce_backward, "(softmax(z) - p[rows]) * grad");
  m.def("target_distribution", &target_distribution, "argmax over V and softmax at the draft's ids (fp32)");
  m.def("topk_logprobs", &topk_logprobs, "the k largest log-probabilities of each row and their indices");
  m.def("build_tree", &build_tree, "draft tree selection and layout (tree.build_draft_tree)");
  m.def("accept_greedy", &accept_greedy, "greedy acceptance of a tree from the target's logits");
  m.def("accept_sampling", &accept_sampling, "tree speculative sampling of one row from the target's logits");
}

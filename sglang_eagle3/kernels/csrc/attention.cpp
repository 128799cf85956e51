// Tree attention for the decode step: attention over a row-indexed KV pool with a tree mask (decode, verify,
// draft), the rotary embedding fused in (qkv_attention).
//
// Built by sglang_eagle3/kernels/extension.py with torch.utils.cpp_extension; the Python wrappers and their
// PyTorch twins are in kernels/decode.py (tests check that both agree).
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
// row_tokens [B] (nullptr: T each): row b's new tokens are its first row_tokens[b] of T, the rest padding that is
// neither stored nor attended (its outputs are left as they were).
template <typename E>
void attention_impl(HeadView<E> q, HeadView<E> kn, HeadView<E> vn, HeadView<E> out, const E* cos, const E* sin,
                    int64_t B, int64_t nH, int64_t nKV, int64_t T, int64_t D, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& rows, const at::Tensor& lens,
                    const at::Tensor& write_start, const at::Tensor& new_mask, double scale,
                    const int64_t* row_tokens = nullptr) {
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
        for (int64_t t = 0; t < (row_tokens ? row_tokens[b] : T); ++t) {
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
  // query, so results do not depend on the chunking. A row with Tb < T new tokens has G * Tb queries (r = g * Tb + t);
  // its chunks past them do nothing.
  const int64_t GT = G * T, threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(GT, (B * nKV * GT + 4 * threads - 1) / (4 * threads)));
  const int64_t chunks_per_head = (GT + chunk - 1) / chunk;
  at::parallel_for(0, B * nKV * chunks_per_head, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(chunk * D), acc(chunk * D), kblock(16 * D), vrow(D), inv(chunk);
    std::vector<E> qb(chunk * D);
    std::vector<const bool*> masks(chunk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (nKV * chunks_per_head), kvh = (task / chunks_per_head) % nKV;
      const int64_t Tb = row_tokens ? row_tokens[b] : T, r0 = (task % chunks_per_head) * chunk;
      if (r0 >= G * Tb) continue;
      const int64_t nq = std::min(chunk, G * Tb - r0);
      const int64_t L = lens_p[b], n = L + F;
      const E* K = kc + rows_p[b] * row_stride + kvh * head_stride;
      const E* V = vc + rows_p[b] * row_stride + kvh * head_stride;
      scores.resize(nq * n);
      bool scored = false;
#ifdef E3_BF16DOT
      if constexpr (std::is_same<E, at::BFloat16>::value) {
        if (D == 64 || D == 128) {                     // bf16 dot products: the rotated query is bf16 already
          for (int64_t i = 0; i < nq; ++i) {
            const int64_t h = kvh * G + (r0 + i) / Tb, t = (r0 + i) % Tb;
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
          const int64_t h = kvh * G + (r0 + i) / Tb, t = (r0 + i) % Tb;
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
          const int64_t t = (r0 + i) % Tb;
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
        const int64_t h = kvh * G + (r0 + i) / Tb, t = (r0 + i) % Tb;
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
// of q and k (as transformers computes it) fused in. Returns [B, T, n_h * D], ready for o_proj. row_tokens [B]
// (optional): row b's real tokens are its first row_tokens[b]; the others are padding, not stored, not attended,
// their outputs left unset.
at::Tensor qkv_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t nH, int64_t nKV,
                         at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& rows, const at::Tensor& lens,
                         const at::Tensor& write_start, const at::Tensor& new_mask, double scale,
                         const c10::optional<at::Tensor>& row_tokens) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous(), "qkv must be a contiguous [B, T, (n_h + 2 n_kv) * D]");
  const int64_t B = qkv.size(0), T = qkv.size(1), W = qkv.size(2), D = W / (nH + 2 * nKV);
  TORCH_CHECK(D * (nH + 2 * nKV) == W && nH % nKV == 0 && D % 2 == 0, "qkv width does not split into heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type() &&
              sin.scalar_type() == qkv.scalar_type() && cos.numel() == B * T * D && sin.numel() == B * T * D,
              "cos / sin must be contiguous [B, T, D] of qkv's dtype");
  check_pool_args(k_cache, v_cache, rows, lens, write_start, new_mask, B, nKV, T, D, qkv.scalar_type());
  const int64_t* tokens_p = nullptr;
  if (row_tokens && row_tokens->defined()) {
    TORCH_CHECK(row_tokens->scalar_type() == at::kLong && row_tokens->numel() == B && row_tokens->is_contiguous(),
                "qkv_attention: row_tokens must be a contiguous int64 [B]");
    tokens_p = row_tokens->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(tokens_p[b] >= 1 && tokens_p[b] <= T, "qkv_attention: row_tokens[", b, "] = ", tokens_p[b],
                  " outside [1, ", T, "]");
  }
  at::Tensor out = at::empty({B, T, nH * D}, qkv.options());
  E3_DISPATCH(qkv.scalar_type(), "qkv_attention", [&] {
    using E = scalar_t;
    E* base = const_cast<E*>(qkv.data_ptr<E>());
    HeadView<E> q{base, T * W, D, W}, k{base + nH * D, T * W, D, W}, v{base + (nH + nKV) * D, T * W, D, W};
    HeadView<E> o{out.data_ptr<E>(), T * nH * D, D, nH * D};
    attention_impl<E>(q, k, v, o, cos.data_ptr<E>(), sin.data_ptr<E>(), B, nH, nKV, T, D, k_cache, v_cache, rows,
                      lens, write_start, new_mask, scale, tokens_p);
  });
  return out;
}

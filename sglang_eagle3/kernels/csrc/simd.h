// Scalar and AVX-512 helpers shared by the extension's sources (bf16 <-> fp32, vector exp, first-maximum argmax,
// the dtype dispatch). Every function is inline; the namespace keeps them apart from torch's.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#define E3_AVX512 1
#endif
#if defined(__AVX512BF16__)
#define E3_BF16DOT 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define E3_AVX2 1
#endif

namespace e3 {

// float and bfloat16 storage only (other dtypes take the PyTorch twins in kernels.py)
#define E3_DISPATCH(TYPE, NAME, ...)                                                         \
  [&] {                                                                                      \
    if ((TYPE) == at::kFloat) { using scalar_t = float; __VA_ARGS__(); }                    \
    else if ((TYPE) == at::kBFloat16) { using scalar_t = at::BFloat16; __VA_ARGS__(); }     \
    else TORCH_CHECK(false, NAME ": float32 or bfloat16 only");                            \
  }()

// 2^f on [-0.5, 0.5], degree-6 minimax (relative error < 2e-7), highest power first: exp16 and exp8 (Horner)
constexpr float kExp2Poly[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};

inline float to_f(float x) { return x; }
inline float to_f(at::BFloat16 x) { return static_cast<float>(x); }
template <typename T> inline T from_f(float x) { return static_cast<T>(x); }

#ifdef E3_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  // round to nearest even, as torch's float -> bfloat16 cast (NaN kept quiet)
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
// exp(x), x clamped to [-87, 88]: 2^(x log2 e) = 2^n * 2^f, f in [-0.5, 0.5]
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
#pragma GCC unroll 6
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}
// The sum of a's 16 lanes in the order attention.cpp's hsum16 (the 16-keys-at-once transpose-add) sums each of its
// inputs: ((s0 + s1) + (s2 + s3)), s_k = (a[4k] + a[4k+2]) + (a[4k+1] + a[4k+3]), so that a key scored alone
// gets the score it gets in a block of 16, bit for bit.
inline float hsum16_one(__m512 a) {
  const __m512 t = _mm512_add_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(1, 0, 3, 2)));      // a[j] + a[j ^ 2]
  const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));      // s_k in each 128 bits
  const __m512 v = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(2, 3, 0, 1)));  // s0 + s1, s2 + s3
  return _mm512_cvtss_f32(_mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2))));
}
#endif

#if defined(E3_AVX2) && !defined(E3_AVX512)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
// exp(x) as exp16: x clamped to [-87, 88], 2^n * 2^f with the same degree-6 polynomial, 2^n built in the exponent
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
#pragma GCC unroll 6
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));     // n in [-126, 127]: a normal power of two
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)): the order in which dot8 sums each key's lanes
inline float hsum8_pairs(__m256 v) {
  const __m256 h = _mm256_hadd_ps(v, v);
  const __m256 h2 = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1)));
}
#endif

// max of z[0:V] in fp32
template <typename E>
inline float row_max(const E* z, int64_t V) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#ifdef E3_AVX512
  __m512 vm = _mm512_set1_ps(mx);
  for (; j + 16 <= V; j += 16) vm = _mm512_max_ps(vm, load16(z + j));
  mx = _mm512_reduce_max_ps(vm);
#endif
  for (; j < V; ++j) mx = std::max(mx, to_f(z[j]));
  return mx;
}

// the index of the first maximum of z[0:V] (as torch's max(-1).indices / argmax)
template <typename E>
inline int64_t argmax_row(const E* z, int64_t V) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t arg = 0, j = 0;
#ifdef E3_AVX512
  // per lane: the first maximum of its column; then the lowest index among the lanes holding the maximum
  __m512 vbest = _mm512_set1_ps(best);
  __m512i vidx = _mm512_setzero_si512(), cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (; j + 16 <= V; j += 16) {
    const __m512 v = load16(z + j);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);
    vbest = _mm512_mask_mov_ps(vbest, gt, v);
    vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
    cur = _mm512_add_epi32(cur, step);
  }
  if (j > 0) {
    best = _mm512_reduce_max_ps(vbest);
    const __mmask16 at_best = _mm512_cmp_ps_mask(vbest, _mm512_set1_ps(best), _CMP_EQ_OQ);
    arg = _mm512_mask_reduce_min_epi32(at_best, vidx);
  }
#endif
  for (; j < V; ++j) {
    const float v = to_f(z[j]);
    if (v > best) { best = v; arg = j; }
  }
  return arg;
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

}  // namespace e3

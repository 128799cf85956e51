// The few-row bf16 product on AVX-512F without AVX-512 BF16 (Intel Skylake-SP, Cascade Lake, Ice Lake Xeons): bf16
// weights widened to fp32 in 512-bit registers, fp32 FMAs. linear.cpp packs the weight and dispatches here.
//
// Why: the AVX2 kernel (linear.cpp's fma_sweep) runs the products at 8 lanes; from ~4 rows on it is bound by its
// FMAs (an 8-token verify cost 2.46x a one-token step on a 2-core Xeon without BF16), while the 512-bit FMA units
// sat idle. Widening bf16 to fp32 costs one shift (or one AND) per vector, so the products run at 16 lanes with
// the summation order of the AVX2 kernel: each output lane is the same chain of fp32 FMAs over k, lane for lane, so
// both kernels give the same bits (and a row's result does not depend on how many rows come with it). Products of
// up to 5 rows, bound by memory rather than FMAs, linear.cpp hands to the AVX2 loop over the same bytes (it streamed
// the weights faster there); this kernel takes 6 rows and more: verifies, batches, prefill.
//
// Layout (pack_bf16(w, "avx512f") -> int32 [N/32, K/2, 2, 16]): output rows in groups of 32, two blocks of 16. For
// group g, input pair p and block b, lane i holds W[32g + 16b + i, 2p] in its low and W[.., 2p + 1] in its high
// 16 bits: one 64-byte vector, so the lane shifted up by 16 and the lane with its low half cleared are the two
// weights as fp32. A group's blocks are one sequential stream over p (the same bytes as the AVX-512 BF16 layout).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "ops.h"
#include "simd.h"

#ifdef E3_AVX512
namespace {
using namespace e3;

constexpr int64_t PF_L1 = 32;        // vectors ahead (2 KB) into L1
constexpr int64_t MT_MAX = 12;       // rows per pass

// rows m0..m0+MT of xf (fp32 [M, Kx]) against group G (KP pairs x 2 blocks): 2 x MT accumulator chains, each two
// dependent FMAs per pair (k = 2p, then 2p + 1, as the AVX2 kernel sums). From MT = 4 on, the 2 MT >= 8 chains
// keep both FMA pipes busy; MT <= 12 keeps the 24 accumulators, 4 widened weights and 2 broadcasts in the 32
// registers. Prefetch: both lines of the pair 2 KB ahead into L1, and share `pass` of `passes` of the next group
// this thread takes (Gn; null after its last) into L2, spread over this pass's pairs: memory reads the next group
// while every pass over this one computes (pass 2 of 16 rows reads its group from L2 alone), where prefetching
// 16 KB ahead left it idle in the later passes and behind in a single one (a Xeon with AMX running this AVX-512F
// code, the linears of a whole SmolLM2 step: 8 rows 21.1 -> 18.7 ms, 16 rows 28.2 -> 27.8 ms; separate runs on a
// shared host whose timings move by ~5% from run to run).
template <int MT>
inline void widen_group(const float* xf, int64_t Kx, const __m512i* G, int64_t KP, const float* bias,
                        at::BFloat16* y, int64_t N, int64_t n0, int64_t m0, const __m512i* Gn, int64_t pass,
                        int64_t passes) {
  __m512 acc[2][MT];
#pragma GCC unroll 12
  for (int t = 0; t < MT; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const float* xr = xf + m0 * Kx;
  const int64_t share = (KP + passes - 1) / passes;                       // pairs of Gn this pass prefetches
  const __m512i* next = Gn ? Gn + 2 * pass * share : nullptr;
  for (int64_t p = 0; p < KP; ++p) {
    const __m512i wa = _mm512_loadu_si512(G + 2 * p), wb = _mm512_loadu_si512(G + 2 * p + 1);
    _mm_prefetch(reinterpret_cast<const char*>(G + 2 * p + PF_L1), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(G + 2 * p + PF_L1 + 1), _MM_HINT_T0);
    if (next && p % passes == 0 && pass * share + p / passes < KP) {
      _mm_prefetch(reinterpret_cast<const char*>(next + 2 * (p / passes)), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + 2 * (p / passes) + 1), _MM_HINT_T1);
    }
    const __m512 a0 = _mm512_castsi512_ps(_mm512_slli_epi32(wa, 16));     // block 0, k = 2p
    const __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(wa, hi));      // block 0, k = 2p + 1
    const __m512 b0 = _mm512_castsi512_ps(_mm512_slli_epi32(wb, 16));
    const __m512 b1 = _mm512_castsi512_ps(_mm512_and_si512(wb, hi));
#pragma GCC unroll 12
    for (int t = 0; t < MT; ++t) {
      const __m512 x0 = _mm512_set1_ps(xr[t * Kx + 2 * p]), x1 = _mm512_set1_ps(xr[t * Kx + 2 * p + 1]);
      acc[0][t] = _mm512_fmadd_ps(a1, x1, _mm512_fmadd_ps(a0, x0, acc[0][t]));
      acc[1][t] = _mm512_fmadd_ps(b1, x1, _mm512_fmadd_ps(b0, x0, acc[1][t]));
    }
  }
#pragma GCC unroll 2
  for (int b = 0; b < 2; ++b) {
    const int64_t nb = n0 + 16 * b, valid = std::min<int64_t>(16, N - nb);
    if (valid <= 0) break;                                                 // padding of the last group
    const __mmask16 keep = valid == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + nb) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int t = 0; t < MT; ++t) {
      const __m512 sum = _mm512_add_ps(acc[b][t], bv);
      at::BFloat16* yr = y + (m0 + t) * N + nb;
      if (valid == 16) {
        store16(yr, sum);                                                  // round to nearest even, once
      } else {
        alignas(64) at::BFloat16 out[16];
        store16(out, sum);
        std::memcpy(yr, out, valid * sizeof(at::BFloat16));
      }
    }
  }
}

inline void widen_rows(int64_t rows, const float* xf, int64_t Kx, const __m512i* G, int64_t KP, const float* bias,
                       at::BFloat16* y, int64_t N, int64_t n0, int64_t m0, const __m512i* Gn, int64_t pass,
                       int64_t passes) {
  switch (rows) {
    case 12: return widen_group<12>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn, pass, passes);
    case 11: return widen_group<11>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn, pass, passes);
    case 10: return widen_group<10>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn, pass, passes);
    case 9: return widen_group<9>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn, pass, passes);
    case 8: return widen_group<8>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn, pass, passes);
    case 7: return widen_group<7>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn, pass, passes);
    case 6: return widen_group<6>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn, pass, passes);
    case 5: return widen_group<5>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn, pass, passes);
    case 4: return widen_group<4>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn, pass, passes);
    case 3: return widen_group<3>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn, pass, passes);
    case 2: return widen_group<2>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn, pass, passes);
    case 1: return widen_group<1>(xf, Kx, G, KP, bias, y, N, n0, m0, Gn, pass, passes);
    default: return;
  }
}
}  // namespace

// y [M, N] = xf [M, Kx] @ W^T (+ bias) for W packed as int32 [NG, KP, 2, 16] at P; Kx = 2 KP
void linear_widen16(const float* xf, int64_t M, int64_t Kx, const int32_t* P, int64_t NG, int64_t KP,
                    const float* bias, at::BFloat16* y, int64_t N) {
  // passes of up to MT_MAX rows, as even as possible (16 rows: 8 + 8, not 12 + 4)
  const int64_t per_pass = (M + (M + MT_MAX - 1) / MT_MAX - 1) / ((M + MT_MAX - 1) / MT_MAX);
  const int64_t passes = (M + per_pass - 1) / per_pass;
  const __m512i* W = reinterpret_cast<const __m512i*>(P);                  // 2 vectors per (group, pair)
  at::parallel_for(0, NG, 2, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const __m512i* next = g + 1 < g1 ? W + (g + 1) * KP * 2 : nullptr;
      for (int64_t i = 0; i < passes; ++i)
        widen_rows(std::min(per_pass, M - i * per_pass), xf, Kx, W + g * KP * 2, KP, bias, y, N, 32 * g,
                   i * per_pass, next, i, passes);
    }
  });
}
#endif

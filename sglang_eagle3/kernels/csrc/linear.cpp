// Few-row bf16 matrix products (decode, verify, draft) against weights packed once: the AVX-512 BF16 dot-product
// kernel and the AVX2 + FMA kernel (bf16 weights widened to fp32 in registers) here, the AVX-512F one (the same
// widening on 512-bit vectors) in linear_avx512f.cpp, the AMX one in amx_linear.cpp. A build holds every kernel its
// instruction set allows; the packed weight's layout says which one reads it (pack_bf16's kernel argument).
//
// Built by sglang_eagle3/kernels/extension.py; the Python wrapper (PackedLinear) is in kernels/decode.py.
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

// ---- bf16 matrix products for few rows (decode, verify, draft): weights packed for AVX-512 BF16 dot products --
//
// pack_bf16(W [N, K]) -> P [N/32, K/2, 2, 16, 2]: output rows in groups of 32 (two blocks of 16). For group g,
// input pair p and block b, the 32 bf16 values W[32g + 16b + i, 2p + {0, 1}] (i = 0..15) are one 64-byte vector,
// so _mm512_dpbf16_ps(acc, P[g, p, b], x[2p, 2p+1] broadcast) adds both products of the pair into the 16 output
// lanes of block b: no horizontal sums, fp32 accumulation. The kernel reads a group's weights as one sequential
// stream (the hardware prefetcher keeps up with one stream per core better than with a stream per block), once
// per call: rows are processed in passes of up to 12 while the group's weights (K * 128 bytes) stay in L2.
// N and K are padded to 32 and 2 with zeros.
//
// The kernels that widen bf16 to fp32 read the same bytes as 32-bit lanes (W[n, 2p] in the low, W[n, 2p + 1] in
// the high half), so their packed weight is that tensor viewed as int32: [N/32, K/2, 2, 16] for the AVX-512F kernel
// (two blocks of 16 lanes per group and pair), [N/32, K/2, 4, 8] for the AVX2 kernel (four chunks of 8 lanes).
// linear_bf16 dispatches on these layouts.
namespace {
bool kernel_built(const std::string& kernel) {
  const std::vector<std::string> built = few_row_kernels();
  return std::find(built.begin(), built.end(), kernel) != built.end();
}
}  // namespace

at::Tensor pack_bf16(const at::Tensor& w, const std::string& kernel_name) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_bf16: a [N, K] bfloat16 weight");
  const std::string kernel = kernel_name.empty() ? few_row_isa() : kernel_name;
  TORCH_CHECK(kernel_built(kernel), "pack_bf16: this build has no few-row kernel '", kernel, "'");
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
  if (kernel == "avx512_bf16") return out;
  at::Tensor lanes = out.view(at::kInt);                                    // [NG, KP, 2, 16, 1]
  return kernel == "avx512f" ? lanes.view({NG, KP, 2, 16}) : lanes.view({NG, KP, 4, 8});
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
#endif

#ifdef E3_AVX2
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

namespace {
enum class Layout { Dot, Widen16, Widen8, Other };

// which kernel reads a weight packed by pack_bf16 (see there)
Layout layout_of(const at::Tensor& packed) {
  if (packed.scalar_type() == at::kBFloat16 && packed.dim() == 5 && packed.size(2) == 2 && packed.size(3) == 16 &&
      packed.size(4) == 2)
    return Layout::Dot;
  if (packed.scalar_type() == at::kInt && packed.dim() == 4 && packed.size(2) == 2 && packed.size(3) == 16)
    return Layout::Widen16;
  if (packed.scalar_type() == at::kInt && packed.dim() == 4 && packed.size(2) == 4 && packed.size(3) == 8)
    return Layout::Widen8;
  return Layout::Other;
}

#ifdef E3_BF16DOT
void linear_dot(const uint16_t* xp, int64_t M, int64_t Kx, const uint16_t* P, int64_t NG, int64_t KP,
                const float* bias, at::BFloat16* y, int64_t N) {
  constexpr int64_t MT_MAX = 12;   // 2 x 12 accumulators of 16 lanes
  // passes of up to MT_MAX rows, as even as possible (16 rows with 12: 8 + 8, not 12 + 4)
  const int64_t passes = (M + MT_MAX - 1) / MT_MAX, per_pass = (M + passes - 1) / passes;
  at::parallel_for(0, NG, 2, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t m0 = 0; m0 < M; m0 += per_pass)
        dot_rows(std::min(per_pass, M - m0), xp, Kx, reinterpret_cast<const __m512bh*>(P) + g * KP * 2, KP, bias, y,
                 N, 32 * g, m0);
  });
}
#endif

#ifdef E3_AVX2
void linear_widen8(const float* xf, int64_t M, int64_t Kx, const uint16_t* P, int64_t NG, int64_t KP,
                   const float* bias, at::BFloat16* y, int64_t N) {
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
        fma_rows(starts[i + 1] - starts[i], xf, Kx, P + g * KP * 64, KP, bias, y, N, 32 * g, starts[i],
                 i + 2 == starts.size() && g + 1 < g1 ? P + (g + 1) * KP * 64 : nullptr);   // last pass: next group
  });
}
#endif

// Up to this many rows the AVX-512F layout is multiplied by the AVX2 kernel (the same bytes, the same sums per
// output, so the same bits): up to ~5 rows a product is bound by memory, and the 256-bit loop streamed the weights
// faster than the 512-bit one (a Xeon with AMX running an AVX-512F-only build, the linears of a SmolLM2 step, the
// two alternated in one process: one row 14.7 vs 15.5 ms, 3 rows 16.1 vs 18.4, 5 rows 18.9 vs 19.3; 6 rows 25.8 vs
// 20.4). Likely the 512-bit FMAs' lower clock: at a few rows the core only waits for memory.
constexpr int64_t WIDEN8_MAX_ROWS = 5;

// x [M, Kx] bf16 -> fp32 (exact: bf16 is fp32's upper half)
std::vector<float> widen(const uint16_t* xp, int64_t n) {
  std::vector<float> xf(n);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = uint32_t(xp[i]) << 16;
    std::memcpy(&xf[i], &bits, 4);
  }
  return xf;
}
}  // namespace

// x [M, K] bf16 @ W^T with W packed by pack_bf16 -> y [M, N] bf16 (fp32 accumulation; bias fp32 or none): the
// kernel the weight was packed for (a weight packed by pack_amx goes to amx_linear.cpp's tile kernel)
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
  if (is_amx_packed(packed)) return linear_amx(x, packed, N, bias);
  const Layout layout = layout_of(packed);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && layout != Layout::Other,
              "linear_bf16: x [M, K] bf16 and a weight packed by pack_bf16");
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
  const void* P = packed.data_ptr();                                         // 64 bf16 values per (group, pair)
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  switch (layout) {
#ifdef E3_BF16DOT
    case Layout::Dot:
      linear_dot(xp, M, Kx, static_cast<const uint16_t*>(P), NG, KP, bp, yp, N);
      return y;
#endif
#ifdef E3_AVX512
    case Layout::Widen16:
#ifdef E3_AVX2
      if (M <= WIDEN8_MAX_ROWS) {         // the same sums on 256-bit vectors: faster while memory bound (below)
        linear_widen8(widen(xp, M * Kx).data(), M, Kx, static_cast<const uint16_t*>(P), NG, KP, bp, yp, N);
        return y;
      }
#endif
      linear_widen16(widen(xp, M * Kx).data(), M, Kx, static_cast<const int32_t*>(P), NG, KP, bp, yp, N);
      return y;
#endif
#ifdef E3_AVX2
    case Layout::Widen8:
      linear_widen8(widen(xp, M * Kx).data(), M, Kx, static_cast<const uint16_t*>(P), NG, KP, bp, yp, N);
      return y;
#endif
    default:
      TORCH_CHECK(false, "linear_bf16: this build lacks the kernel the weight was packed for (compile with "
                         "-march=native on the machine that runs it)");
  }
  return y;
}

// the build's default few-row kernel: "avx512_bf16", "avx512f", "avx2" or "" (none)
std::string few_row_isa() {
  const std::vector<std::string> built = few_row_kernels();
  return built.empty() ? "" : built.front();
}

// every few-row kernel this build holds (pack_bf16 packs for any of them), the fastest first
std::vector<std::string> few_row_kernels() {
  std::vector<std::string> out;
#ifdef E3_BF16DOT
  out.push_back("avx512_bf16");
#endif
#ifdef E3_AVX512
  out.push_back("avx512f");
#endif
#ifdef E3_AVX2
  out.push_back("avx2");
#endif
  return out;
}

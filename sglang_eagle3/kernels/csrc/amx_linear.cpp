// bf16 matrix products for few rows on CPUs with AMX (Intel's tile units): decode, tree verify and draft steps.
//
// Why: the AVX-512 BF16 dot-product kernel in linear.cpp reads each weight once per call and is limited by
// memory at one row, but by its dot-product throughput from ~4 rows on (a verify of 8 tokens then costs 1.7x a
// one-token step). A tile multiply (TDPBF16PS) does 16 x 16 x 32 products per instruction, so up to 16 rows
// (and in passes, more) cost what one row costs: the weight stream.
//
// pack_amx(W [N, K]) -> P [N/64, K/32, 4, 16, 16, 2]: output columns in chunks of 64 (four tiles of 16), input
// in slices of 32. P[c, s, j, r, n, e] = W[64c + 16j + n, 32s + 2r + e], zero where out of range: tile j of chunk c
// and slice s is one 1 KB block in the VNNI layout TDPBF16PS reads as its B operand, and a chunk's blocks are
// one sequential stream. y = x @ W^T: x is copied into a zero-padded [16-row multiple, K/32 * 32] buffer (the A
// tiles), each chunk accumulates four 16 x 16 fp32 tiles over the slices, then adds the bias and rounds to bf16
// (nearest even). Each output element sums over k in the same order whatever the number of rows, so a row's
// result does not depend on the rows that come with it (decode and verify round alike).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "ops.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define E3_AMX 1
#endif

namespace {
constexpr int64_t CHUNK = 64, SLICE = 32, TILE_ROWS = 16;

#ifdef E3_AMX
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: C (rows x 16 fp32), 4: A (rows x 32 bf16), 5-6: B (16 pairs x 16 columns x 2 bf16)
void load_tile_config(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = t < 5 ? rows : TILE_ROWS;
    cfg.colsb[t] = 64;
  }
  // GCC's ldtilecfg builtin does not tell the optimiser that it reads cfg: a configuration of constants was seen
  // removed as dead stores (tiles left unconfigured: SIGILL at the first tile load). The barrier keeps them.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Linux keeps tile data off until a process asks (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
bool request_tile_permission() {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// Software prefetch of the weight stream, in bytes ahead of the slice being multiplied: a slice's four B tiles are
// one 4 KB block, i.e. one page, and the L2 streamer stops at page boundaries, so each new page started cold.
// One slice ahead into L1 and four ahead into L2, 64 lines each (2 cores of an Intel Xeon with AMX, 30 layers of
// SmolLM2-135M + its head, 269 MB: one row 18.1 -> 12.9 ms, 8 rows 17.9 -> 13.7 ms; T0 alone 4 KB ahead 14.3 ms,
// every 2nd or 4th line only 17.6-18.6 ms).
constexpr int64_t PREFETCH_L1 = 4096, PREFETCH_L2 = 16384, SLICE_BYTES = 4 * 512 * 2;

// rows mb*16 .. +16 of x (its row stride Kp, a multiple of 32) against chunk c: four C tiles over KS slices,
// then bias + bf16 rounding of the M rows that exist. Chunks follow one another in P, so the prefetch runs on
// into the next chunk; later row blocks (mb > 0) read the chunk from L2 and prefetch nothing.
inline void chunk_product(const at::BFloat16* xpad, int64_t Kp, const at::BFloat16* P, int64_t KS, int64_t c,
                          int64_t mb, int64_t M, const float* bias, at::BFloat16* y, int64_t N, float* cbuf) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const at::BFloat16* a = xpad + mb * TILE_ROWS * Kp;
  const at::BFloat16* b = P + c * KS * 4 * 512;
  for (int64_t s = 0; s < KS; ++s, b += 4 * 512) {
    if (mb == 0) {                                  // prefetches never fault, past the weight's end included
      const char* bytes = reinterpret_cast<const char*>(b);
      for (int64_t l = 0; l < SLICE_BYTES; l += 64) {
        _mm_prefetch(bytes + PREFETCH_L1 + l, _MM_HINT_T0);
        _mm_prefetch(bytes + PREFETCH_L2 + l, _MM_HINT_T1);
      }
    }
    _tile_loadd(4, a + s * SLICE, Kp * 2);
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 512, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 1024, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, b + 1536, 64);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, cbuf, CHUNK * 4);                 // cbuf [16, 64] fp32: tile j holds columns 16j..16j+15
  _tile_stored(1, cbuf + 16, CHUNK * 4);
  _tile_stored(2, cbuf + 32, CHUNK * 4);
  _tile_stored(3, cbuf + 48, CHUNK * 4);
  const int64_t rows = std::min<int64_t>(TILE_ROWS, M - mb * TILE_ROWS);
  for (int j = 0; j < 4; ++j) {
    const int64_t n0 = c * CHUNK + 16 * j, valid = std::min<int64_t>(16, N - n0);
    if (valid <= 0) break;
    const __mmask16 keep = valid == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(cbuf + r * CHUNK + 16 * j), bv);
      __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
      _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(y + (mb * TILE_ROWS + r) * N + n0), keep, h);
    }
  }
}
#endif
}  // namespace

bool amx_usable() {
#ifdef E3_AMX
  static const bool ok = request_tile_permission();
  return ok;
#else
  return false;
#endif
}

at::Tensor pack_amx(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_amx: a [N, K] bfloat16 weight");
  const int64_t N = w.size(0), K = w.size(1), NC = (N + CHUNK - 1) / CHUNK, KS = (K + SLICE - 1) / SLICE;
  at::Tensor wc = w.contiguous();
  at::Tensor out = at::zeros({NC, KS, 4, 16, 16, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, NC, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t s = 0; s < KS; ++s)
        for (int64_t j = 0; j < 4; ++j)
          for (int64_t r = 0; r < 16; ++r)
            for (int64_t n = 0; n < 16; ++n)
              for (int64_t e = 0; e < 2; ++e) {
                const int64_t row = c * CHUNK + 16 * j + n, col = s * SLICE + 2 * r + e;
                if (row < N && col < K)
                  dst[(((((c * KS + s) * 4 + j) * 16 + r) * 16 + n) * 2) + e] = src[row * K + col];
              }
  });
  return out;
}

bool is_amx_packed(const at::Tensor& packed) {
  return packed.dim() == 6 && packed.size(2) == 4 && packed.size(3) == 16 && packed.size(4) == 16 &&
         packed.size(5) == 2;
}

// x [M, K] bf16 @ W^T, W packed by pack_amx -> y [M, N] bf16 (fp32 accumulation; bias fp32 or none)
at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
#ifdef E3_AMX
  TORCH_CHECK(amx_usable(), "linear_amx: the OS refused AMX tile data (arch_prctl)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
              is_amx_packed(packed), "linear_amx: x [M, K] bf16 and a weight packed by pack_amx");
  const int64_t M = x.size(0), K = x.size(1), NC = packed.size(0), KS = packed.size(1);
  TORCH_CHECK((K + SLICE - 1) / SLICE == KS && (N + CHUNK - 1) / CHUNK == NC, "linear_amx: weight packed for another shape");
  if (M == 0) return at::empty({0, N}, x.options());
  const int64_t Kp = KS * SLICE, MB = (M + TILE_ROWS - 1) / TILE_ROWS;
  // tiles of min(M, 16) rows read x in place; a K off the slice grid, or a last block of fewer than 16 rows
  // after full ones, reads a zero-padded copy instead
  const int tile_rows = M < TILE_ROWS ? (int)M : (int)TILE_ROWS;
  at::Tensor xpad = x.contiguous();
  if (Kp != K || (M > TILE_ROWS && M % TILE_ROWS)) {
    xpad = at::zeros({MB * TILE_ROWS, Kp}, x.options());
    xpad.narrow(0, 0, M).narrow(1, 0, K).copy_(x);
  }
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor bf;
  if (bias && bias->defined()) bf = bias->to(at::kFloat).contiguous();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const at::BFloat16* xp = xpad.data_ptr<at::BFloat16>();
  const at::BFloat16* P = packed.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, NC, 1, [&](int64_t c0, int64_t c1) {
    alignas(64) float cbuf[TILE_ROWS * CHUNK];
    load_tile_config(tile_rows);                  // per thread: tile state is thread-local
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t mb = 0; mb < MB; ++mb)         // later row blocks read the chunk's weights from L2
        chunk_product(xp, Kp, P, KS, c, mb, M, bp, yp, N, cbuf);
    _tile_release();
  });
  return y;
#else
  TORCH_CHECK(false, "linear_amx: this build has no AMX (compile with -march=native on such a CPU)");
#endif
}

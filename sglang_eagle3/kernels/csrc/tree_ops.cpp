// The draft tree's bookkeeping on the CPU: a speculative step at batch 1 spent more time launching the ~60 small
// tensor ops of tree selection than computing them. One call, the same result as its PyTorch twin in tree.py
// (tests compare both): the top-k of a level, the selection and layout of the tree, greedy acceptance.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace e3;

// per row of x [R, V]: the k largest values of log_softmax(x) (fp32, larger first; equal values: smaller index
// first) and their indices
template <typename E>
void topk_logprobs_impl(const E* x, int64_t R, int64_t V, int64_t k, float* vals, int64_t* ids) {
  std::vector<float> best(k);
  std::vector<int64_t> arg(k);
  for (int64_t r = 0; r < R; ++r) {
    const E* xr = x + r * V;
    const float mx = row_max(xr, V);
    float sum = 0.f;
    int64_t j = 0;
#ifdef E3_AVX512
    __m512 vs = _mm512_setzero_ps();
    const __m512 vmx = _mm512_set1_ps(mx);
    for (; j + 16 <= V; j += 16) vs = _mm512_add_ps(vs, exp16(_mm512_sub_ps(load16(xr + j), vmx)));
    sum = _mm512_reduce_add_ps(vs);
#endif
    double tail = 0.0;                 // without AVX-512 the whole row: a double sum keeps it to fp32 rounding
    for (; j < V; ++j) tail += std::exp(to_f(xr[j]) - mx);
    sum += static_cast<float>(tail);
    // top-k by insertion into a sorted list of k: a value enters only if larger than the current k-th
    std::fill(best.begin(), best.end(), -std::numeric_limits<float>::infinity());
    std::fill(arg.begin(), arg.end(), -1);
    auto offer = [&](float v, int64_t i) {
      if (!(v > best[k - 1]) && arg[k - 1] >= 0) return;
      int64_t p = k - 1;
      while (p > 0 && (v > best[p - 1] || arg[p - 1] < 0)) { best[p] = best[p - 1]; arg[p] = arg[p - 1]; --p; }
      best[p] = v;
      arg[p] = i;
    };
    j = 0;
#ifdef E3_AVX512
    for (; j + 16 <= V; j += 16) {
      const __m512 v = load16(xr + j);
      __mmask16 hit = arg[k - 1] < 0 ? (__mmask16)0xFFFF : _mm512_cmp_ps_mask(v, _mm512_set1_ps(best[k - 1]), _CMP_GT_OQ);
      while (hit) {
        const int lane = __builtin_ctz(hit);
        hit &= hit - 1;
        offer(to_f(xr[j + lane]), j + lane);
      }
    }
#endif
    for (; j < V; ++j) offer(to_f(xr[j]), j);
    const float log_sum = std::log(sum);
    for (int64_t i = 0; i < k; ++i) {
      ids[r * k + i] = arg[i];
      vals[r * k + i] = (best[i] - mx) - log_sum;             // log_softmax's order: (x - max) - log(sum)
    }
  }
}


// out[j] = exp((z[j] - mx) * inv_t) for z[0:V] (exactly 0 where z is -inf); returns their sum
template <typename E>
double exp_row(const E* z, int64_t V, float mx, float inv_t, float* out) {
  double sum = 0.0;
  int64_t j = 0;
#ifdef E3_AVX512
  const __m512 vm = _mm512_set1_ps(mx), vt = _mm512_set1_ps(inv_t);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (; j + 16 <= V; j += 16) {
    const __m512 x = load16(z + j);
    const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ),
                                         exp16(_mm512_mul_ps(_mm512_sub_ps(x, vm), vt)));
    _mm512_storeu_ps(out + j, e);
    sum += _mm512_reduce_add_ps(e);
  }
#elif defined(E3_AVX2)
  const __m256 vm = _mm256_set1_ps(mx), vt = _mm256_set1_ps(inv_t);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (; j + 8 <= V; j += 8) {
    const __m256 x = load8(z + j);
    const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), exp8(_mm256_mul_ps(_mm256_sub_ps(x, vm), vt)));
    _mm256_storeu_ps(out + j, e);
    sum += hsum8(e);
  }
#endif
  for (; j < V; ++j) {
    const float x = to_f(z[j]);
    out[j] = x == -std::numeric_limits<float>::infinity() ? 0.f : std::exp((x - mx) * inv_t);
    sum += out[j];
  }
  return sum;
}

// sum of x[0:n], n <= 16 (one vector on AVX-512)
inline double block_sum(const float* x, int64_t n) {
#ifdef E3_AVX512
  const __mmask16 m = static_cast<__mmask16>(n == 16 ? 0xffff : (1u << n) - 1);
  return _mm512_reduce_add_ps(_mm512_maskz_loadu_ps(m, x));
#else
  double s = 0.0;
  for (int64_t j = 0; j < n; ++j) s += x[j];
  return s;
#endif
}

// Nucleus / top-k filter of e[0:V] (exp of the scaled logits, all >= 0) in place, as verify.target_probs filters:
// top_k > 0 keeps the values >= the k-th largest (ties at it all kept), then top_p < 1 keeps the largest values
// while the mass before them is < top_p of the total (ties in value: the smaller index first). Returns the kept
// total. Values are bucketed by their float bits (monotone for values >= 0), so no sort of the vocabulary: only
// the one bucket the cut falls in is sorted.
double filter_top(float* e, int64_t V, int64_t top_k, double top_p, double total) {
  constexpr int SHIFT = 19, NB = 1 << (31 - SHIFT);          // exponent + 4 mantissa bits: 4,096 buckets
  auto bucket = [](float x) { uint32_t u; std::memcpy(&u, &x, 4); return static_cast<int>(u >> SHIFT); };
  std::vector<double> mass(NB);
  std::vector<int64_t> count(NB);
  auto histogram = [&] {
    std::fill(mass.begin(), mass.end(), 0.0);
    std::fill(count.begin(), count.end(), 0);
    for (int64_t j = 0; j < V; ++j)
      if (e[j] > 0.f) { mass[bucket(e[j])] += e[j]; ++count[bucket(e[j])]; }
  };
  auto sorted_bucket = [&](int b) {     // bucket b's values, value descending, index ascending
    std::vector<std::pair<float, int64_t>> in;
    for (int64_t j = 0; j < V; ++j)
      if (e[j] > 0.f && bucket(e[j]) == b) in.push_back({e[j], j});
    std::sort(in.begin(), in.end(), [](const auto& x, const auto& y) {
      return x.first > y.first || (x.first == y.first && x.second < y.second);
    });
    return in;
  };
  histogram();
  if (top_k > 0) {                      // the bucket holding the k-th largest value, then that value
    int64_t above = 0;
    int b = NB - 1;
    for (; b >= 0 && above + count[b] < top_k; --b) above += count[b];
    if (b >= 0) {
      const float kth = sorted_bucket(b)[top_k - above - 1].first;
      total = 0.0;
      for (int64_t j = 0; j < V; ++j) {
        if (e[j] < kth) e[j] = 0.f;
        total += e[j];
      }
      if (top_p < 1.0) histogram();
    }
  }
  if (top_p < 1.0) {                    // the bucket in which the mass before a value reaches the limit
    const double limit = top_p * total;
    double before = 0.0;
    int b = NB - 1;
    for (; b >= 0 && before + mass[b] < limit; --b) before += mass[b];
    if (b >= 0) {
      const auto in = sorted_bucket(b);
      size_t take = 0;
      for (; take < in.size() && before < limit; ++take) before += in[take].first;
      for (size_t i = take; i < in.size(); ++i) e[in[i].second] = 0.f;
      total = 0.0;
      for (int64_t j = 0; j < V; ++j) {
        if (e[j] > 0.f && bucket(e[j]) < b) e[j] = 0.f;
        total += e[j];
      }
    }
  }
  return total;
}

}  // namespace

// logits [..., V] (float32 / bfloat16) -> (the k largest of log_softmax(logits.float()) [..., k] fp32, their indices
// [..., k] int64), larger first: one pass per row instead of a cast, a log_softmax and a topk.
std::vector<at::Tensor> topk_logprobs(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() >= 1, "topk_logprobs: a CPU tensor [..., V]");
  const int64_t V = logits.size(-1);
  TORCH_CHECK(k >= 1 && k <= V, "topk_logprobs: k must be in [1, V]");
  at::Tensor x = logits.contiguous();
  const int64_t R = x.numel() / V;
  auto shape = logits.sizes().vec();
  shape.back() = k;
  at::Tensor vals = at::empty(shape, logits.options().dtype(at::kFloat));
  at::Tensor ids = at::empty(shape, logits.options().dtype(at::kLong));
  E3_DISPATCH(x.scalar_type(), "topk_logprobs", [&] {
    topk_logprobs_impl<scalar_t>(x.data_ptr<scalar_t>(), R, V, k, vals.data_ptr<float>(), ids.data_ptr<int64_t>());
  });
  return {vals, ids};
}

// build_draft_tree's selection and layout (tree.py): the n = min(num_draft_tokens - 1, C) best candidates by
// score (stable: on equal scores the earlier candidate), in creation order, under the root.
// cand_tokens, cand_parents [B, C] int64 (parent -1 = root), cand_scores [B, C] fp32, root_tokens, root_positions [B].
// row_nodes [B] (optional, each in [1, N]): row b takes only its row_nodes[b] - 1 best; its nodes past them are
// padding: the root's token and position, parent -1 (no walk reaches them), depth 0, seeing only themselves.
// Returns tokens, parents, depth, positions [B, N] int64 and mask [B, N, N] bool (N = n + 1).
std::vector<at::Tensor> build_tree(const at::Tensor& cand_tokens, const at::Tensor& cand_scores,
                                   const at::Tensor& cand_parents, const at::Tensor& root_tokens,
                                   const at::Tensor& root_positions, int64_t num_draft_tokens,
                                   const c10::optional<at::Tensor>& row_nodes) {
  TORCH_CHECK(cand_tokens.dim() == 2 && cand_tokens.sizes() == cand_scores.sizes() &&
              cand_tokens.sizes() == cand_parents.sizes(), "build_tree: candidates must be [B, C]");
  TORCH_CHECK(cand_tokens.scalar_type() == at::kLong && cand_parents.scalar_type() == at::kLong &&
              cand_scores.scalar_type() == at::kFloat && root_tokens.scalar_type() == at::kLong &&
              root_positions.scalar_type() == at::kLong, "build_tree: int64 tokens/parents/roots, fp32 scores");
  const int64_t B = cand_tokens.size(0), C = cand_tokens.size(1);
  TORCH_CHECK(root_tokens.numel() == B && root_positions.numel() == B, "build_tree: one root per row");
  const int64_t n = std::max<int64_t>(0, std::min<int64_t>(num_draft_tokens - 1, C)), N = n + 1;
  at::Tensor rn;
  if (row_nodes && row_nodes->defined()) {
    rn = row_nodes->to(at::kLong).contiguous();
    TORCH_CHECK(rn.numel() == B, "build_tree: row_nodes must hold one count per row");
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(rn.data_ptr<int64_t>()[b] >= 1 && rn.data_ptr<int64_t>()[b] <= N, "build_tree: row_nodes[", b,
                  "] = ", rn.data_ptr<int64_t>()[b], " outside [1, ", N, "]");
  }
  at::Tensor ct = cand_tokens.contiguous(), cs = cand_scores.contiguous(), cp = cand_parents.contiguous();
  at::Tensor rt = root_tokens.contiguous(), rp = root_positions.contiguous();
  auto opt = cand_tokens.options();
  at::Tensor tokens = at::empty({B, N}, opt), parents = at::empty({B, N}, opt), depth = at::empty({B, N}, opt);
  at::Tensor positions = at::empty({B, N}, opt), mask = at::zeros({B, N, N}, opt.dtype(at::kBool));
  const int64_t *ctp = ct.data_ptr<int64_t>(), *cpp = cp.data_ptr<int64_t>();
  const float* csp = cs.data_ptr<float>();
  int64_t *tk = tokens.data_ptr<int64_t>(), *pa = parents.data_ptr<int64_t>(), *de = depth.data_ptr<int64_t>();
  int64_t* po = positions.data_ptr<int64_t>();
  bool* mk = mask.data_ptr<bool>();
  std::vector<int64_t> order(C), node_of(C);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nb = rn.defined() ? rn.data_ptr<int64_t>()[b] - 1 : n;   // this row's candidates
    const float* s = csp + b * C;
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return s[x] > s[y]; });
    std::sort(order.begin(), order.begin() + nb);                  // the chosen, in creation order
    std::fill(node_of.begin(), node_of.end(), -1);
    for (int64_t i = 0; i < nb; ++i) node_of[order[i]] = i + 1;
    int64_t *t = tk + b * N, *p = pa + b * N, *d = de + b * N, *q = po + b * N;
    bool* m = mk + b * N * N;
    t[0] = rt.data_ptr<int64_t>()[b];
    p[0] = -1;
    d[0] = 0;
    m[0] = true;
    for (int64_t i = 1; i <= nb; ++i) {
      const int64_t c = order[i - 1], pc = cpp[b * C + c];
      const int64_t parent = pc < 0 ? 0 : node_of[pc];
      TORCH_CHECK(parent >= 0 && parent < i, "draft tree selection is not closed under ancestors");
      t[i] = ctp[b * C + c];
      p[i] = parent;
      d[i] = d[parent] + 1;
      std::copy(m + parent * N, m + parent * N + N, m + i * N);  // the parent's ancestors, then itself
      m[i * N + i] = true;
    }
    for (int64_t i = nb + 1; i < N; ++i) {                       // padding
      t[i] = t[0];
      p[i] = -1;
      d[i] = 0;
      m[i * N + i] = true;
    }
    const int64_t root_pos = rp.data_ptr<int64_t>()[b];
    for (int64_t i = 0; i < N; ++i) q[i] = root_pos + d[i];
  }
  return {tokens, parents, depth, mask, positions};
}

// Greedy acceptance (verify.accept_greedy) straight from the target's logits: walk from the root, at each node take
// the target's argmax (the first maximum) and move to the child drafting it; the argmax is computed only at the
// nodes the walk visits. tokens, parents [B, N] int64 (parents precede children, siblings distinct); logits
// [B, N, V] float32 / bfloat16. Returns path [B, N] (accepted nodes, then j at j >= count), count [B] and
// emitted [B, N] (accepted draft tokens, then the bonus token; past it the tokens accept_greedy leaves there).
std::vector<at::Tensor> accept_greedy(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& logits) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.sizes() == parents.sizes() && tokens.scalar_type() == at::kLong &&
              parents.scalar_type() == at::kLong, "accept_greedy: tokens, parents must be int64 [B, N]");
  TORCH_CHECK(logits.dim() == 3 && logits.size(0) == tokens.size(0) && logits.size(1) == tokens.size(1) &&
              logits.device().is_cpu(), "accept_greedy: logits must be a CPU [B, N, V]");
  const int64_t B = tokens.size(0), N = tokens.size(1), V = logits.size(2);
  at::Tensor tk = tokens.contiguous(), pa = parents.contiguous(), z = logits.contiguous();
  at::Tensor path = at::empty({B, N}, tokens.options()), count = at::empty({B}, tokens.options());
  at::Tensor emitted = at::empty({B, N}, tokens.options());
  const int64_t *t = tk.data_ptr<int64_t>(), *p = pa.data_ptr<int64_t>();
  int64_t *pt = path.data_ptr<int64_t>(), *ct = count.data_ptr<int64_t>(), *em = emitted.data_ptr<int64_t>();
  E3_DISPATCH(z.scalar_type(), "accept_greedy", [&] {
    const scalar_t* zp = z.data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t *tb = t + b * N, *pb = p + b * N;
      int64_t *path_b = pt + b * N, n = 0, node = 0, bonus = 0;
      path_b[n++] = 0;
      while (true) {
        bonus = argmax_row(zp + (b * N + node) * V, V);
        int64_t next = -1;
        for (int64_t c = node + 1; c < N; ++c)
          if (pb[c] == node && tb[c] == bonus) { next = c; break; }
        if (next < 0) break;
        path_b[n++] = next;
        node = next;
      }
      ct[b] = n;
      for (int64_t j = n; j < N; ++j) path_b[j] = j;
      int64_t* eb = em + b * N;
      for (int64_t j = 0; j < N; ++j) eb[j] = j == n - 1 ? bonus : tb[path_b[std::min(j + 1, N - 1)]];
    }
  });
  return {path, count, emitted};
}

// The bonus token of a walk: drawn from the residual r [V] (unnormalised, >= 0) by its inverse CDF at u in [0, 1),
// over blocks of 16 (block sums first: their total is the residual's; then the block holding u * total, element by
// element). refill() rewrites r when it holds no mass. Returns -1 when r holds none even then.
template <typename Refill>
int64_t draw_residual(float* r, int64_t V, std::vector<double>& block, double u, Refill refill) {
  const int64_t nb = (V + 15) / 16;
  block.assign(nb, 0.0);
  double total = 0.0;
  for (int pass = 0; pass < 2 && !(total > 0); ++pass) {
    if (pass == 1) refill();
    total = 0.0;
    for (int64_t i = 0; i < nb; ++i) {
      block[i] = block_sum(r + i * 16, std::min<int64_t>(16, V - i * 16));
      total += block[i];
    }
  }
  if (!(total > 0)) return -1;
  const double target = u * total;
  double acc = 0.0;
  int64_t b = 0, with_mass = 0, bonus = -1;
  for (; b < nb; ++b) {                     // the first block whose end passes the target
    if (block[b] > 0) with_mass = b;
    if (block[b] > 0 && acc + block[b] > target) break;
    acc += block[b];
  }
  if (b == nb)                              // u * total rounded up to the total: the last token with mass
    b = with_mass, acc = -std::numeric_limits<double>::infinity();
  const int64_t j0 = b * 16, j1 = std::min<int64_t>(V, j0 + 16);
  for (int64_t j = j0; j < j1; ++j) {       // inside the block element by element (rounding: its last token
    if (r[j] <= 0.f) continue;              // with mass)
    if (acc > target) break;
    acc += r[j];
    bonus = j;
  }
  return bonus;
}

// Tree speculative sampling of one row (verify.verify_sampling with p = target_probs: softmax(logits / temperature),
// top_k > 0 and top_p < 1 filtered as there, at each node)
// without a probability tensor: one exp pass over the vocabulary per visited node. At a node, its children (in index
// order) are tried in turn: child c is accepted with probability r(c) / sum(r), r starting as p, a rejected child's
// mass removed from r; when none is accepted the bonus token is drawn from r by its inverse CDF. tokens, parents
// [N] int64 (parents precede children, siblings distinct); logits [N, V] float32 / bfloat16; uniforms [N] float64
// in [0, 1): one per child tried, then one for the bonus (at most N are used). Returns (accepted nodes [count],
// starting with the root; the bonus token [1]).
std::vector<at::Tensor> accept_sampling(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& logits,
                                        double temperature, int64_t top_k, double top_p, const at::Tensor& uniforms) {
  TORCH_CHECK(tokens.dim() == 1 && tokens.sizes() == parents.sizes() && tokens.scalar_type() == at::kLong &&
              parents.scalar_type() == at::kLong, "accept_sampling: tokens, parents must be int64 [N]");
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == tokens.size(0) && logits.device().is_cpu(),
              "accept_sampling: logits must be a CPU [N, V]");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) >= tokens.size(0) && uniforms.scalar_type() == at::kDouble,
              "accept_sampling: uniforms must be float64 [>= N]");
  TORCH_CHECK(temperature > 0, "accept_sampling: temperature must be > 0");
  const int64_t N = tokens.size(0), V = logits.size(1);
  at::Tensor tk = tokens.contiguous(), pa = parents.contiguous(), z = logits.contiguous(), uu = uniforms.contiguous();
  const int64_t *t = tk.data_ptr<int64_t>(), *p = pa.data_ptr<int64_t>();
  const double* u = uu.data_ptr<double>();
  const float inv_t = static_cast<float>(1.0 / temperature);
  std::vector<float> r(V);
  std::vector<double> block;
  std::vector<int64_t> nodes{0};
  int64_t bonus = -1;
  E3_DISPATCH(z.scalar_type(), "accept_sampling", [&] {
    const scalar_t* zp = z.data_ptr<scalar_t>();
    int64_t node = 0, k = 0;
    while (bonus < 0) {
      const scalar_t* row = zp + node * V;
      const float mx = row_max(row, V);
      double left = exp_row(row, V, mx, inv_t, r.data());       // the residual's total (unnormalised)
      if (top_k > 0 || top_p < 1.0) left = filter_top(r.data(), V, top_k, top_p, left);
      int64_t next = -1;
      for (int64_t c = node + 1; c < N && next < 0; ++c) {
        if (p[c] != node) continue;
        const double rc = r[t[c]];
        if (u[k++] * left < rc) {
          next = c;
        } else {
          left -= rc;
          r[t[c]] = 0.f;
        }
      }
      if (next >= 0) {
        nodes.push_back(next);
        node = next;
        continue;
      }
      bonus = draw_residual(r.data(), V, block, u[k++], [&] {      // all of p drafted and rejected: p itself
        const double all = exp_row(row, V, mx, inv_t, r.data());
        if (top_k > 0 || top_p < 1.0) filter_top(r.data(), V, top_k, top_p, all);
      });
      TORCH_CHECK(bonus >= 0, "accept_sampling: node ", node, " has no probability mass (logits all -inf)");
    }
  });
  return {torch::tensor(nodes, tokens.options()), torch::tensor({bonus}, tokens.options())};
}

// A tree with sampled children, verified by recursive rejection sampling (engine/sampled_tree.py's walk, same law):
// at a node with target distribution p (as accept_sampling's) its deterministic children (drawn_from < 0) are tried
// first, each accepted with r(x) / sum(r) and zeroed from r when rejected; then its sampled children in draw order
// against the q they were drawn from (draft_q[drawn_from], over the draft vocabulary; draft_targets maps a draft id
// to its target id): child x is accepted with min(1, p_i(x) / q_i(x)); on rejection p_{i+1} = max(0, p_i - q_i)
// (only the draft vocabulary's entries change) and q_{i+1} = q_i without x. The bonus is drawn from the last residual.
// tokens, parents, drawn_from [N] int64; logits [N, V]; draft_q [S, Vd] float32 (zero at the node's deterministic
// children); uniforms [N] float64 (one per child tried, then one for the bonus). Returns (accepted nodes, bonus [1]).
std::vector<at::Tensor> accept_sampled_tree(const at::Tensor& tokens, const at::Tensor& parents,
                                            const at::Tensor& drawn_from, const at::Tensor& logits, double temperature,
                                            int64_t top_k, double top_p, const at::Tensor& draft_q,
                                            const at::Tensor& draft_targets, const at::Tensor& uniforms) {
  TORCH_CHECK(tokens.dim() == 1 && tokens.sizes() == parents.sizes() && tokens.sizes() == drawn_from.sizes() &&
              tokens.scalar_type() == at::kLong && parents.scalar_type() == at::kLong &&
              drawn_from.scalar_type() == at::kLong, "accept_sampled_tree: tokens, parents, drawn_from: int64 [N]");
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == tokens.size(0) && logits.device().is_cpu(),
              "accept_sampled_tree: logits must be a CPU [N, V]");
  TORCH_CHECK(draft_q.dim() == 2 && draft_q.scalar_type() == at::kFloat && draft_targets.dim() == 1 &&
              draft_targets.scalar_type() == at::kLong && draft_targets.size(0) == draft_q.size(1),
              "accept_sampled_tree: draft_q float32 [S, Vd], draft_targets int64 [Vd]");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) >= tokens.size(0) && uniforms.scalar_type() == at::kDouble,
              "accept_sampled_tree: uniforms must be float64 [>= N]");
  TORCH_CHECK(temperature > 0, "accept_sampled_tree: temperature must be > 0");
  const int64_t N = tokens.size(0), V = logits.size(1), S = draft_q.size(0), Vd = draft_q.size(1);
  at::Tensor tk = tokens.contiguous(), pa = parents.contiguous(), df = drawn_from.contiguous(), z = logits.contiguous();
  at::Tensor dq = draft_q.contiguous(), dt = draft_targets.contiguous(), uu = uniforms.contiguous();
  const int64_t *t = tk.data_ptr<int64_t>(), *p = pa.data_ptr<int64_t>(), *from = df.data_ptr<int64_t>();
  const int64_t* targets = dt.data_ptr<int64_t>();
  const float* qall = dq.data_ptr<float>();
  const double* u = uu.data_ptr<double>();
  for (int64_t j = 0; j < Vd; ++j)
    TORCH_CHECK(targets[j] >= 0 && targets[j] < V, "accept_sampled_tree: draft id ", j, " maps outside the vocabulary");
  const float inv_t = static_cast<float>(1.0 / temperature);
  std::vector<float> r(V);
  std::vector<double> q(Vd), block;
  std::vector<int64_t> nodes{0}, kids;
  std::vector<int64_t> draft_id(V, -1);                         // target id -> draft id, for the sampled children
  for (int64_t j = 0; j < Vd; ++j) draft_id[targets[j]] = j;
  int64_t bonus = -1;
  E3_DISPATCH(z.scalar_type(), "accept_sampled_tree", [&] {
    const scalar_t* zp = z.data_ptr<scalar_t>();
    int64_t node = 0, k = 0;
    while (bonus < 0) {
      const scalar_t* row = zp + node * V;
      const float mx = row_max(row, V);
      double left = exp_row(row, V, mx, inv_t, r.data());       // the residual's total (unnormalised)
      if (top_k > 0 || top_p < 1.0) left = filter_top(r.data(), V, top_k, top_p, left);
      kids.clear();                                              // deterministic children first, then the draws
      for (int64_t c = node + 1; c < N; ++c) if (p[c] == node && from[c] < 0) kids.push_back(c);
      for (int64_t c = node + 1; c < N; ++c) if (p[c] == node && from[c] >= 0) kids.push_back(c);
      int64_t next = -1, slot = -1;
      double qsum = 0.0;
      for (int64_t c : kids) {
        const int64_t x = t[c];
        if (from[c] < 0) {                                       // a deterministic proposal
          const double rc = r[x];
          if (u[k++] * left < rc) { next = c; break; }
          left -= rc;
          r[x] = 0.f;
          continue;
        }
        if (from[c] != slot) {                                   // the q this node's children were drawn from
          slot = from[c];
          TORCH_CHECK(slot < S, "accept_sampled_tree: node ", c, " was drawn from q slot ", slot, " of ", S);
          const float* qs = qall + slot * Vd;
          qsum = 0.0;
          for (int64_t j = 0; j < Vd; ++j) qsum += q[j] = qs[j];
        }
        const int64_t d = draft_id[x];
        TORCH_CHECK(d >= 0 && q[d] > 0 && qsum > 0, "accept_sampled_tree: sampled child ", c,
                    " has no chance under its q");
        const double pi = left > 0 ? r[x] / left : 0.0, qi = q[d] / qsum;
        if (u[k++] * qi < pi) { next = c; break; }                // u < min(1, p_i(x) / q_i(x))
        double removed = 0.0;                                    // p_{i+1} = max(0, p_i - q_i), kept at scale left
        const double scale = left / qsum;
        for (int64_t j = 0; j < Vd; ++j) {
          if (q[j] <= 0.0) continue;
          const int64_t y = targets[j];
          const float was = r[y], now = static_cast<float>(std::max(0.0, was - q[j] * scale));
          removed += static_cast<double>(was) - now;
          r[y] = now;
        }
        left -= removed;
        qsum -= q[d];                                            // q_{i+1}: q_i without x
        q[d] = 0.0;
        if (!(left > 0)) {                                       // p_i == q_i: rounding rejected a sure child
          next = c;
          break;
        }
      }
      if (next >= 0) {
        nodes.push_back(next);
        node = next;
        continue;
      }
      bonus = draw_residual(r.data(), V, block, u[k++], [&] {
        const double all = exp_row(row, V, mx, inv_t, r.data());
        if (top_k > 0 || top_p < 1.0) filter_top(r.data(), V, top_k, top_p, all);
      });
      TORCH_CHECK(bonus >= 0, "accept_sampled_tree: node ", node, " has no probability mass (logits all -inf)");
    }
  });
  return {torch::tensor(nodes, tokens.options()), torch::tensor({bonus}, tokens.options())};
}

// A sampling row's draft children at M expanded nodes (engine/sampled_tree.DraftSampler): per node, q = the draft's
// distribution (softmax(logits / temperature), top_k > 0 and top_p < 1 filtered as target_probs does, the
// `excluded` draft ids zeroed, normalised), the log of its k largest values (the children's scores by rank) and k
// draws without replacement from q, each by its inverse CDF at one uniform (a drawn token's mass removed before the
// next). logits [M, Vd] float32 / bfloat16; excluded [E] int64; uniforms [M, k] float64. Returns q [M, Vd] float32,
// scores [M, k] float32 and draws [M, k] int64 (-1 with score -inf where q has fewer than k tokens left).
std::vector<at::Tensor> draft_children(const at::Tensor& logits, double temperature, int64_t top_k, double top_p,
                                       int64_t k, const at::Tensor& excluded, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu(), "draft_children: logits must be a CPU [M, Vd]");
  const int64_t M = logits.size(0), Vd = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= Vd, "draft_children: k must be in [1, ", Vd, "], got ", k);
  TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == M && uniforms.size(1) == k &&
              uniforms.scalar_type() == at::kDouble, "draft_children: uniforms must be float64 [M, k]");
  TORCH_CHECK(excluded.dim() == 1 && excluded.scalar_type() == at::kLong, "draft_children: excluded: int64 [E]");
  TORCH_CHECK(temperature > 0, "draft_children: temperature must be > 0");
  at::Tensor z = logits.contiguous(), ex = excluded.contiguous(), uu = uniforms.contiguous();
  at::Tensor probs = at::empty({M, Vd}, logits.options().dtype(at::kFloat));
  at::Tensor scores = at::empty({M, k}, logits.options().dtype(at::kFloat));
  at::Tensor draws = at::empty({M, k}, logits.options().dtype(at::kLong));
  const int64_t* exp_ = ex.data_ptr<int64_t>();
  const int64_t E = ex.numel();
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(exp_[e] >= 0 && exp_[e] < Vd, "draft_children: excluded id ", exp_[e], " outside [0, ", Vd, ")");
  const double* u = uu.data_ptr<double>();
  float *qp = probs.data_ptr<float>(), *sp = scores.data_ptr<float>();
  int64_t* dp = draws.data_ptr<int64_t>();
  const float inv_t = static_cast<float>(1.0 / temperature);
  std::vector<float> w(Vd);
  std::vector<double> block;
  E3_DISPATCH(z.scalar_type(), "draft_children", [&] {
    for (int64_t m = 0; m < M; ++m) {
      const scalar_t* row = z.data_ptr<scalar_t>() + m * Vd;
      float* q = qp + m * Vd;
      double total = exp_row(row, Vd, row_max(row, Vd), inv_t, q);
      if (top_k > 0 || top_p < 1.0) total = filter_top(q, Vd, top_k, top_p, total);
      for (int64_t e = 0; e < E; ++e) { total -= q[exp_[e]]; q[exp_[e]] = 0.f; }
      const float scale = total > 0 ? static_cast<float>(1.0 / total) : 0.f;
      for (int64_t j = 0; j < Vd; ++j) q[j] *= scale;
      std::vector<std::pair<float, int64_t>> best;                // the k largest q, largest first
      for (int64_t j = 0; j < Vd; ++j) {
        if (!(q[j] > 0.f) || (static_cast<int64_t>(best.size()) == k && q[j] <= best.back().first)) continue;
        auto at = std::upper_bound(best.begin(), best.end(), std::make_pair(q[j], j),
                                   [](const auto& x, const auto& y) { return x.first > y.first; });
        best.insert(at, {q[j], j});
        if (static_cast<int64_t>(best.size()) > k) best.pop_back();
      }
      std::copy(q, q + Vd, w.begin());
      for (int64_t i = 0; i < k; ++i) {
        const int64_t d = i < static_cast<int64_t>(best.size()) ? draw_residual(w.data(), Vd, block, u[m * k + i], [] {})
                                                                : -1;
        dp[m * k + i] = d;
        sp[m * k + i] = d >= 0 ? std::log(best[i].first) : -std::numeric_limits<float>::infinity();
        if (d >= 0) w[d] = 0.f;
      }
    }
  });
  return {probs, scores, draws};
}

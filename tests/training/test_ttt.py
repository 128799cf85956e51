"""Training-time test: the one-pass TTT equals literally running the draft autoregressively."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sglang_eagle3.models.config import Eagle3Config
from sglang_eagle3.models.draft import Eagle3DraftModel, sdpa_attend
from sglang_eagle3.training.ttt import (
    TTTAttention,
    TTTBatch,
    TTTCounters,
    TTTSettings,
    chains_to_grow,
    target_distribution,
    ttt_forward,
)

V, VD, H, T, B, K = 40, 28, 32, 9, 2, 4
DT = torch.float64
# fp64 everywhere except the draft's RMSNorm, which normalises in fp32 by design: losses agree to ~1e-15,
# gradients to ~5e-8 of their largest entry. Tolerance: losses rtol 1e-6; gradients 1e-6 * max|grad|.
RTOL, ATOL = 1e-6, 1e-9


def make_setup(num_aux=3, seed=0, eagle31=False, T=T, gap=None):
    """gap (start, end): a second prompt inside the rows (loss_mask 0 there), as in a two-turn chat."""
    g = torch.Generator().manual_seed(seed)
    cfg = Eagle3Config(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=V, draft_vocab_size=VD, target_hidden_size=H,
                       aux_layer_ids=[1, 2, 4][:num_aux] if num_aux > 1 else [5], fc_norm=eagle31, norm_output=eagle31)
    torch.manual_seed(seed)
    draft = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3, generator=g) if p.dim() > 1 else p.uniform_(0.5, 1.5, generator=g)
    draft.set_vocab_mapping(torch.randperm(V, generator=g)[:VD])
    emb = nn.Embedding(V, H)
    nn.init.normal_(emb.weight, 0, 1.0, generator=g)
    draft.set_embedding(emb)
    lm_head = nn.Linear(H, V, bias=False)
    nn.init.normal_(lm_head.weight, 0, 1.0, generator=g)
    draft.to(DT), emb.to(DT), lm_head.to(DT)
    lm_head.requires_grad_(False)
    ids = torch.randint(0, V, (B, T), generator=g)
    loss_mask = torch.ones(B, T, dtype=torch.long)
    loss_mask[:, :2] = 0                       # a "prompt"
    if gap is not None:
        loss_mask[:, gap[0]:gap[1]] = 0
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, T - 2:] = 0                        # row 1 is right-padded
    loss_mask[1, T - 2:] = 0
    ids[1, T - 2:] = 0
    aux = torch.randn(B, T, num_aux * H, generator=g, dtype=DT)
    last = torch.randn(B, T, H, generator=g, dtype=DT)
    return draft, lm_head, dict(input_ids=ids, loss_mask=loss_mask, attention_mask=attn, aux=aux, last=last)


def naive_ttt(draft, lm_head, d, ttt_length=K, decay=0.8, features="fused", feature_loss_weight=0.0,
              loss_mask_offset=1, target_temperature=1.0):
    """Draft chains run one step at a time from every base position t, no cache, explicit masks.

    Step k from base t: hidden inputs [fc(f_0) .. fc(f_t), o^0_t .. o^{k-1}_t], tokens x_1 .. x_{t+k+1},
    positions 0 .. t+k, plain causal attention; o^k_t is the last output; target = softmax at t+k+1.
    """
    ids, lm, am = d["input_ids"], d["loss_mask"], d["attention_mask"]
    B, T = ids.shape
    valid = lm.bool() & am.bool()
    draft_ids = draft.draft_to_target(torch.arange(VD))
    p_all, top = target_distribution(d["last"], lm_head, draft_ids)
    if target_temperature != 1:                                  # from the logits, not from p_all
        z = lm_head(d["last"])[..., draft_ids]
        p_all = (F.one_hot(z.argmax(-1), VD).to(DT) if target_temperature == 0
                 else (z / target_temperature).softmax(-1))
    g = draft.project(d["last"] if features == "top" else d["aux"])
    num = [0.0] * ttt_length
    den = [0.0] * ttt_length
    correct = [0.0] * ttt_length
    count = [0.0] * ttt_length
    accept_sum = accept_count = 0.0
    feat_num, feat_den = 0.0, 0.0
    for b in range(B):
        for t in range(T - 1):
            chain, alive = [], True                              # chain: what later steps read
            for k in range(ttt_length):
                s = t + k + 1                                    # the predicted token is x_{s+1}; target at s
                if s >= T:
                    break
                hid = torch.cat([g[b, :t + 1]] + [o[None] for o in chain])              # [t+k+1, H]
                L = hid.shape[0]
                mask = torch.ones(L, L, dtype=torch.bool).tril()[None, None]           # explicit causal
                out = draft(ids[b, 1:s + 1][None], hid[None], torch.arange(L)[None], attend=sdpa_attend(mask))
                o = out[0, -1]
                chain.append(draft.norm(o) if draft.config.norm_output else o)    # EAGLE-3.1 reads the normed one
                logits = draft.compute_logits(o)
                ce = -(p_all[b, s] * logits.log_softmax(-1)).sum()
                gate = s - 1 + loss_mask_offset                  # ours: the predicted position; authors': one earlier
                m = float(valid[b, gate] and bool(draft.t2d[top[b, s]]))
                num[k] = num[k] + ce * m
                den[k] += m
                ok = bool(draft_ids[logits.argmax()] == top[b, s])
                if valid[b, s]:
                    correct[k] += ok
                    count[k] += 1
                    if k == 0:
                        accept_count += 1
                alive = alive and ok and bool(valid[b, s])
                accept_sum += alive
                if k == 0 and feature_loss_weight > 0 and valid[b, s]:
                    feat_num = feat_num + F.smooth_l1_loss(o, d["last"][b, s], reduction="none").mean()
                    feat_den += 1
    losses = [n / max(dd, 1.0) for n, dd in zip(num, den)]
    total = sum(decay ** k * l for k, l in enumerate(losses))
    if feature_loss_weight > 0:
        total = total + feature_loss_weight * feat_num / max(feat_den, 1.0)
    counters = TTTCounters(*(torch.tensor(c, dtype=torch.float64) for c in (correct, count, accept_sum, accept_count)))
    return total, torch.stack([torch.as_tensor(l, dtype=DT) for l in losses]), counters


def efficient(draft, lm_head, d, **kw):
    batch = TTTBatch(d["input_ids"], d["loss_mask"], d["last"], d["aux"], d["attention_mask"])
    return ttt_forward(draft, batch, lm_head, TTTSettings(ttt_length=K, **kw))


def grads(draft, loss):
    draft.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in draft.named_parameters()}


def assert_matches_naive(draft, lm_head, d, **kw):
    """The one-pass TTT against naive_ttt: losses, per-step losses, counters and gradients.
    -> (TTTOutput, naive counters, naive gradients)."""
    out = efficient(draft, lm_head, d, **kw)
    g_fast = grads(draft, out.loss)
    ref_loss, ref_steps, ref_counters = naive_ttt(draft, lm_head, d, **{k: v for k, v in kw.items()
                                                                         if k != "grow_every_chain"})
    g_ref = grads(draft, ref_loss)
    torch.testing.assert_close(out.loss.detach(), ref_loss.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out.step_loss, ref_steps.detach(), rtol=RTOL, atol=ATOL)
    assert torch.equal(out.counters.packed(), ref_counters.packed())
    for name in g_ref:
        scale = g_ref[name].abs().max().item()
        torch.testing.assert_close(g_fast[name], g_ref[name], rtol=1e-5, atol=1e-6 * scale,
                                   msg=lambda m: f"{name}: {m}")
    return out, ref_counters, g_ref


@pytest.mark.parametrize("features,num_aux,fw,offset,eagle31", [
    ("fused", 3, 0.0, 1, False), ("top", 1, 0.0, 1, False), ("fused", 3, 0.5, 1, False),
    ("fused", 3, 0.0, 0, False),          # the authors' / SpecForge's loss-mask convention
    ("fused", 3, 0.0, 1, True)])          # EAGLE-3.1: fc_norm + norm_output
def test_ttt_matches_naive_autoregressive_drafting(features, num_aux, fw, offset, eagle31):
    draft, lm_head, d = make_setup(num_aux=num_aux, eagle31=eagle31)
    out, ref_counters, g_ref = assert_matches_naive(draft, lm_head, d, features=features, feature_loss_weight=fw,
                                                    loss_mask_offset=offset)
    assert out.loss.dtype == DT
    assert all(g.abs().sum() > 0 for g in g_ref.values())      # every weight is exercised
    assert (out.step_loss > 0).all() and (ref_counters.step_count > 0).all()
    if fw:
        assert out.feature_loss is not None and out.feature_loss > 0


@pytest.mark.parametrize("target_temperature", [0.0, 0.5, 2.0])
def test_sharpened_targets_match_naive_drafting(target_temperature):
    """target_temperature T: every step learns softmax(target logits / T) over the draft vocab (0: one-hot at the
    target's greedy pick); accuracies still count the target's own argmax, so the counters do not move."""
    draft, lm_head, d = make_setup()
    out, counters, _ = assert_matches_naive(draft, lm_head, d, target_temperature=target_temperature)
    soft = efficient(draft, lm_head, d)
    assert not torch.allclose(out.loss, soft.loss)
    assert torch.equal(counters.packed(), soft.counters.packed())


def test_sharpen_target_values_and_flag():
    import argparse

    from sglang_eagle3.training.trainer.cli import UserError, add_train_args, train_config
    from sglang_eagle3.training.ttt import sharpen_target
    z = torch.tensor([[2.0, 0.0, 1.0, 1.5], [0.0, 3.0, 3.5, -1.0]], dtype=DT)
    p = z.softmax(-1)
    assert sharpen_target(p, 1.0) is p
    torch.testing.assert_close(sharpen_target(p, 0.25), (z / 0.25).softmax(-1))
    # fp32 at a small T: every p^(1/T) underflows to 0 (0.5^1000), softmax(logits / T) does not
    torch.testing.assert_close(sharpen_target(p.float(), 1e-3), (z.float() / 1e-3).softmax(-1))
    assert sharpen_target(p, 0.0).tolist() == [[1, 0, 0, 0], [0, 0, 1, 0]]
    with pytest.raises(ValueError, match="target_temperature must be >= 0"):
        sharpen_target(p, -0.5)
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    base = ["--target", "t", "--data", "d", "--out", "o"]
    assert train_config(parser.parse_args(base)).target_temperature == 1.0
    assert train_config(parser.parse_args(base + ["--target-temperature", "0"])).target_temperature == 0.0
    with pytest.raises(UserError, match="--target-temperature must be >= 0, got -1.0"):
        train_config(parser.parse_args(base + ["--target-temperature", "-1"]))


@pytest.mark.parametrize("grow_every_chain", [False, True])
@pytest.mark.parametrize("offset,eagle31", [(1, False), (0, False), (1, True)])
def test_chains_no_later_step_scores_are_not_grown(offset, eagle31, grow_every_chain):
    """A second prompt inside the rows: the chains that end in it are dropped after step 0 (or, with
    grow_every_chain, grown for nothing) and the loss, counters and gradients still equal the naive drafting's."""
    draft, lm_head, d = make_setup(T=18, gap=(7, 13), eagle31=eagle31)
    grown = chains_to_grow(d["loss_mask"].bool() & d["attention_mask"].bool(), K)
    assert grown[0] is None and all(len(grown[k]) < 18 - k - 1 for k in range(1, K))   # some chains dropped
    assert grown[1].tolist() == [0, 1, 2, 3, 4, 9, 10, 11, 12, 13, 14, 15]  # 5-8: steps 1-3 land in the gap
    assert_matches_naive(draft, lm_head, d, loss_mask_offset=offset, grow_every_chain=grow_every_chain)


def test_grow_every_chain_default_follows_the_cpu(monkeypatch):
    """auto: every chain on CPUs with AMX, the scored chains elsewhere; the trainer's --grow-chains picks either."""
    import argparse

    from sglang_eagle3.kernels import extension
    from sglang_eagle3.training import ttt
    from sglang_eagle3.training.trainer.cli import add_train_args, train_config
    monkeypatch.setattr(extension, "cpu_flags", lambda: "flags : avx512f avx512_bf16 amx_bf16 amx_tile")
    assert ttt.grow_every_chain_default(torch.device("cpu"))
    assert not ttt.grow_every_chain_default(torch.device("cuda"))
    monkeypatch.setattr(extension, "cpu_flags", lambda: "flags : avx512f avx512_bf16")
    assert not ttt.grow_every_chain_default(torch.device("cpu"))
    p = argparse.ArgumentParser()
    add_train_args(p)
    base = ["--target", "t", "--data", "d", "--out", "o"]
    assert train_config(p.parse_args(base)).grow_chains == "auto"
    assert train_config(p.parse_args(base + ["--grow-chains", "scored"])).grow_chains == "scored"


class CausalOverAllSteps(TTTAttention):
    """Wrong: step k's query sees every earlier step's keys at positions <= t (not only at t)."""

    def __call__(self, q, k, v):
        B, nH, T, D = q.shape
        self.keys.append(k), self.values.append(v)
        ks = torch.cat([kk[:, :, :T] for kk in self.keys], 2).repeat_interleave(nH // k.shape[1], 1)
        vs = torch.cat([vv[:, :, :T] for vv in self.values], 2).repeat_interleave(nH // k.shape[1], 1)
        mask = torch.ones(T, T, dtype=torch.bool).tril().repeat(1, len(self.keys))
        return F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask)


class NoCrossStep(TTTAttention):
    """Wrong: every step attends causally to its own keys only (plain causal attention per step)."""

    def __call__(self, q, k, v):
        return sdpa_attend(None)(q, k, v)


@pytest.mark.parametrize("wrong", [CausalOverAllSteps, NoCrossStep])
def test_wrong_step_masking_is_detected(monkeypatch, wrong):
    draft, lm_head, d = make_setup()
    ref_loss, ref_steps, _ = naive_ttt(draft, lm_head, d)
    good = efficient(draft, lm_head, d)
    monkeypatch.setattr("sglang_eagle3.training.ttt.TTTAttention", wrong)
    bad = efficient(draft, lm_head, d)
    torch.testing.assert_close(good.step_loss, ref_steps.detach(), rtol=RTOL, atol=ATOL)
    # step 0 only sees step-0 keys in every variant; later steps must differ by far more than the tolerance
    assert torch.allclose(bad.step_loss[0], ref_steps[0].detach(), rtol=RTOL, atol=ATOL)
    assert (bad.step_loss[1:] - ref_steps[1:].detach()).abs().min() > 1e-4


def test_counters_add_and_read_as_metrics():
    """Counts add field by field (one packed tensor); metrics are correct / count per step (nan where nothing was
    counted) and 1 + the accepted steps per chain start; the mean loss is nan while no loss was added."""
    a = TTTCounters(torch.tensor([3.0, 1.0, 0.0]), torch.tensor([4.0, 2.0, 0.0]), torch.tensor(5.0), torch.tensor(4.0))
    b = TTTCounters.zeros(3)
    b.loss_sum, b.losses, b.tokens = 1.5, 2.0, 30.0
    c = a + b + a
    assert c.step_correct.tolist() == [6, 2, 0] and c.step_count.tolist() == [8, 4, 0]
    assert (c.accept_sum.item(), c.accept_count.item(), c.loss_sum, c.losses, c.tokens) == (10, 8, 1.5, 2, 30)
    m = c.metrics()
    assert (m["acc_0"], m["acc_1"], m["accept_length"]) == (0.75, 0.5, 2.25) and m["acc_2"] != m["acc_2"]   # nan
    assert c.mean_loss() == 0.75 and TTTCounters.zeros(3).mean_loss() != TTTCounters.zeros(3).mean_loss()
    assert c.packed().shape == (11,) and torch.equal(TTTCounters.unpacked(c.packed()).packed(), c.packed())
    assert torch.equal(c.all_reduced(torch.device("cpu")).packed(), c.packed())     # one process: these counts


def test_metrics_and_masks():
    draft, lm_head, d = make_setup()
    out = efficient(draft, lm_head, d)
    m = out.counters.metrics()
    assert set(m) == {f"acc_{k}" for k in range(K)} | {"accept_length"}
    assert 1.0 <= m["accept_length"] <= 1.0 + K
    # positions with loss_mask 0 are never scored: zeroing the mask of step 0's targets kills all counts
    d2 = dict(d, loss_mask=torch.zeros_like(d["loss_mask"]))
    out2 = efficient(draft, lm_head, d2)
    assert out2.counters.step_count.sum() == 0 and out2.loss == 0
    assert out2.counters.metrics()["accept_length"] != out2.counters.metrics()["accept_length"]  # nan


def test_perfect_draft_accepts_every_step():
    """A draft whose argmax always equals the target's scores acc 1 and accepts every step the data allows."""
    draft, lm_head, d = make_setup()
    draft.set_vocab_mapping(torch.arange(3, 3 + VD))          # draft id 0 = target id 3
    with torch.no_grad():
        lm_head.weight.zero_()
        lm_head.weight[3] = 1.0                                # positive hidden -> target argmax is 3
        draft.lm_head.weight.zero_()                           # all draft logits tie -> argmax is draft id 0
    d = dict(d, last=d["last"].abs() + 1.0)
    out = efficient(draft, lm_head, d)
    m = out.counters.metrics()
    assert all(m[f"acc_{k}"] == 1.0 for k in range(K))
    starts = out.counters.accept_count.item()
    # every chain runs until its data ends: sum of min(K, remaining valid tokens)
    valid = d["loss_mask"].bool() & d["attention_mask"].bool()
    expect = sum(min(K, int(valid[b, t + 1:].sum())) for b in range(B) for t in range(T - 1) if valid[b, t + 1])
    assert out.counters.accept_sum.item() == expect and starts > 0


def test_bad_feature_width_is_a_clear_error():
    draft, lm_head, d = make_setup()
    with pytest.raises(ValueError, match="fc reads 96"):
        efficient(draft, lm_head, d, features="top")


def test_loss_mask_conventions_differ():
    draft, lm_head, d = make_setup()
    ours, theirs = (efficient(draft, lm_head, d, loss_mask_offset=o).loss for o in (1, 0))
    assert abs(float(ours) - float(theirs)) > 1e-6
    with pytest.raises(ValueError, match="loss_mask_offset"):
        efficient(draft, lm_head, d, loss_mask_offset=2)


def test_fused_cross_entropy_equals_the_plain_formula():
    draft, lm_head, d = make_setup()
    a = efficient(draft, lm_head, d)
    ga = grads(draft, a.loss)
    b = efficient(draft, lm_head, d, fused_ce=False)
    gb = grads(draft, b.loss)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-10, atol=1e-12)
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("offset,fw,eagle31", [(1, 0.0, False), (0, 0.5, False), (1, 0.5, True)])
def test_packed_rows_equal_the_rows_one_by_one(offset, fw, eagle31):
    """Rows packed end to end (row_lengths) give the mean of the rows' own losses, the same gradients and the
    summed counters, as gradient accumulation over the rows run alone (no padding)."""
    draft, lm_head, d = make_setup(eagle31=eagle31)
    lengths = [T, T - 2, 5]                                      # row 1 without its padding, row 2 a short copy
    rows = [{k: d[k][b, :n] for k in ("input_ids", "loss_mask", "aux", "last")}
            for b, n in ((0, T), (1, T - 2), (1, 5))]
    settings = TTTSettings(ttt_length=K, loss_mask_offset=offset, feature_loss_weight=fw)

    def run(r, row_lengths=None):
        batch = TTTBatch(r["input_ids"][None], r["loss_mask"][None], r["last"][None], r["aux"][None],
                         row_lengths=row_lengths)
        return ttt_forward(draft, batch, lm_head, settings)
    alone = [run(r) for r in rows]
    ref_loss = sum(o.loss for o in alone) / len(alone)
    g_ref = grads(draft, ref_loss)
    packed = run({k: torch.cat([r[k] for r in rows]) for k in rows[0]}, lengths)
    g_packed = grads(draft, packed.loss)
    torch.testing.assert_close(packed.loss.detach(), ref_loss.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(packed.step_loss, sum(o.step_loss for o in alone) / len(alone), rtol=RTOL, atol=ATOL)
    assert torch.equal(packed.counters.packed(), sum((o.counters for o in alone[1:]), alone[0].counters).packed())
    if fw:
        torch.testing.assert_close(packed.feature_loss, sum(o.feature_loss for o in alone) / len(alone))
    for name in g_ref:
        scale = g_ref[name].abs().max().item()
        torch.testing.assert_close(g_packed[name], g_ref[name], rtol=1e-5, atol=1e-6 * scale,
                                   msg=lambda m: f"{name}: {m}")
    with pytest.raises(ValueError, match="row_lengths"):
        run({k: torch.cat([r[k] for r in rows]) for k in rows[0]}, [T, T])      # does not sum to the length


@pytest.mark.parametrize("V_", [8192, 37])                       # 37: the kernel's non-vector tail
def test_soft_cross_entropy_kernel_equals_the_pytorch_ops(V_):
    """bf16 logits on CPU take csrc's fused kernel (p read through row indices); it gives the PyTorch ops' loss
    and gradient (fp32 arithmetic in both; the gradient within one bf16 rounding)."""
    from sglang_eagle3.kernels import extension
    from sglang_eagle3.kernels.training import soft_ce_extension, soft_cross_entropy
    if extension.load() is None:
        pytest.skip(f"C++ extension unavailable: {extension.status()['extension_error']}")
    g = torch.Generator().manual_seed(0)
    S, N = 70, 90
    z0 = (torch.randn(S, V_, generator=g) * 4).bfloat16()
    p = (torch.randn(N, V_, generator=g) * 3).softmax(-1)
    rows = torch.randint(0, N, (S,), generator=g)
    w = torch.rand(S, generator=g)
    assert soft_ce_extension(z0, p, rows) is not None
    out = {}
    for mode in ("auto", "off"):
        z = z0.clone().requires_grad_()
        with extension.using(mode):
            loss = soft_cross_entropy(z, p, rows)
            (loss * w).sum().backward()
        out[mode] = loss.detach(), z.grad
    (la, ga), (lb, gb) = out["auto"], out["off"]
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ga.float(), gb.float(), rtol=2 ** -7, atol=1e-6)   # one bf16 ulp
    plain = -(p[rows] * z0.float().log_softmax(-1)).sum(-1)                      # the textbook formula
    torch.testing.assert_close(la, plain, rtol=1e-5, atol=1e-5)
    empty = soft_cross_entropy(z0[:0].clone().requires_grad_(), p, rows[:0])     # a step that scores nothing
    assert empty.shape == (0,)
    with pytest.raises(RuntimeError, match="rows out of range"):
        soft_cross_entropy(z0, p, rows + N)
    with pytest.raises(ValueError, match="must match logits"):
        soft_cross_entropy(z0, p)


def test_bf16_ttt_with_the_kernel_equals_it_without():
    """A packed bf16 TTT step (autocast, what training runs) with the soft cross-entropy kernel and with the
    PyTorch ops: the same loss, counters and gradients up to bf16 rounding."""
    from sglang_eagle3.kernels import extension
    if extension.load() is None:
        pytest.skip(f"C++ extension unavailable: {extension.status()['extension_error']}")
    draft, lm_head, d = make_setup()
    draft.float(), lm_head.float()
    lengths = [T, T - 2]
    ids = torch.cat([d["input_ids"][0], d["input_ids"][1, :T - 2]])[None]
    mask = torch.cat([d["loss_mask"][0], d["loss_mask"][1, :T - 2]])[None]
    aux = torch.cat([d["aux"][0], d["aux"][1, :T - 2]])[None].float()
    last = torch.cat([d["last"][0], d["last"][1, :T - 2]])[None].float()
    res = {}
    for mode in ("auto", "off"):
        with extension.using(mode), torch.autocast("cpu", dtype=torch.bfloat16):
            o = ttt_forward(draft, TTTBatch(ids, mask, last, aux, row_lengths=lengths), lm_head, TTTSettings(ttt_length=K))
        res[mode] = o, grads(draft, o.loss)
    (a, ga), (b, gb) = res["auto"], res["off"]
    torch.testing.assert_close(a.loss.detach(), b.loss.detach(), rtol=1e-4, atol=1e-5)
    assert torch.equal(a.counters.packed(), b.counters.packed())
    for name in ga:
        scale = gb[name].abs().max().item()
        torch.testing.assert_close(ga[name], gb[name], rtol=2e-2, atol=2e-2 * scale, msg=lambda m: f"{name}: {m}")


def test_target_distribution_kernel_equals_the_pytorch_ops():
    """bf16 target logits on CPU: csrc's one-pass kernel gives the same argmax over the whole vocabulary (the
    first maximum on ties, as torch) and the same softmax at the draft's ids."""
    from sglang_eagle3.kernels import extension
    if extension.load() is None:
        pytest.skip(f"C++ extension unavailable: {extension.status()['extension_error']}")
    g = torch.Generator().manual_seed(0)
    lm_head = nn.Linear(H, 1000, bias=False).bfloat16()
    nn.init.normal_(lm_head.weight, 0, 1.0, generator=g)
    hidden = torch.randn(2, 7, H, generator=g).bfloat16()                 # [B, T, H]
    ids = torch.randperm(1000, generator=g)[:301]
    res = {}
    for mode in ("auto", "off"):
        with extension.using(mode):
            res[mode] = target_distribution(hidden, lm_head, ids)
    (pa, ta), (pb, tb) = res["auto"], res["off"]
    assert pa.shape == (2, 7, 301) and ta.shape == (2, 7) and torch.equal(ta, tb)
    torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-7)
    ties = torch.zeros(3, 50, dtype=torch.bfloat16)
    ties[0, [3, 20, 40]] = 5
    ties[1, [17, 33]] = 2
    ties[2, [48, 49]] = 1                                                  # in the non-vector tail
    _, top = extension.load().target_distribution(ties, torch.arange(10))
    assert top.tolist() == [3, 17, 48] == ties.max(-1).indices.tolist()
    with pytest.raises(RuntimeError, match="out of range"):
        extension.load().target_distribution(ties, torch.tensor([0, 50]))

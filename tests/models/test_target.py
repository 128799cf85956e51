"""The target runtime equals transformers' own forward (logits and captured hidden states)."""
import pytest
import torch
from conftest import tiny_target

from sglang_eagle3.models.config import ConfigError

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
TOL = 1e-4


def hf_forward(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_matches_transformers(family):
    tm, hf = tiny_target(family)
    ids = torch.randint(0, tm.vocab_size, (3, 11))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    out = tm(tm.new_cache(3, 16), ids, torch.arange(11).expand(3, 11))
    aux_ref = torch.cat([ref.hidden_states[i + 1] for i in tm.aux_layer_ids], -1)
    assert (out.logits - ref.logits).abs().max() <= TOL
    assert (out.aux_hidden_states - aux_ref).abs().max() <= TOL
    assert (out.last_hidden - ref.hidden_states[-1]).abs().max() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_and_padded_batch(family):
    tm, hf = tiny_target(family)
    seqs = [[5, 9, 3, 7, 1, 4], [8, 2, 6], [11, 12, 13, 14, 15, 16, 17, 18]]
    lens = torch.tensor([len(s) for s in seqs])
    ids = torch.zeros(3, 8, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s)
    cache = tm.new_cache(3, 32)
    out = tm(cache, ids, torch.arange(8).expand(3, 8), num_new=lens, logit_index=(lens - 1).view(3, 1))
    cache.commit_prefix(torch.arange(3), lens)
    for b, s in enumerate(seqs):
        assert (out.logits[b, 0] - hf_forward(hf, s).logits[0, -1]).abs().max() <= TOL
    nxt = torch.tensor([[40], [41], [42]])
    out = tm(cache, nxt, lens.view(3, 1))
    for b, s in enumerate(seqs):
        ref = hf_forward(hf, s + [40 + b])
        assert (out.logits[b, 0] - ref.logits[0, -1]).abs().max() <= TOL
        aux_ref = torch.cat([ref.hidden_states[i + 1][0, -1] for i in tm.aux_layer_ids], -1)
        assert (out.aux_hidden_states[b, 0] - aux_ref).abs().max() <= TOL


def tree_mask_of(parents):
    n = len(parents)
    m = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        m[i] |= m[parents[i]]
    return m


def path_to(parents, i):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_forward_and_compaction(family):
    tm, hf = tiny_target(family)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    parents = [-1, 0, 0, 1, 1, 2, 3, 6]
    tokens = [6, 20, 21, 30, 31, 32, 40, 50]
    depth = [len(path_to(parents, i)) - 1 for i in range(len(parents))]
    cache = tm.new_cache(1, 32)
    tm(cache, torch.tensor([prompt]), torch.arange(7).view(1, 7))
    cache.commit_prefix(torch.arange(1), torch.tensor([7]))
    out = tm(cache, torch.tensor([tokens]), torch.tensor([[7 + d for d in depth]]),
             tree_mask=tree_mask_of(parents).unsqueeze(0))
    for i in range(len(tokens)):
        seq = prompt + [tokens[j] for j in path_to(parents, i)]
        ref = hf_forward(hf, seq)
        assert (out.logits[0, i] - ref.logits[0, -1]).abs().max() <= TOL, f"node {i}"
        aux_ref = torch.cat([ref.hidden_states[k + 1][0, -1] for k in tm.aux_layer_ids], -1)
        assert (out.aux_hidden_states[0, i] - aux_ref).abs().max() <= TOL
    # accept the path 0 -> 1 -> 3 -> 6: slots 3 and 6 move next to 0 and 1; then decode one more token
    accepted = [0, 1, 3, 6]
    cache.commit(torch.arange(1), torch.tensor([accepted]), torch.tensor([len(accepted)]))
    assert int(cache.lens[0]) == 7 + len(accepted)
    out = tm(cache, torch.tensor([[77]]), torch.tensor([[11]]))
    seq = prompt + [tokens[j] for j in accepted] + [77]
    ref = hf_forward(hf, seq)
    assert (out.logits[0, 0] - ref.logits[0, -1]).abs().max() <= TOL
    aux_ref = torch.cat([ref.hidden_states[k + 1][0, -1] for k in tm.aux_layer_ids], -1)
    assert (out.aux_hidden_states[0, 0] - aux_ref).abs().max() <= TOL


def test_features_for_training_match_prefill():
    tm, hf = tiny_target("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]])
    am = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    aux, last = tm.features(ids, am)
    ref = hf_forward(hf, [1, 2, 3])
    aux_ref = torch.cat([ref.hidden_states[k + 1][0] for k in tm.aux_layer_ids], -1)
    assert (aux[1, :3] - aux_ref).abs().max() <= TOL
    assert (last[1, :3] - ref.hidden_states[-1][0]).abs().max() <= TOL


def test_custom_aux_layers_and_errors():
    tm, hf = tiny_target("llama")
    from sglang_eagle3.models.target import TargetModel
    t2 = TargetModel(hf, None, aux_layer_ids=[0, 3, 5])
    ids = torch.tensor([[1, 2, 3]])
    out = t2(t2.new_cache(1, 8), ids, torch.arange(3).view(1, 3))
    ref = hf_forward(hf, [1, 2, 3])
    assert (out.aux_hidden_states[0] - torch.cat([ref.hidden_states[k][0] for k in (1, 4, 6)], -1)).abs().max() <= TOL
    top = TargetModel(hf, None, aux_layer_ids=[7])                # id L-1: the final normed state ('top' ablation)
    out = top(top.new_cache(1, 8), ids, torch.arange(3).view(1, 3))
    assert (out.aux_hidden_states[0] - ref.hidden_states[8][0]).abs().max() <= TOL
    with pytest.raises(ConfigError, match="strictly increasing"):
        TargetModel(hf, None, aux_layer_ids=[3, 1, 5])
    with pytest.raises(ConfigError, match="out of range"):
        TargetModel(hf, None, aux_layer_ids=[1, 2, 99])
    cache = t2.new_cache(1, 4)
    with pytest.raises(RuntimeError, match="KV cache of 4 slots"):
        t2(cache, torch.tensor([[1, 2, 3, 4, 5]]), torch.arange(5).view(1, 5))


def test_unsupported_family_is_refused():
    from conftest import tiny_hf_config
    from transformers import AutoModelForCausalLM

    from sglang_eagle3.models.target import TargetModel
    hf = AutoModelForCausalLM.from_config(tiny_hf_config("gpt2", n_embd=64, n_layer=4, n_head=4))
    with pytest.raises(ConfigError, match="gpt2"):
        TargetModel(hf)


# new slots of a verify, as parent lists: a chain (root, child); a branching tree (root; a and b its children; c b's
# child); a wider 8-node tree whose accepted paths skip rejected siblings at several depths
VERIFY_TREES = {"chain": [-1, 0], "tree": [-1, 0, 0, 2], "wide": [-1, 0, 0, 1, 2, 2, 5, 3]}


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("shape", list(VERIFY_TREES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verified_token_attends_as_the_one_token_step_would(dtype, shape, D):
    """Bit for bit: every node of a tree verify attends as the one-token step that decodes it once its ancestors
    are committed (a key's score is the same in a block of keys or alone; masked siblings add nothing, not even to
    the order of the softmax sum, wherever they sit in the tree). This is what keeps greedy speculative output
    equal to vanilla in bf16 (contexts crossing the kernels' 8- and 16-lane blocks, AVX2 and AVX-512, at the head
    sizes with register-blocked paths). A bf16 output hides most fp32 rounding differences (one in ~65,000 values
    flips), so bf16 runs many heads and draws: with the softmax sums in position lanes, 11 of 3,280 wide-tree
    nodes differed."""
    from sglang_eagle3.kernels import decode as K
    torch.manual_seed(0)
    parents = VERIFY_TREES[shape]
    F, S = len(parents), 48
    nKV, nH, draws = (3, 48, 10) if dtype == torch.bfloat16 else (3, 9, 1)
    scale = D ** -0.5
    mask, one = tree_mask_of(parents).unsqueeze(0), torch.tensor([[[True]]])
    for L in list(range(0, S - F + 1)) * draws:
        k0, v0 = torch.randn(1, nKV, S, D, dtype=dtype), torch.randn(1, nKV, S, D, dtype=dtype)
        q, kn, vn = (torch.randn(1, h, F, D, dtype=dtype) for h in (nH, nKV, nKV))
        rows, lens = torch.tensor([0]), torch.tensor([L])
        kt, vt = k0.clone(), v0.clone()
        tree = K.tree_attention(q, kn, vn, kt, vt, rows, lens, lens, mask, scale)
        for node in range(F):
            kc, vc = k0.clone(), v0.clone()
            for depth, t in enumerate(path_to(parents, node)):   # commit the ancestors one step at a time, then the node
                x = [y[:, :, t:t + 1].contiguous() for y in (q, kn, vn)]
                step = K.tree_attention(*x, kc, vc, rows, lens + depth, lens + depth, one, scale)
            assert torch.equal(tree[:, :, node], step[:, :, 0]), (L, node)
        if shape == "chain":                                 # a chain's slots are its positions: the same cache
            assert torch.equal(kt, kc) and torch.equal(vt, vc)


@pytest.mark.parametrize("D", [16, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_attention_equals_the_kernel_and_the_reference(dtype, D):
    """The fixed-shape attention (what CUDA graphs capture) against the reference and the CPU kernel."""
    from sglang_eagle3.kernels import decode as K
    torch.manual_seed(0)
    R, nKV, S, nH, B, T, F = 5, 3, 48, 6, 3, 4, 6      # head sizes 64, 128: the kernel's register-blocked paths
    k0, v0 = torch.randn(R, nKV, S, D, dtype=dtype), torch.randn(R, nKV, S, D, dtype=dtype)
    q, kn, vn = torch.randn(B, nH, T, D, dtype=dtype), torch.randn(B, nKV, T, D, dtype=dtype), \
        torch.randn(B, nKV, T, D, dtype=dtype)
    rows, lens = torch.tensor([4, 0, 2]), torch.tensor([10, 0, 33])
    ws = lens + torch.tensor([2, 0, 1])
    m = torch.rand(B, T, F) < 0.5
    for b in range(B):
        for t in range(T):
            m[b, t, int(ws[b] - lens[b]) + t] = True
    outs = []
    for fn in (K.tree_attention_ref, K.tree_attention_static, K.tree_attention):
        kc, vc = k0.clone(), v0.clone()
        outs.append((fn(q, kn, vn, kc, vc, rows, lens, ws, m, D ** -0.5).float(), kc, vc))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for out, kc, vc in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], rtol=tol, atol=tol)
        assert torch.equal(kc, outs[0][1]) and torch.equal(vc, outs[0][2])
    # one row alone splits its queries into smaller chunks per KV head: the same values, bit for bit
    for b in range(B):
        kc, vc = k0.clone(), v0.clone()
        one = K.tree_attention(q[b:b + 1], kn[b:b + 1], vn[b:b + 1], kc, vc, rows[b:b + 1], lens[b:b + 1],
                               ws[b:b + 1], m[b:b + 1].contiguous(), D ** -0.5)
        assert torch.equal(one[0].float(), outs[2][0][b])


FEW_ROW_KERNELS = ["amx", "avx512_bf16", "avx512f", "avx2"]
PACKED_DIMS = {"amx": 6, "avx512_bf16": 5, "avx512f": 4, "avx2": 4}       # the layout says which kernel reads it


def few_row_kernel_or_skip(kernel: str):
    """The extension, where this build has the few-row kernel (an AMX host's native build has all four; an AVX-512F
    build avx512f and avx2, so the new kernel's tests run on every AVX-512 host)."""
    from sglang_eagle3.kernels import extension
    if kernel not in extension.few_row_kernels():
        pytest.skip(f"no {kernel} kernel in this build on this CPU (it has {extension.few_row_kernels()})")
    return extension


@pytest.mark.parametrize("kernel", FEW_ROW_KERNELS)
def test_packed_linear_paths_agree(kernel):
    """Each few-row kernel (AMX tiles, AVX-512 BF16 dot products, bf16 widened to fp32 on AVX-512F or AVX2),
    oneDNN's prepacked path and F.linear give the same products (bf16), and a row's result does not depend on how
    many rows come with it (decode vs verify), in blocks of 16 rows, with a remainder block and with K off the
    32-wide slice grid."""
    import torch.nn.functional as F

    from sglang_eagle3.kernels import decode as K
    extension = few_row_kernel_or_skip(kernel)
    torch.manual_seed(0)
    with extension.using_few_row(kernel):
        for N, Kd, bias in ((960, 576, True), (577, 575, False), (64, 1536, False), (8, 40, True)):
            w = (torch.randn(N, Kd) * 0.05).to(torch.bfloat16)
            b = torch.randn(N).to(torch.bfloat16) if bias else None
            lin = K.PackedLinear(w, b)
            assert lin.kernel == kernel and lin.small.dim() == PACKED_DIMS[kernel]
            for M in (1, 5, 16, 17, 40, 130):
                x = torch.randn(M, Kd).to(torch.bfloat16)
                ref = F.linear(x.float(), w.float(), None if b is None else b.float())
                got = lin(x).float()
                assert (got - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-3, (N, Kd, M)
                if M > 1 and M <= lin.small_m:
                    assert torch.equal(lin(x[:1]), lin(x)[:1]) and torch.equal(lin(x[-1:]), lin(x)[-1:])  # row-invariant
            # every pass plan (AVX-512: 16 rows as 8 + 8, 13 as 7 + 6; AVX2: 6 rows as 4 + 2, 12 as 11 + 1, ...)
            x = torch.randn(24, Kd).to(torch.bfloat16)
            one = torch.cat([lin(x[i:i + 1], any_rows=True) for i in range(24)])
            for M in range(2, 25):
                assert torch.equal(lin(x[:M], any_rows=True), one[:M]), (N, Kd, M)              # row-invariant


def test_the_avx512f_and_avx2_kernels_give_the_same_bits():
    """Both widening kernels sum each output over k in the same order (fp32 FMAs, k = 2p then 2p + 1), 16 and 8
    lanes at a time: the same bits for every row count, so a host's choice between them changes speed only."""
    from sglang_eagle3.kernels import decode as K
    extension = few_row_kernel_or_skip("avx512f")
    torch.manual_seed(2)
    for N, Kd, bias in ((960, 576, True), (49, 1535, False), (1536, 576, False)):
        w = (torch.randn(N, Kd) * 0.05).to(torch.bfloat16)
        b = torch.randn(N).to(torch.bfloat16) if bias else None
        lins = {}
        for kernel in ("avx512f", "avx2"):
            with extension.using_few_row(kernel):
                lins[kernel] = K.PackedLinear(w, b)
        for M in (1, 2, 3, 4, 7, 8, 12, 13, 16, 33):
            x = torch.randn(M, Kd).to(torch.bfloat16)
            assert torch.equal(lins["avx512f"](x, any_rows=True), lins["avx2"](x, any_rows=True)), (N, Kd, M)


def test_amx_and_avx512_kernels_round_alike():
    """On an AMX CPU both few-row kernels sum in fp32 and round to bf16 once: they differ on rare last-bit
    roundings only, so a draft or target behaves the same whichever kernel the host picks."""
    from sglang_eagle3.kernels import decode as K
    from sglang_eagle3.kernels import extension
    if not extension.amx_usable():
        pytest.skip("no AMX on this CPU (or the OS refuses tile data, or the build lacks it)")
    torch.manual_seed(1)
    w = (torch.randn(1000, 576) * 0.05).to(torch.bfloat16)
    x = torch.randn(8, 576).to(torch.bfloat16)
    with extension.using_amx(True):
        amx = K.PackedLinear(w)
    with extension.using_amx(False):
        avx = K.PackedLinear(w)
    a, b = amx(x), avx(x)
    assert (a != b).float().mean() < 0.01
    assert ((a.float() - b.float()).abs() <= b.float().abs() * 2 ** -7 + 1e-6).all()     # at most one bf16 ulp


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kernel", ["default", "avx512f"])
def test_fused_layer_step_equals_the_step_by_step_path(kernel, family):
    """bf16 decode and tree-verify forwards through csrc's layer_step (one C++ call per layer) give exactly the
    logits, features and KV entries of the layer-by-layer path: the same kernels in the same order (the host's
    few-row kernel, and the AVX-512F one; without biases, and with Qwen2's qkv biases)."""
    from sglang_eagle3.kernels import extension
    if kernel != "default":
        few_row_kernel_or_skip(kernel)
    with extension.using_few_row("auto" if kernel == "default" else kernel):
        tm, _ = tiny_target(family, dtype=torch.bfloat16)
    if not tm._fused_layers_apply(torch.zeros(1, 1, tm.hidden_size, dtype=torch.bfloat16), 1, None):
        pytest.skip("csrc's bf16 kernels are not available on this CPU")
    prompt, parents, tokens = [3, 1, 4, 1, 5, 9, 2], [-1, 0, 0, 1], [6, 20, 21, 30]
    depth = torch.tensor([[7, 8, 8, 9]])
    results = []
    for fused in (True, False):
        tm._layer_step_ok[extension.mode()] = fused
        cache = tm.new_cache(2, 32)
        tm(cache, torch.tensor([prompt, prompt]), torch.arange(7).expand(2, 7))
        cache.commit_prefix(torch.arange(2), torch.tensor([7, 7]))
        tree = tm(cache, torch.tensor([tokens, tokens[::-1]]), depth.expand(2, 4),
                  tree_mask=tree_mask_of(parents).expand(2, 4, 4))
        cache.commit(torch.arange(2), torch.tensor([[0, 1], [0, 2]]), torch.tensor([2, 2]))
        one = tm(cache, torch.tensor([[77], [78]]), torch.tensor([[9], [9]]))
        results.append((tree.logits, tree.aux_hidden_states, one.logits, one.aux_hidden_states,
                        cache.k.clone() if torch.is_tensor(cache.k) else [k.clone() for k in cache.k]))
    del tm._layer_step_ok[extension.mode()]
    for a, b in zip(*results):
        if isinstance(a, list):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        else:
            assert torch.equal(a, b)


def test_layer_weights_are_the_layers_own_built_once(monkeypatch):
    """Each layer's LayerWeights (what layer_step takes whole) is built with the model and holds the layer's own norms,
    packed linears and fp32 biases (shared, not copied) and sizes; a forward builds none; one with norms of two sizes
    is refused; a target built with the extension off has none (its layers run op by op)."""
    from sglang_eagle3.kernels import decode as K
    from sglang_eagle3.kernels import extension
    tm, _ = tiny_target("qwen2", dtype=torch.bfloat16)
    if tm.layers[0].layer_weights is None:
        pytest.skip("csrc's bf16 kernels are not available on this CPU")
    for layer in tm.layers:
        w = layer.layer_weights
        assert w.input_norm.data_ptr() == layer.input_norm.weight.data_ptr() and w.hidden_norm is None
        assert w.post_norm.data_ptr() == layer.post_norm.weight.data_ptr()
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            assert getattr(w, name).data_ptr() == getattr(layer, name).small.data_ptr(), name
        assert w.wqkv_bias.data_ptr() == layer.wqkv.bias32.data_ptr() and w.wo_bias is None    # Qwen2: qkv only
        assert (w.eps, w.qkv_features, w.gate_up_features, w.num_heads, w.num_kv_heads) == \
            (layer.eps, layer.wqkv.out_features, layer.w_gate_up.out_features, tm.num_heads, tm.num_kv_heads)

    def refuse(*args, **kwargs):
        raise AssertionError("a forward built a LayerWeights")
    with monkeypatch.context() as m:
        m.setattr(extension.load(), "LayerWeights", refuse)
        cache = tm.new_cache(1, 16)
        assert tm._fused_layers_apply(torch.zeros(1, 1, tm.hidden_size, dtype=torch.bfloat16), 1, None)
        tm(cache, torch.tensor([[3, 1, 4]]), torch.arange(3).view(1, 3))
    layer = tm.layers[0]
    with pytest.raises(RuntimeError, match="LayerWeights: the norms"):
        K.layer_weights(layer.input_norm.weight, layer.post_norm.weight[1:], layer.eps, layer.wqkv, layer.wo,
                        layer.w_gate_up, layer.w_down, tm.num_heads, tm.num_kv_heads)
    with extension.using("off"):
        off, _ = tiny_target("qwen2", dtype=torch.bfloat16)
        assert all(layer.layer_weights is None for layer in off.layers)
        assert not off._fused_layers_apply(torch.zeros(1, 1, off.hidden_size, dtype=torch.bfloat16), 1, None)


@pytest.mark.parametrize("kernel", ["default", "avx512f"])
@pytest.mark.parametrize("fused", [True, False], ids=["layer_step", "layer_by_layer"])
def test_a_rows_verify_does_not_depend_on_the_batch(fused, kernel):
    """bf16: a row's logits from a verify of 6 rows x 8 tree tokens (48 rows of every product, over the AVX-512
    kernel's prefill boundary of 32) equal that row's verify alone, bit for bit, on both forward paths, with the
    host's few-row kernel and with the AVX-512F one: what a speculative step computes for a request does not depend
    on what else is batched with it, so greedy output stays vanilla's at batch 8 with 8-token trees too."""
    from sglang_eagle3.kernels import extension
    if kernel != "default":
        few_row_kernel_or_skip(kernel)
    # SmolLM2's widths: at the default hidden size of 64, oneDNN's sums happen to match the kernel's
    with extension.using_few_row("auto" if kernel == "default" else kernel):
        tm, _ = tiny_target("llama", dtype=torch.bfloat16, logit_scale=4.0, hidden_size=576, intermediate_size=1536,
                            head_dim=64)
    if tm.layers[0].wqkv.small is None:
        pytest.skip("csrc's bf16 kernels are not available on this CPU")
    assert kernel == "default" or tm.layers[0].wqkv.kernel == kernel
    torch.manual_seed(0)
    B, T, P = 6, 8, 9
    parents = [-1, 0, 0, 1, 2, 2, 5, 3]
    depth = torch.tensor([len(path_to(parents, i)) - 1 for i in range(T)]) + P
    prompts, trees = torch.randint(3, tm.vocab_size, (B, P)), torch.randint(3, tm.vocab_size, (B, T))
    tm._layer_step_ok[extension.mode()] = fused
    try:
        cache = tm.new_cache(B, 32)
        tm(cache, prompts, torch.arange(P).expand(B, P))
        cache.commit_prefix(torch.arange(B), torch.full((B,), P))
        together = tm(cache, trees, depth.expand(B, T), tree_mask=tree_mask_of(parents).expand(B, T, T)).logits
        for b in range(B):
            alone = tm(cache, trees[b:b + 1], depth.view(1, T), tree_mask=tree_mask_of(parents).unsqueeze(0),
                       rows=torch.tensor([b])).logits
            assert torch.equal(alone[0], together[b]), b
    finally:
        del tm._layer_step_ok[extension.mode()]


@pytest.mark.parametrize("fused", [True, False], ids=["layer_step", "layer_by_layer"])
def test_a_ragged_verify_computes_each_rows_own_tree(fused, monkeypatch):
    """A verify whose rows hold trees of different sizes (row_tokens; the rest of each row padding that no real node
    sees): each row's logits and features at its real nodes equal, bit for bit, a verify of that row's own tree
    alone. Where csrc's layers run, the padding is not computed at all (x holds only the real tokens)."""
    from sglang_eagle3.kernels import decode as K
    from sglang_eagle3.kernels import extension
    tm, _ = tiny_target("llama", dtype=torch.bfloat16, logit_scale=4.0, hidden_size=576, intermediate_size=1536,
                        head_dim=64)
    if tm.layers[0].wqkv.small is None:
        pytest.skip("csrc's bf16 kernels are not available on this CPU")
    torch.manual_seed(1)
    sizes = [8, 1, 3, 8, 5, 2]
    B, T, P = len(sizes), 8, 9
    parents = [-1, 0, 0, 1, 2, 2, 5, 3]
    depth = torch.tensor([len(path_to(parents, i)) - 1 for i in range(T)]) + P
    prompts, trees = torch.randint(3, tm.vocab_size, (B, P)), torch.randint(3, tm.vocab_size, (B, T))
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    for b, n in enumerate(sizes):
        mask[b, :n, :n] = tree_mask_of(parents[:n])
        mask[b, n:, n:] = torch.eye(T - n, dtype=torch.bool)          # padding sees only itself
    tm._layer_step_ok[extension.mode()] = fused
    calls = []
    real_step = K.layer_step
    monkeypatch.setattr(K, "layer_step", lambda x, *a: calls.append(x.shape[:2]) or real_step(x, *a))
    try:
        cache = tm.new_cache(B, 32)
        tm(cache, prompts, torch.arange(P).expand(B, P))
        cache.commit_prefix(torch.arange(B), torch.full((B,), P))
        calls.clear()
        ragged = tm(cache, trees, depth.expand(B, T), tree_mask=mask, row_tokens=torch.tensor(sizes))
        assert calls == ([torch.Size([1, sum(sizes)])] * tm.num_layers if fused else [])   # real tokens only
        for b, n in enumerate(sizes):
            alone = tm(cache, trees[b:b + 1, :n], depth[:n].view(1, n), tree_mask=tree_mask_of(parents[:n])[None],
                       rows=torch.tensor([b]))
            assert torch.equal(alone.logits[0], ragged.logits[b, :n]), b
            assert torch.equal(alone.aux_hidden_states[0], ragged.aux_hidden_states[b, :n]), b
    finally:
        del tm._layer_step_ok[extension.mode()]


def test_one_row_commit_moves_what_the_batched_commit_moves():
    """kvcache.commit has a one-row CPU path (strided copies) beside the gathers of the batched one: both move
    slot start+keep[j] to start+j and leave everything else alone."""
    from sglang_eagle3.models.kvcache import KVPool
    g = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(3, 2, 2, 24, 4, generator=g), torch.randn(3, 2, 2, 24, 4, generator=g)
    for keep in ([0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 3, 5], [0, 4, 5, 6, 7]):
        want_k, want_v = k0.clone(), v0.clone()
        for j, s in enumerate(keep):
            want_k[:, 1, :, 9 + j], want_v[:, 1, :, 9 + j] = k0[:, 1, :, 9 + s], v0[:, 1, :, 9 + s]
        for rows in ([1], [1, 0]):                       # [1, 0]: the batched path (row 0 keeps its slots)
            p = KVPool(3, 2, 2, 24, 4, torch.float32, "cpu")
            p.k.copy_(k0)
            p.v.copy_(v0)
            p.lens[:] = torch.tensor([5, 9])
            ks = torch.tensor([keep] + [list(range(len(keep)))] * (len(rows) - 1))
            p.commit(torch.tensor(rows), ks, torch.full((len(rows),), len(keep)))
            assert int(p.lens[1]) == 9 + len(keep)
            assert torch.equal(p.k, want_k) and torch.equal(p.v, want_v), (keep, rows)


def test_bf16_kernels_miss_fp32_greedy_only_at_near_ties(smollm2_path):
    """Each bf16 decode path of ours (AMX tiles where the CPU has them, AVX-512 BF16 or AVX2, eager PyTorch),
    teacher-forced one token per step on SmolLM2's fp32 greedy answers: its argmax leaves fp32's only where
    fp32's two best logits are within 0.5 (transformers' own bf16 model misses up to 0.25 on 40 eval prompts,
    bench/bench_fidelity.py). "What is the capital of France?" is such a near-tie at its first token: fp32 "The"
    25.33 vs "L" 25.24, so bf16 paths may answer either; a broken kernel misses at wide margins."""
    from sglang_eagle3.bench.fidelity import available_paths, measure
    paths = [p for p in available_paths() if p not in ("transformers", "float32")]
    prompts = ["What is the capital of France?", "Name three primary colors.",
               "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
               "How many clips did Natalia sell altogether in April and May?"]
    r = measure(smollm2_path, prompts, 24, paths + ["float32"], progress=False)
    assert r["paths"]["float32"]["misses"] == 0
    for name in paths:
        s = r["paths"][name]
        assert s["max_margin_missed"] is None or s["max_margin_missed"] < 0.5, (name, s["misses_by_margin"])
        assert s["agreement"] >= 0.9, (name, s["misses"], s["steps"])

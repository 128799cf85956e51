"""Chat data: loaders, chat-template rendering, assistant loss masks, prepared datasets on disk."""
from __future__ import annotations

import json
import os

import pytest

from sglang_eagle3.training.data import (
    BadRow,
    ChatRenderer,
    ChatTemplateError,
    Conversation,
    DataError,
    load_tokenized,
    normalise,
    parse_source,
    prepare_dataset,
    read_source,
    read_stats,
)
from sglang_eagle3.training.data.build import apply_length, distinct_ngram_ratio, iter_tokenized, loop_start

# ---- tiny tokenizers with the chat templates of common families --------------------------------
CORPUS = ["Hello there, how are you today?", "I am fine, thanks. What is 2 + 2?", "The answer is 4.",
          "You are a helpful assistant.", "system user assistant model tool", "def f(x):\n    return x * 2\n"] * 4

LLAMA3 = ("{{ bos_token }}{% for m in messages %}"
          "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Mistral v0.3 style: strict alternation, the system prompt goes into the LAST user turn only.
MISTRAL = ("{% if messages[0]['role'] == 'system' %}{% set system_message = messages[0]['content'] %}"
           "{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}"
           "{{ bos_token }}{% for m in loop_messages %}"
           "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if m['role'] == 'user' %}{% if loop.last and system_message is defined %}"
           "{{ '[INST] ' + system_message + '\n\n' + m['content'] + '[/INST]' }}"
           "{% else %}{{ '[INST] ' + m['content'] + '[/INST]' }}{% endif %}"
           "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")

# Gemma (1.x) style: no system role, assistant is called 'model'.
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for m in messages %}"
         "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if m['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = m['role'] %}{% endif %}"
         "{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")

# Qwen3 style: only the LAST answer carries an (empty) reasoning block, so renderings are not prefix-stable.
QWEN3 = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
         "{% if loop.last %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{{ m['content'] + '<|im_end|>\n' }}"
         "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

FAMILIES = {   # name: (template, special tokens, bos, eos, end-of-turn marker, text before the answer)
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>", ""),
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], None, "<|im_end|>", "<|im_end|>", ""),
    "mistral": (MISTRAL, ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", "</s>", " "),
    "gemma": (GEMMA, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", "<end_of_turn>", ""),
    "qwen3": (QWEN3, ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"], None, "<|im_end|>",
              "<|im_end|>", ""),
}
_CACHE: dict = {}


def tiny_tokenizer(family: str):
    """A byte-level BPE trained on a few strings, with the family's special tokens and chat template."""
    if family in _CACHE:
        return _CACHE[family]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    template, specials, bos, eos, _, _ = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                   additional_special_tokens=[s for s in specials if s not in (bos, eos)])
    fast.chat_template = template
    fast.name_or_path = f"tiny-{family}"
    _CACHE[family] = fast
    return fast


def conv(*pairs, system=None):
    msgs = [{"role": "system", "content": system}] if system else []
    for role, text in pairs:
        msgs.append({"role": role, "content": text})
    return Conversation(msgs)


MULTI = conv(("user", "Hello there, how are you?"), ("assistant", "I am fine, thanks."),
             ("user", "What is 2 + 2?"), ("assistant", "The answer is 4.\nDone."))
WITH_SYSTEM = conv(("user", "What is 2 + 2?"), ("assistant", "It is 4."), ("user", "And 3 + 3?"),
                   ("assistant", "It is 6."), system="You are a terse math tutor.")


def masked_runs(tok, enc) -> list[str]:
    """Decoded text of each maximal run of loss-masked tokens."""
    runs, cur = [], []
    for i, m in zip(enc.input_ids, enc.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def check_mask(tok, c: Conversation, eot: str, head: str = "", renderer=None, prompts_rendered=True):
    renderer = renderer or ChatRenderer(tok)
    enc = renderer.encode(c)
    answers = [m["content"] for m in c.messages if m["role"] == "assistant"]
    assert masked_runs(tok, enc) == [head + a + eot for a in answers]
    unmasked = tok.decode([i for i, m in zip(enc.input_ids, enc.loss_mask) if not m])
    for m in c.messages:
        if m["role"] != "assistant":
            assert m["content"] not in tok.decode([i for i, k in zip(enc.input_ids, enc.loss_mask) if k])
            if prompts_rendered:
                assert m["content"] in unmasked
    # the tokens are exactly what the template gives when it tokenizes itself
    msgs, tools = renderer.prepare(c)
    ids = tok.apply_chat_template(msgs, tools=tools, tokenize=True)
    assert enc.input_ids == list(ids["input_ids"] if not isinstance(ids, list) else ids)
    return enc


@pytest.mark.parametrize("family", ["llama3", "chatml", "mistral", "gemma"])
def test_mask_multi_turn(family):
    tok = tiny_tokenizer(family)
    _, _, _, _, eot, head = FAMILIES[family]
    enc = check_mask(tok, MULTI, eot, head)
    assert not enc.fallback


@pytest.mark.parametrize("family", ["llama3", "chatml", "mistral"])
def test_mask_with_system_prompt(family):
    tok = tiny_tokenizer(family)
    _, _, _, _, eot, head = FAMILIES[family]
    # mistral v0.3 shows the system prompt only when the conversation ends with a user turn
    enc = check_mask(tok, WITH_SYSTEM, eot, head, prompts_rendered=family != "mistral")
    assert enc.fallback == (family == "mistral")   # mistral moves the system prompt: not prefix-stable


def test_mask_prompt_tokens_match_generation_prompt():
    """The unmasked prefix before each answer is what the target sees at inference (add_generation_prompt)."""
    tok = tiny_tokenizer("llama3")
    enc = ChatRenderer(tok).encode(WITH_SYSTEM)
    starts = [i for i, m in enumerate(enc.loss_mask) if m and (i == 0 or not enc.loss_mask[i - 1])]
    assistant_idx = [i for i, m in enumerate(WITH_SYSTEM.messages) if m["role"] == "assistant"]
    for start, i in zip(starts, assistant_idx):
        prompt = tok.apply_chat_template(WITH_SYSTEM.messages[:i], add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if not isinstance(prompt, list) else prompt)
        assert enc.input_ids[:start] == prompt


def test_mask_template_not_prefix_stable():
    tok = tiny_tokenizer("qwen3")
    enc = ChatRenderer(tok).encode(MULTI)
    assert enc.fallback
    assert masked_runs(tok, enc) == ["I am fine, thanks.<|im_end|>", "<think>\n\n</think>\n\nThe answer is 4.\nDone.<|im_end|>"]


def test_gemma_system_rejected_then_merged():
    tok = tiny_tokenizer("gemma")
    with pytest.raises(ChatTemplateError, match="System role not supported.*--merge-system"):
        ChatRenderer(tok).encode(WITH_SYSTEM)
    r = ChatRenderer(tok, merge_system=True)
    enc = check_mask(tok, WITH_SYSTEM, "<end_of_turn>", renderer=r, prompts_rendered=False)
    assert "You are a terse math tutor.\n\nWhat is 2 + 2?" in enc.text


def test_alternation_error_names_template():
    tok = tiny_tokenizer("mistral")
    c = conv(("user", "a"), ("user", "b"), ("assistant", "c"))
    with pytest.raises(ChatTemplateError, match="tiny-mistral.*roles user/user/assistant.*must alternate"):
        ChatRenderer(tok).encode(c)


def test_tool_calls_are_trained_observations_are_not():
    tok = tiny_tokenizer("chatml")
    row = {"conversations": [{"from": "human", "value": "Find a recipe"},
                             {"from": "function_call", "value": '{"name": "search", "arguments": {}}'},
                             {"from": "observation", "value": '{"recipes": ["stew"]}'},
                             {"from": "gpt", "value": "Try the stew."}],
           "tools": '[{"name": "search", "description": "find recipes"}]'}
    c = normalise(row, "sharegpt")
    assert [m["role"] for m in c.messages] == ["user", "assistant", "tool", "assistant"]
    enc = ChatRenderer(tok).encode(c)
    assert masked_runs(tok, enc) == ['{"name": "search", "arguments": {}}<|im_end|>', "Try the stew.<|im_end|>"]
    assert '"description": "find recipes"' in enc.text   # template has no tools=: definitions go to the system turn
    assert '<|im_start|>tool\n{"recipes"' in enc.text


def test_offsets_and_piecewise_encoding_agree_on_mask_text():
    tok = tiny_tokenizer("chatml")
    r = ChatRenderer(tok)
    a = r.encode(MULTI)
    r.use_offsets = False
    b = r.encode(MULTI)
    assert masked_runs(tok, a) == masked_runs(tok, b)
    assert b.exact and b.input_ids == a.input_ids and b.loss_mask == a.loss_mask


def test_no_chat_template_is_an_error():
    from transformers import PreTrainedTokenizerFast
    tok = tiny_tokenizer("chatml")
    bare = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer)
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        ChatRenderer(bare)


# ---- the real SmolLM2 tokenizer (skips when the testbed has not been prepared) ---------------------
def smollm2_tokenizer():
    from sglang_eagle3.models.testbed import is_ready, testbed_path
    if not is_ready(testbed_path()):
        pytest.skip("SmolLM2 testbed not prepared (run `eagle3 testbed`)")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(testbed_path())


@pytest.mark.parametrize("c", [MULTI, WITH_SYSTEM])
def test_mask_real_smollm2(c):
    tok = smollm2_tokenizer()
    enc = check_mask(tok, c, "<|im_end|>")
    assert not enc.fallback
    # nothing after the last end-of-turn marker is trained (the template's trailing newline)
    last = max(i for i, m in enumerate(enc.loss_mask) if m)
    assert tok.convert_ids_to_tokens(enc.input_ids[last]) == "<|im_end|>"
    assert enc.loss_mask[last + 1:] == [0] * (len(enc.loss_mask) - last - 1)


# ---- loaders -------------------------------------------------------------------------------------
def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def load(path, fmt=None, require_assistant=True):
    return list(read_source(parse_source(str(path), fmt), require_assistant))


def test_ultrachat_hf_messages(tmp_path):
    p = write_jsonl(tmp_path / "uc.jsonl", [
        {"prompt": "hi", "prompt_id": "p1", "messages": [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "hello"},
                                                         {"role": "user", "content": "bye"},
                                                         {"role": "assistant", "content": "ciao"}]},
        {"prompt_id": "p2", "messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]},
                                         {"role": "assistant", "content": "ok"}]},
        {"prompt_id": "p3", "messages": [{"role": "user", "content": "only a question"}]},
        {"prompt_id": "p4", "messages": "not a list"},
    ])
    rows = load(p)
    c = rows[0][1]
    assert c.id == "p1" and c.key == "uc.jsonl:1"
    assert [m["content"] for m in c.messages] == ["hi", "hello", "bye", "ciao"]
    assert rows[1][1].messages[0]["content"] == "parts"
    assert str(rows[2][1]) == "no assistant turn"
    assert str(rows[3][1]).startswith("wrong types")


def test_ultrachat_original_data_list(tmp_path):
    p = write_jsonl(tmp_path / "uc_orig.jsonl", [{"id": "0", "data": ["q1", "a1", "q2", "a2"]},
                                                 {"id": "1", "data": ["q1", ""]}])
    rows = load(p)
    assert [(m["role"], m["content"]) for m in rows[0][1].messages] == [
        ("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2")]
    assert str(rows[1][1]).startswith("empty text")


def test_sharegpt_alpaca_gsm8k_prompts(tmp_path):
    sg = write_jsonl(tmp_path / "sg.jsonl", [
        {"id": "a", "system": "Be nice.", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "chunk tail"}, {"from": "human", "value": "q"},
                                      {"from": "gpt", "value": "a"}, {"from": "human", "value": "dangling"}]},
        {"id": "c", "conversations": [{"from": "robot", "value": "x"}]},
        {"id": "d", "conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "a"}]},
    ])
    rows = load(sg)
    assert [m["role"] for m in rows[0][1].messages] == ["system", "user", "assistant"]
    assert [m["content"] for m in rows[1][1].messages] == ["q", "a"]
    assert set(rows[1][1].notes) == {"leading non-user turns dropped", "trailing non-assistant turns dropped"}
    assert str(rows[2][1]) == "unknown role 'robot'"
    assert str(rows[3][1]).startswith("wrong types")

    al = tmp_path / "al.json"
    al.write_text(json.dumps([{"instruction": "Add", "input": "2 and 2", "output": "4"},
                              {"instruction": "Say hi", "input": "", "output": "hi", "history": [["q0", "a0"]]}]))
    rows = load(al)
    assert rows[0][1].messages == [{"role": "user", "content": "Add\n\n2 and 2"}, {"role": "assistant", "content": "4"}]
    assert [m["content"] for m in rows[1][1].messages] == ["q0", "a0", "Say hi", "hi"]

    gs = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "1+1?", "answer": "2\n#### 2"}])
    assert load(gs)[0][1].messages[1]["content"] == "2\n#### 2"

    ev = write_jsonl(tmp_path / "mt.jsonl", [{"question_id": 81, "category": "w", "turns": ["t1", "t2"]}])
    assert str(load(ev)[0][1]) == "no assistant turn"
    c = load(ev, require_assistant=False)[0][1]
    assert c.id == "81" and [m["content"] for m in c.messages] == ["t1", "t2"]


def test_bad_files_name_file_and_row(tmp_path):
    p = write_jsonl(tmp_path / "weird.jsonl", [{"text": "no chat here"}])
    with pytest.raises(DataError, match=r"weird.jsonl: row 1 matches no supported format.*\['text'\]"):
        load(p)
    p = write_jsonl(tmp_path / "broken.jsonl", [{"question": "q", "answer": "a"}, "", "{not json",
                                                 {"question": "q2", "answer": "a2"}])
    rows = load(p)                                     # a broken line is a malformed row: skipped and counted
    assert [n for n, r in rows if isinstance(r, BadRow)] == [3]
    assert str(rows[1][1]).startswith("not valid JSON") and rows[2][1].messages[0]["content"] == "q2"
    p = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r"gsm.jsonl: row 1 does not have the sharegpt fields"):
        load(p, "sharegpt")
    assert load(f"{p}:gsm8k")[0][1].messages[0]["content"] == "q"   # PATH:FORMAT
    with pytest.raises(DataError, match="no such file"):
        parse_source(str(tmp_path / "missing.jsonl"))
    assert parse_source("HuggingFaceH4/ultrachat_200k@train_sft:messages").is_hub


def test_hub_ids_use_datasets_load_dataset(monkeypatch):
    import datasets
    seen = {}

    def fake_load(name, split):
        seen.update(name=name, split=split)
        return [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    rows = list(read_source(parse_source("HuggingFaceH4/ultrachat_200k@train_sft")))
    assert seen == {"name": "HuggingFaceH4/ultrachat_200k", "split": "train_sft"}
    assert rows[0][1].source == "HuggingFaceH4/ultrachat_200k@train_sft"


def test_length_policy():
    ids, mask = list(range(10)), [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert apply_length(ids, mask, 20, "drop") == (ids, mask, False)
    with pytest.raises(BadRow, match="longer than"):
        apply_length(ids, mask, 5, "drop")
    assert apply_length(ids, mask, 5, "truncate") == (ids[:5], mask[:5], True)
    with pytest.raises(BadRow, match="no assistant token within"):
        apply_length(ids, mask, 3, "truncate")


def test_distinct_ngram_ratio_flags_loops_only():
    prose = list(range(100))
    loop = [1, 2, 3, 4, 5] * 20                      # one 5-token sentence repeated
    assert distinct_ngram_ratio(prose, [1] * 100) == 1.0
    assert distinct_ngram_ratio(loop, [1] * 100) == pytest.approx(5 / 93)
    assert distinct_ngram_ratio(loop, [0] * 100) == 1.0            # prompts never count
    assert distinct_ngram_ratio(loop[:7], [1] * 7) == 1.0           # shorter than one 8-gram
    # a repeated prompt with a fresh answer is prose: only assistant tokens are scored
    assert distinct_ngram_ratio(loop + prose, [0] * 100 + [1] * 100) == 1.0


def test_prepare_drops_looping_answers_and_counts_them(tmp_path):
    from sglang_eagle3.cli import main
    tok_dir = tmp_path / "tok"
    tiny_tokenizer("chatml").save_pretrained(tok_dir)
    words = " ".join(f"w{i}" for i in range(60))
    p = write_jsonl(tmp_path / "sg.jsonl", [
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": words}]},
        {"conversations": [{"from": "human", "value": "b"}, {"from": "gpt", "value": "I am a loop. " * 40}]},
    ])
    out = tmp_path / "ds"
    assert main(["prepare-data", p, "--target", str(tok_dir), "--out", str(out), "--quiet",
                 "--min-distinct-ngrams", "0.5"]) == 0
    st = read_stats(str(out))
    assert st["total"]["kept"] == 1 and st["min_distinct_ngrams"] == 0.5
    assert st["total"]["dropped_by_reason"] == {
        "looping answer (distinct 8-gram ratio < 0.5)": {"rows": 1, "first_row": "sg.jsonl:2"}}
    assert main(["prepare-data", p, "--target", str(tok_dir), "--out", str(tmp_path / "all"), "--quiet"]) == 0
    assert read_stats(str(tmp_path / "all"))["total"]["kept"] == 2         # off by default
    assert main(["prepare-data", p, "--target", str(tok_dir), "--out", str(tmp_path / "x"), "--quiet",
                 "--min-distinct-ngrams", "2"]) == 2
    assert main(["prepare-data", p, "--target", str(tok_dir), "--out", str(tmp_path / "y"), "--quiet",
                 "--cut-loops"]) == 2
    # --cut-loops keeps the looping row up to its first repeated 8-gram: no loop left, the answer's start kept
    assert main(["prepare-data", p, "--target", str(tok_dir), "--out", str(tmp_path / "cut"), "--quiet",
                 "--min-distinct-ngrams", "0.5", "--cut-loops"]) == 0
    st = read_stats(str(tmp_path / "cut"))
    assert st["total"]["kept"] == 2 and st["total"]["notes"] == {"looping answer cut where the loop begins": 1}
    ids, mask = list(iter_tokenized(str(tmp_path / "cut")))[1]
    answer = [t for t, m in zip(ids.tolist(), mask.tolist()) if m]
    assert distinct_ngram_ratio(ids.tolist(), mask.tolist()) == 1.0 and len(answer) >= 8
    assert loop_start(ids.tolist(), mask.tolist()) is None


# ---- prepared datasets -------------------------------------------------------------------------
def test_prepare_dataset_end_to_end(tmp_path):
    tok = tiny_tokenizer("chatml")
    sg = write_jsonl(tmp_path / "sg.jsonl", [
        {"conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "Hi! " * 30}]},
        {"conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi."}]},
        {"conversations": [{"from": "human", "value": "no answer"}]},
        {"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "x"}]},
    ])
    gs = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "What is 2 + 2?", "answer": "4"}] * 3)
    out = str(tmp_path / "ds")
    stats = prepare_dataset([parse_source(sg), parse_source(gs)], tok, out, max_length=40, length_policy="drop",
                            progress=False)
    assert stats["examples"] == 4 and stats["total"]["kept"] == 4 and stats["total"]["rows"] == 7
    s = stats["sources"]["sg.jsonl"]
    assert s["dropped_by_reason"] == {"longer than --max-length": {"rows": 1, "first_row": 1},
                                      "no assistant turn": {"rows": 1, "first_row": 3},
                                      "empty text": {"rows": 1, "first_row": 4}}
    assert read_stats(out) == stats
    ds = load_tokenized(out)
    assert ds.column_names == ["input_ids", "loss_mask", "id", "source"] and len(ds) == 4
    assert sum(map(sum, ds["loss_mask"])) == stats["total"]["assistant_tokens"]
    assert tok.decode([i for i, m in zip(ds[0]["input_ids"], ds[0]["loss_mask"]) if m]) == "Hi.<|im_end|>"
    rows = list(iter_tokenized(out, batch_rows=2))
    assert [r[0].tolist() for r in rows] == ds["input_ids"]
    with pytest.raises(DataError, match="exists; pass --overwrite"):
        prepare_dataset([parse_source(gs)], tok, out, progress=False)
    prepare_dataset([parse_source(gs)], tok, out, overwrite=True, max_length=40, length_policy="truncate",
                    progress=False)
    assert len(load_tokenized(out)) == 3


def test_prepare_failure_leaves_nothing(tmp_path):
    tok = tiny_tokenizer("chatml")
    good = write_jsonl(tmp_path / "good.jsonl", [{"question": "q", "answer": "a"}])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"foo": 1}])
    out = tmp_path / "ds"
    with pytest.raises(DataError, match="bad.jsonl: row 1"):
        prepare_dataset([parse_source(good), parse_source(bad)], tok, str(out), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "good.jsonl"]   # no output, no tmp dir


def test_prepare_template_errors_stop_or_skip(tmp_path):
    tok = tiny_tokenizer("mistral")
    p = write_jsonl(tmp_path / "sg.jsonl", [
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
        {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}, {"from": "gpt", "value": "c"}]},
    ])
    with pytest.raises(ChatTemplateError, match="sg.jsonl: row 2: .*must alternate"):
        prepare_dataset([parse_source(p)], tok, str(tmp_path / "ds"), progress=False)
    stats = prepare_dataset([parse_source(p)], tok, str(tmp_path / "ds"), skip_template_errors=True, progress=False)
    assert stats["total"]["kept"] == 1 and stats["total"]["dropped"] == 1


def gsm_inputs(tmp_path):
    """A tokenizer folder and a five-row GSM8K-style file: prepare-data's inputs in the command-line tests."""
    tok_dir = tmp_path / "tok"
    tiny_tokenizer("llama3").save_pretrained(tok_dir)
    return tok_dir, write_jsonl(tmp_path / "gsm.jsonl", [{"question": "What is 2 + 2?",
                                                          "answer": "The answer is 4."}] * 5)


def test_cli_prepare_data_and_errors(tmp_path, capsys):
    from sglang_eagle3.cli import main
    tok_dir, p = gsm_inputs(tmp_path)
    out = tmp_path / "ds"
    assert main(["prepare-data", p, "--target", str(tok_dir), "--out", str(out), "--quiet",
                 "--draft-vocab-size", "16"]) == 0
    text = capsys.readouterr().out
    assert "gsm.jsonl: rows 5, kept 5, dropped 0" in text and "draft vocab 16 of" in text
    assert sorted(os.listdir(out)) == ["data.arrow", "draft_vocab.json", "draft_vocab.safetensors", "stats.json"]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"foo": 1}])
    assert main(["prepare-data", bad, "--target", str(tok_dir), "--out", str(tmp_path / "x"), "--quiet"]) == 2
    assert "bad.jsonl: row 1 matches no supported format" in capsys.readouterr().err
    # numbers are checked before anything is read or written (a draft vocabulary larger than the target's used to
    # be a traceback after the data set was written)
    for extra, said in ((["--draft-vocab-size", "0"], "--draft-vocab-size must be >= 1, got 0"),
                        (["--draft-vocab-size", "100000"], "--draft-vocab-size 100000 exceeds the target vocabulary"),
                        (["--max-rows", "0"], "--max-rows must be >= 1, got 0")):
        assert main(["prepare-data", p, "--target", str(tok_dir), "--out", str(tmp_path / "y"), "--quiet",
                     *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "y").exists()
    assert main(["prepare-data", p, "--target", str(tok_dir), "--out", str(out), "--quiet"]) == 2
    assert f"--out {out} exists; pass --overwrite" in capsys.readouterr().err


def test_prepare_data_never_replaces_its_own_input(tmp_path, capsys):
    """--out that contains an input (here regenerate's output and its settings file) is refused before anything is
    read: --overwrite used to delete the folder, the input with it."""
    from sglang_eagle3.cli import main
    tok_dir = tmp_path / "tok"
    tiny_tokenizer("llama3").save_pretrained(tok_dir)
    box = tmp_path / "D"
    box.mkdir()
    p = write_jsonl(box / "regen.jsonl", [{"question": "What is 2 + 2?", "answer": "4."}] * 3)
    (box / "regen.jsonl.settings.json").write_text("{}")
    assert main(["prepare-data", f"{p}:gsm8k", "--target", str(tok_dir), "--out", str(box), "--quiet",
                 "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {box} contains input {p}: an output must not be" in err, err
    assert sorted(os.listdir(box)) == ["regen.jsonl", "regen.jsonl.settings.json"]
    assert main(["prepare-data", p, "--target", str(tok_dir), "--out", p, "--overwrite", "--quiet"]) == 2
    assert f"--out {p} is the same path as input {p}" in capsys.readouterr().err


def test_prepare_data_overwrite_replaces_the_data_set_only(tmp_path, capsys):
    """--overwrite replaces the data set's files (data.arrow, stats.json, the vocabulary built from them) and keeps
    a user's files, naming them; an --out that is a file is refused, not replaced by a folder."""
    from sglang_eagle3.cli import main
    tok_dir, p = gsm_inputs(tmp_path)
    out = tmp_path / "ds"
    assert main(["prepare-data", p, "--target", str(tok_dir), "--out", str(out), "--quiet",
                 "--draft-vocab-size", "16"]) == 0
    (out / "NOTES.txt").write_text("my notes")
    capsys.readouterr()
    assert main(["prepare-data", p, "--target", str(tok_dir), "--out", str(out), "--quiet", "--max-rows", "2",
                 "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["NOTES.txt", "data.arrow", "stats.json"]      # the old vocabulary went too
    assert len(load_tokenized(str(out))) == 2 and (out / "NOTES.txt").read_text() == "my notes"
    assert f"replaced the data set in {out}; kept NOTES.txt" in capsys.readouterr().err
    (tmp_path / "f.jsonl").write_text("precious")
    assert main(["prepare-data", p, "--target", str(tok_dir), "--out", str(tmp_path / "f.jsonl"), "--quiet",
                 "--overwrite"]) == 2
    assert f"--out {tmp_path / 'f.jsonl'} is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "f.jsonl").read_text() == "precious"


def test_prepared_files_get_the_usual_permissions(tmp_path):
    """The vocabulary file follows the umask like every other file (safetensors' save_file made it 0600)."""
    from sglang_eagle3.cli import main
    tok_dir, p = gsm_inputs(tmp_path)
    old = os.umask(0o022)
    try:
        assert main(["prepare-data", p, "--target", str(tok_dir), "--out", str(tmp_path / "ds"), "--quiet",
                     "--draft-vocab-size", "16"]) == 0
    finally:
        os.umask(old)
    modes = {f: os.stat(tmp_path / "ds" / f).st_mode & 0o777 for f in os.listdir(tmp_path / "ds")}
    assert modes == {f: 0o644 for f in ("data.arrow", "stats.json", "draft_vocab.safetensors", "draft_vocab.json")}


# ---- the shared real training files ---------------------------------------------------------------
REAL = {"sharegpt_1k.jsonl": 1000, "alpaca_en_demo.json": 999, "glaive_toolcall_en_demo.json": 300,
        "gsm8k_train.jsonl": 7473, "sharegpt_prompts.jsonl": 3808}


def test_real_training_files_load():
    from sglang_eagle3.paths import data_dir
    root = os.path.join(data_dir(), "train")
    if not os.path.isdir(root):
        pytest.skip("shared data not present")
    for name, n in REAL.items():
        rows = load(os.path.join(root, name))
        assert len(rows) == n
        kept = [c for _, c in rows if isinstance(c, Conversation)]
        reasons = {str(c).split(" in ")[0] for _, c in rows if isinstance(c, BadRow)}
        assert reasons <= {"no assistant turn", "no user turn", "empty text"}, (name, reasons)
        if name == "sharegpt_prompts.jsonl":
            assert not kept and len(load(os.path.join(root, name), require_assistant=False)) == n
        else:
            assert len(kept) >= 0.98 * n, name
    glaive = load(os.path.join(root, "glaive_toolcall_en_demo.json"))
    roles = {m["role"] for _, c in glaive for m in c.messages}
    assert roles == {"user", "assistant", "tool"} and any(c.tools for _, c in glaive)


def test_real_files_render_with_smollm2(tmp_path):
    from sglang_eagle3.paths import data_dir
    tok = smollm2_tokenizer()
    root = os.path.join(data_dir(), "train")
    if not os.path.isdir(root):
        pytest.skip("shared data not present")
    srcs = [parse_source(os.path.join(root, n)) for n in REAL if n != "sharegpt_prompts.jsonl"]
    stats = prepare_dataset(srcs, tok, str(tmp_path / "ds"), max_length=2048, max_rows=60, progress=False)
    for name, st in stats["sources"].items():
        assert st["kept"] >= 50, (name, st)
    ds = load_tokenized(str(tmp_path / "ds"))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for row in ds.select(range(0, len(ds), 25)):
        ids, mask = row["input_ids"], row["loss_mask"]
        ends = [ids[i] for i in range(len(ids) - 1) if mask[i] and not mask[i + 1]]
        assert ends and all(t == end for t in ends)   # every trained run closes with the end-of-turn token


def test_template_with_native_tools_gets_tools_argument():
    from transformers import PreTrainedTokenizerFast
    base = tiny_tokenizer("chatml")
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<|im_end|>")
    tok.chat_template = ("{% if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}"
                         "{% endif %}" + CHATML)
    c = Conversation([{"role": "user", "content": "Find"}, {"role": "assistant", "content": "{}"},
                      {"role": "tool", "content": "[]"}, {"role": "assistant", "content": "None found."}],
                     tools=[{"name": "search"}])
    r = ChatRenderer(tok)
    assert r.supports_tools
    enc = check_mask(tok, c, "<|im_end|>", renderer=r)
    assert enc.text.startswith('<|im_start|>system\nTools: [{"name": "search"}]<|im_end|>\n')
    assert "You can call the following tools" not in enc.text
    r_user = ChatRenderer(tok, tool_role="user")
    assert "<|im_start|>user\n[]<|im_end|>" in r_user.encode(c).text


def test_hub_load_failure_is_one_line_error(monkeypatch):
    import datasets

    def offline(*a, **k):
        raise ConnectionError("no network")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"org/missing: cannot load with datasets.load_dataset \(ConnectionError"):
        list(read_source(parse_source("org/missing")))


def test_same_file_name_in_two_folders_gets_distinct_names(tmp_path):
    from sglang_eagle3.training.data import parse_sources
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pa = write_jsonl(tmp_path / "a" / "train.jsonl", [{"question": "q", "answer": "a"}])
    pb = write_jsonl(tmp_path / "b" / "train.jsonl", [{"question": "q", "answer": "a"}])
    other = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "q", "answer": "a"}])
    srcs = parse_sources([pa, pb, other])
    assert [s.name for s in srcs] == [pa, pb, "gsm.jsonl"]
    assert {c.key for s in srcs for _, c in read_source(s)} == {f"{pa}:1", f"{pb}:1", "gsm.jsonl:1"}
    with pytest.raises(DataError, match="given twice"):
        parse_sources([pa, pa])


def test_prepare_with_nothing_usable_fails(tmp_path):
    p = write_jsonl(tmp_path / "mt.jsonl", [{"turns": ["a", "b"]}] * 2)
    with pytest.raises(DataError, match=r"no usable conversations.*'no assistant turn': 2"):
        prepare_dataset([parse_source(p)], tiny_tokenizer("chatml"), str(tmp_path / "ds"), progress=False)
    assert not (tmp_path / "ds").exists()

"""The speculation profile file (engine/profile.py): what is written reads back the same, merges keep what they do
not replace, and every bad field is one line naming the file and the field."""
from __future__ import annotations

import json
import os

import pytest

from sglang_eagle3.engine.profile import (
    PROFILE_FORMAT,
    SpecProfile,
    add_host_table,
    check_profile,
    check_rewritable,
    read_profile,
    set_drafting,
    set_sampled_table,
    tree_entry,
    vanilla_entry,
    write_profile,
)
from sglang_eagle3.engine.speculation import SpecConfig
from sglang_eagle3.models.config import ConfigError
from sglang_eagle3.paths import SHIPPED_DRAFT

CHAIN = {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}
WIDE = {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}
TABLE = {"1": tree_entry(CHAIN, tokens_per_s=50.0, speedup=1.4),
         "4": vanilla_entry({**WIDE, "tokens_per_s": 80.0}, tokens_per_s=90.0, speedup=1.0)}
MEASURED = {"dataset": "gsm8k", "max_new_tokens": 8, "cpu": "test CPU", "command": "python bench/tune_spec.py"}


def profile_at(tmp_path, doc: dict, name: str = "p.json") -> str:
    path = str(tmp_path / name)
    write_profile(path, doc)
    return path


def test_a_written_profile_reads_back_as_written(tmp_path):
    """write_profile writes indented JSON with a final newline (what tune_spec wrote before), keys in their order;
    the tables read back: the chosen tree per batch size, vanilla where it won with its fastest tree kept."""
    doc = {"format": PROFILE_FORMAT, "target": "testbed", "per_batch_size": TABLE, "meta": {"host": "h"}}
    path = profile_at(tmp_path, doc)
    assert open(path).read() == json.dumps(doc, indent=2) + "\n"
    assert read_profile(path) == doc and list(read_profile(path)) == ["format", "target", "per_batch_size", "meta"]
    prof = SpecProfile.load(path)
    assert prof.table == {1: SpecConfig(**CHAIN), 4: None} and prof.fastest == {4: SpecConfig(**WIDE)}
    assert prof.for_batch_size(2) == SpecConfig(**CHAIN) and prof.measured_tree(8) == SpecConfig(**WIDE)
    assert prof.source == path and prof.target == "testbed" and prof.host is None and prof.sampled is None
    assert TABLE["1"] == {"speculation": True, **CHAIN, "tokens_per_s": 50.0, "speedup": 1.4}
    assert list(TABLE["4"]) == ["speculation", "tokens_per_s", "speedup", "best_tree"]
    assert vanilla_entry(tokens_per_s=1.0) == {"speculation": False, "tokens_per_s": 1.0}


def test_a_profile_that_would_not_read_is_not_written(tmp_path):
    path = profile_at(tmp_path, {"per_batch_size": TABLE})
    before = open(path).read()
    with pytest.raises(ConfigError, match=r"per_batch_size\[2\] is not a valid tree"):
        write_profile(path, {"per_batch_size": {**TABLE, "2": {"num_steps": 1}}})
    with pytest.raises(ValueError):
        write_profile(path, {"per_batch_size": TABLE, "speedup": float("nan")})     # not JSON
    assert open(path).read() == before and os.listdir(tmp_path) == ["p.json"]


def test_a_host_table_merges_into_a_profile(tmp_path):
    """by_host[kind]: batch sizes the run measured take its entries, the others keep the profile's own tree; the
    rest of the profile stays byte for byte; an older run's machine path ('grid') goes; sampled and long-context
    tables go beside the host's greedy one, which they need."""
    other = {"num_steps": 1, "topk": 2, "num_draft_tokens": 2}
    doc = {"format": PROFILE_FORMAT, "per_batch_size": TABLE, "sampled": {"temperature": 1.0, "per_batch_size": {
        "1": tree_entry(other)}}, "by_host": {"zen9": {"per_batch_size": {"1": tree_entry(WIDE)}}}}
    path = profile_at(tmp_path, doc)
    with pytest.raises(ConfigError, match="by_host.amx has no per_batch_size"):
        add_host_table(path, "amx", {"1": tree_entry(WIDE)}, MEASURED, sampling={"temperature": 1.0, "seed": 0})
    with pytest.raises(ConfigError, match="by_host.amx has no per_batch_size"):
        add_host_table(path, "amx", {"1": tree_entry(WIDE)}, MEASURED, long_context=100)
    assert read_profile(path) == doc
    add_host_table(path, "amx", {"1": tree_entry(WIDE)}, {**MEASURED, "grid": "/old/run.grid.json"})
    after = read_profile(path)
    assert {k: v for k, v in after.items() if k != "by_host"} == {k: v for k, v in doc.items() if k != "by_host"}
    assert list(after["by_host"]) == ["zen9", "amx"] and after["by_host"]["zen9"] == doc["by_host"]["zen9"]
    assert after["by_host"]["amx"] == {**MEASURED, "grid": "/old/run.grid.json",
                                       "per_batch_size": {"1": tree_entry(WIDE), "4": TABLE["4"]}}
    add_host_table(path, "amx", {"8": tree_entry(CHAIN)}, MEASURED)            # a re-tune at batch 8 alone
    amx = read_profile(path)["by_host"]["amx"]
    assert "grid" not in amx and list(amx["per_batch_size"]) == ["1", "4", "8"]
    add_host_table(path, "amx", {"2": tree_entry(CHAIN)}, MEASURED, sampling={"temperature": 0.7, "seed": 3})
    add_host_table(path, "amx", {"1": tree_entry(other)}, MEASURED, long_context=100)
    amx = read_profile(path)["by_host"]["amx"]
    assert amx["sampled"] == {"temperature": 0.7, "seed": 3, **MEASURED, "per_batch_size": {
        "1": tree_entry(other), "2": tree_entry(CHAIN)}}                        # the profile's sampled table kept
    assert amx["long_context"] == {"min_tokens": 100, **MEASURED, "per_batch_size": {"1": tree_entry(other)}}
    prof = SpecProfile.load(path, host="amx")
    assert prof.host == "amx" and prof.source == f"{path} [amx]" and prof.for_batch_size(8) == SpecConfig(**CHAIN)
    assert prof.for_batch_size(2, sampled=True) == SpecConfig(**CHAIN)
    assert prof.for_batch_size(1, context=100) == SpecConfig(**other) and prof.for_batch_size(1, context=99) == \
        SpecConfig(**WIDE)
    # past the batch sizes the long-context table measured, the host's own table (batch 8: its chain)
    assert prof.for_batch_size(8, context=100) == SpecConfig(**CHAIN) == prof.for_batch_size(8, context=99)
    assert SpecProfile.load(path, host="avx2").for_batch_size(1) == SpecConfig(**CHAIN)   # the profile's own


def test_the_sampled_table_and_the_drafting_choice_are_set_in_place(tmp_path):
    path = profile_at(tmp_path, {"format": PROFILE_FORMAT, "per_batch_size": TABLE, "meta": {}})
    set_sampled_table(path, {"1": tree_entry(WIDE)}, {"temperature": 1.0, "seed": 0}, MEASURED)
    set_drafting(path, "avx2", {"drafter": "hybrid", "tree": "auto", "measured": {"datasets": ["mt_bench"]}})
    doc = read_profile(path)
    assert list(doc) == ["format", "per_batch_size", "meta", "sampled", "by_host"]
    assert doc["sampled"] == {"temperature": 1.0, "seed": 0, **MEASURED, "per_batch_size": {"1": tree_entry(WIDE)}}
    prof = SpecProfile.load(path, host="avx2")
    assert prof.drafting == {"drafter": "hybrid", "tree": "auto"} and prof.host is None      # no table of its own
    assert prof.for_batch_size(1, sampled=True) == SpecConfig(**WIDE)
    with pytest.raises(ConfigError, match="by_host.avx2.drafting.drafter must be one of"):
        set_drafting(path, "avx2", {"drafter": "medusa"})
    assert read_profile(path) == doc


def test_a_hosts_entry_overrides_the_profiles_field_by_field(tmp_path):
    """A host's table runs with its own sampled table, else the profile's; a key written as null there means none
    (not the profile's); its drafting counts even where it has no table; another host's long_context never."""
    sampled = {"per_batch_size": {"1": tree_entry(WIDE)}}
    long = {"min_tokens": 5, "per_batch_size": {"1": tree_entry(WIDE)}}
    doc = {"per_batch_size": TABLE, "sampled": sampled, "long_context": long, "drafting": {"drafter": "suffix"},
           "by_host": {"a": {"per_batch_size": {"1": tree_entry(CHAIN)}},
                       "b": {"per_batch_size": {"1": tree_entry(CHAIN)}, "sampled": None, "drafting": None},
                       "c": {"drafting": {"tree": "auto"}}}}
    path = profile_at(tmp_path, doc)
    a, b, c = (SpecProfile.load(path, host=k) for k in "abc")
    assert a.sampled.table == {1: SpecConfig(**WIDE)} and a.long_context is None and a.drafting == {"drafter": "suffix"}
    assert b.sampled is None and b.drafting == {}
    assert c.host is None and c.long_context[0] == 5 and c.drafting == {"tree": "auto"}


def test_the_shipped_profile_reads_on_every_kind_of_host_it_holds():
    path = os.path.join(SHIPPED_DRAFT, "spec_profile.json")
    if not os.path.isfile(path):
        pytest.skip("no shipped draft in this checkout")
    doc = read_profile(path)
    check_profile(doc, path)
    for kind, entry in doc["by_host"].items():
        prof = SpecProfile.load(path, host=kind)
        assert prof.host == kind and set(prof.table) == {int(k) for k in entry["per_batch_size"]}
        assert (prof.sampled is not None) == ("sampled" in entry or "sampled" in doc)
        assert (prof.long_context is not None) == ("long_context" in entry)
    assert SpecProfile.load(path, host="some-other-kind").host is None


BAD = [([1], "expected a JSON object with 'per_batch_size' (integer batch-size keys)"),
       ({"per_batch_size": {"one": CHAIN}}, "per_batch_size must be an object with integer batch-size keys"),
       ({"per_batch_size": {}}, "per_batch_size must be an object with integer batch-size keys"),
       ({"per_batch_size": {"1": {"topk": 1}}}, "per_batch_size[1] is not a valid tree ('num_steps')"),
       ({"per_batch_size": {"1": {"num_steps": 1, "topk": 4, "num_draft_tokens": 9}}},
        "per_batch_size[1] is not a valid tree (--num-draft-tokens=9 exceeds what num_steps=1, topk=4 can draft (5))"),
       ({"per_batch_size": {"1": {"speculation": False, "best_tree": {"topk": "x"}}}},
        "per_batch_size[1].best_tree is not a valid tree ('num_steps')"),
       ({"per_batch_size": TABLE, "sampled": [1]}, "sampled must be an object with its own per_batch_size"),
       ({"per_batch_size": TABLE, "sampled": {"temperature": 1}},
        "sampled.per_batch_size must be an object with integer batch-size keys"),
       ({"per_batch_size": TABLE, "long_context": 600},
        "long_context must be an object with an integer min_tokens >= 1 and its own per_batch_size"),
       ({"per_batch_size": TABLE, "long_context": {"min_tokens": "600", "per_batch_size": TABLE}},
        "long_context.min_tokens must be an integer >= 1, got '600'"),
       ({"per_batch_size": TABLE, "long_context": {"min_tokens": True, "per_batch_size": TABLE}},
        "long_context.min_tokens must be an integer >= 1, got True"),
       ({"per_batch_size": TABLE, "long_context": {"min_tokens": 600}},
        "long_context.per_batch_size must be an object with integer batch-size keys"),
       ({"per_batch_size": TABLE, "drafting": {"tree": "big"}},
        "drafting.tree must be one of profile, auto, got 'big'"),
       ({"per_batch_size": TABLE, "by_host": ["amx"]},
        "by_host must map a host kind to an object with its own per_batch_size"),
       ({"per_batch_size": TABLE, "by_host": {"amx": None}},
        "by_host must map a host kind to an object with its own per_batch_size"),
       ({"per_batch_size": TABLE, "by_host": {"amx": {"per_batch_size": {"1": [3]}}}},
        "by_host.amx.per_batch_size[1] is not a valid tree (list indices must be integers or slices, not str)"),
       ({"per_batch_size": TABLE, "by_host": {"amx": {"per_batch_size": TABLE, "sampled": {"per_batch_size": 1}}}},
        "by_host.amx.sampled.per_batch_size must be an object with integer batch-size keys"),
       ({"per_batch_size": TABLE, "by_host": {"zen9": {"long_context": {"min_tokens": 0, "per_batch_size": TABLE}}}},
        "by_host.zen9.long_context.min_tokens must be an integer >= 1, got 0"),
       ({"per_batch_size": TABLE, "by_host": {"zen9": {"drafting": {"max_nodes": 0}}}},
        "by_host.zen9.drafting.max_nodes must be an integer in 1..128, got 0")]


@pytest.mark.parametrize("doc,said", BAD, ids=[s.split(" ")[0] for _, s in BAD])
def test_each_bad_field_is_one_line_naming_the_file_and_field(tmp_path, doc, said):
    """Every field is checked wherever it sits (another host's entry too), on reading and before writing."""
    path, new = tmp_path / "p.json", tmp_path / "new.json"
    path.write_text(json.dumps(doc))
    for where, check in ((path, lambda: SpecProfile.load(str(path), host="amx")),
                         (path, lambda: check_rewritable(str(path))), (new, lambda: write_profile(str(new), doc))):
        with pytest.raises(ConfigError) as e:
            check()
        assert str(e.value) == f"{where}: {said}"
    assert not new.exists()


def test_a_missing_broken_or_tableless_file_is_one_line(tmp_path):
    """A file that is not there or not JSON; a profile with no table for this host nor of its own."""
    missing = tmp_path / "none.json"
    with pytest.raises(ConfigError, match=f"speculation profile {missing} does not exist"):
        SpecProfile.load(str(missing))
    broken = tmp_path / "broken.json"
    for data in (b"{not json", b"\xff\xfe"):
        broken.write_bytes(data)
        with pytest.raises(ConfigError, match=f"{broken}: not valid JSON"):
            read_profile(str(broken))
    tableless = profile_at(tmp_path, {"by_host": {"amx": {"per_batch_size": TABLE}}}, "t.json")
    assert SpecProfile.load(tableless, host="amx").host == "amx"
    with pytest.raises(ConfigError) as e:
        SpecProfile.load(tableless, host="avx2")
    assert str(e.value) == f"{tableless}: per_batch_size must be an object with integer batch-size keys"

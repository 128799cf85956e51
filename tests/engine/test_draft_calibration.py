"""A draft's calibration: the file, where the settings find it, and the q the sampled children are drawn from."""
from __future__ import annotations

import json

import pytest
import torch

from sglang_eagle3.engine.draft_calibration import FILE, FORMAT, DraftCalibration, calibration_path
from sglang_eagle3.engine.sampled_tree import DraftSampler
from sglang_eagle3.engine.verify import SamplingParams
from sglang_eagle3.kernels import decode as K
from sglang_eagle3.models.config import ConfigError
from sglang_eagle3.paths import shipped_draft


def write(path, obj):
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


def test_a_calibration_reads_back_and_deeper_nodes_take_its_last_scale(tmp_path):
    cal = DraftCalibration((1.5, 1.2))
    path = write(tmp_path / FILE, cal.as_json(fitted_on={"rows": 3}))
    back = DraftCalibration.read(path)
    assert back == cal and [back.at(d) for d in range(4)] == [1.5, 1.2, 1.2, 1.2]


@pytest.mark.parametrize("content,phrase", [
    ("{not json", "not a readable JSON file"),
    ({"logit_scale": [1.0]}, "expected an object with format"),
    ({"format": FORMAT, "logit_scale": 1.2}, "logit_scale must be a list"),
    ({"format": FORMAT, "logit_scale": []}, "at least one depth"),
    ({"format": FORMAT, "logit_scale": [1.0, 0.0]}, "logit_scale[1] must be a number in"),
    ({"format": FORMAT, "logit_scale": [True]}, "logit_scale[0] must be a number in"),
    ({"format": FORMAT, "logit_scale": [1.0, "2"]}, "logit_scale[1] must be a number in"),
])
def test_a_bad_calibration_file_is_one_error_naming_the_file_and_the_field(tmp_path, content, phrase):
    path = write(tmp_path / FILE, content)
    with pytest.raises(ConfigError) as e:
        DraftCalibration.read(path)
    assert str(e.value).startswith(path) and phrase in str(e.value) and "\n" not in str(e.value)


def test_the_settings_read_the_drafts_calibration_for_sampled_children_only(tmp_path):
    """resolve_settings: `sampled` reads DRAFT/draft_calibration.json, `sampled-raw` and `top-k` do not; a broken
    file is a one-line error that names it and the way around it."""
    from sglang_eagle3.engine.settings import resolve_settings
    from sglang_eagle3.errors import UserError
    draft = tmp_path / "draft"
    draft.mkdir()
    assert calibration_path(str(draft)) is None
    assert resolve_settings(str(draft)).calibration is None
    write(draft / FILE, DraftCalibration((1.3,)).as_json())
    assert calibration_path(str(draft)) == str(draft / FILE)
    assert resolve_settings(str(draft)).calibration == DraftCalibration((1.3,))
    for children in ("sampled-raw", "top-k"):
        assert resolve_settings(str(draft), draft_children=children).calibration is None
    write(draft / FILE, {"format": FORMAT, "logit_scale": [-1]})
    with pytest.raises(UserError, match="draft_calibration.json: logit_scale.0. must be .*--draft-children "
                                        "sampled-raw"):
        resolve_settings(str(draft))


def test_the_shipped_draft_has_a_calibration_that_sharpens():
    path = calibration_path(shipped_draft())
    assert path is not None
    cal = DraftCalibration.read(path)
    assert all(s > 1 for s in cal.logit_scale)


@pytest.mark.parametrize("ext", [True, False])
def test_each_depth_draws_from_q_at_its_own_scale_and_greedy_rows_ignore_it(ext, monkeypatch):
    """A sampled row's q at depth 0 is softmax(2 z / T) and at depth 1 softmax(0.5 z / T) (the q kept for the verify
    is the one drawn from); a greedy row's children are the draft's top-k log-probs, as without a calibration."""
    from sglang_eagle3.kernels import extension
    if ext and extension.load() is None:
        pytest.skip("the C++ extension is not built here")
    if not ext:
        monkeypatch.setattr(K, "sampling_in_extension", lambda *a: False)
    g = torch.Generator().manual_seed(0)
    T, Vd = 0.8, 50
    params = [SamplingParams(temperature=T), SamplingParams()]
    gens = [torch.Generator().manual_seed(1), None]
    sampler = DraftSampler(params, gens, 3, calibration=DraftCalibration((2.0, 0.5)))
    z0, z1 = torch.randn(2, 1, Vd, generator=g) * 2, torch.randn(2, 2, Vd, generator=g) * 2
    scores0, ids0, _ = sampler.children(z0, 3)
    scores1, ids1, _ = sampler.children(z1, 3)
    torch.testing.assert_close(sampler.probs[0, 0], torch.softmax(2.0 * z0[0, 0] / T, -1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sampler.probs[0, 1:3], torch.softmax(0.5 * z1[0] / T, -1), atol=1e-6, rtol=1e-5)
    top, top_ids = K.topk_logprobs(z1[1], 3)
    assert torch.equal(ids1[1], top_ids.long()) and torch.allclose(scores1[1], top.float())
    assert float(sampler.probs[1].abs().sum()) == 0.0                      # greedy rows keep no q

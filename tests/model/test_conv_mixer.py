"""A token mixer added as one model file and one registry line (kimi/model/conv.py, letter C) is a full
citizen: it trains, trains the same under tensor parallelism as in one process, is counted by
kimi.summary and named in the banner. (tests/model/test_sublayers.py holds it to the rest of the contract.)"""

from __future__ import annotations

import pytest
from layout_runs import assert_same_run, overrides, single_process, torchrun

from kimi.summary import main

PATTERN = ["model.layer_pattern=KCKM"]


@pytest.mark.dist
def test_a_conv_mixer_model_trains_alike_on_one_process_and_under_tp2(tmp_path, data):
    one = tmp_path / "one"
    single_process(one, data, "muonclip", *PATTERN)
    log = (one / "train.log").read_text()
    assert "blocks KCKM (K=KDA, C=conv, M=MLA)" in log
    tp2 = tmp_path / "tp2"
    torchrun(2, tp2, overrides(data, "muonclip", *PATTERN, "parallel.tp=2",
                               "parallel.sequence_parallel=true"))
    assert_same_run(tp2, one, tmp_path)


@pytest.mark.unit
def test_the_summary_counts_the_conv_mixer(capsys):
    text = main(["model=tiny", *PATTERN, "parallel.tp=2"])
    assert "model tiny: 4 blocks KCKM (K=KDA, C=conv, M=MLA)" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("conv mixers (x1)"))
    # in_proj and out_proj d x d, the depthwise conv d x conv_size (tiny: d 128, conv 4)
    assert int(row.split()[3].replace(",", "")) == 2 * 128 * 128 + 128 * 4

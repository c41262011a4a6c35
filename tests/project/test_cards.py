"""The verification cards (bench/cards.py, bench/results/cards/): the short ones trained again, step for step
as their card records, each step's loss within the card's tolerance. A change of the model, the optimizer,
the data pipeline or an initialisation that moves a preset's losses fails here, naming the preset and the
step; a change that should move them comes with the cards written again (`python bench/cards.py`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "bench"))  # appended: a bench script must not shadow an installed package

import cards  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from kimi.data.synthetic import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_a_moved_loss_is_named_with_its_preset_and_step():
    card = {"preset": "tiny", "losses": [6.0, 5.0], "val_loss": 4.0, "rtol": 1e-4}
    assert cards.mismatches(card, [6.0, 5.0], 4.0) == []
    assert cards.mismatches(card, [6.0, 5.0004], 4.0) == []
    moved = cards.mismatches(card, [6.0, 5.01], 4.0)
    assert len(moved) == 1 and moved[0].startswith("tiny step 2: loss 5.010000, card 5.000000")
    assert cards.mismatches(card, [6.0], 4.0) == ["tiny: 1 steps logged, the card has 2"]


@pytest.mark.parametrize("preset", cards.REPLAYED)
def test_the_card_replays(preset, corpus, tmp_path):
    from kimi.cli.conf_dir import compose
    from kimi.run.metrics import read_metrics
    from kimi.train import train

    card = json.loads((cards.CARDS / f"{preset}.json").read_text())
    run = tmp_path / "run"
    overrides = cards.overrides(preset, corpus, tmp_path / "cache", run)
    assert sorted(a for a in overrides if a in card["overrides"]) == sorted(card["overrides"]), (
        "the card's own settings")
    train(compose(overrides))  # train.py's own entry: a recipe's stages one after another
    found = cards.card_of(read_metrics(run / "metrics.jsonl"), preset)
    assert not cards.mismatches(card, found["losses"], found["val_loss"]), "\n".join(
        cards.mismatches(card, found["losses"], found["val_loss"]))

"""A data source added as one class and one registry line (kimi/data/source_registry.py) is a full citizen:
data.source accepts its name, the trainer tokenises and trains on its documents, the token cache is keyed by
its identity, and kimi.summary and kimi.plan take a config that reads it. A source that cannot stream refuses
data.streaming=true with the registry's one-line rule."""

import math
import random

import datasets
import pytest
from helpers import train_run

from kimi.config import ConfigError, DataConfig
from kimi.data import read_tokens
from kimi.data.rules import validate_data
from kimi.data.source_registry import SOURCES, DataSource, source_for
from kimi.data.sources import source_identity
from kimi.run.metrics import read_metrics
from kimi.summary import compose_config, report, summarize

pytestmark = pytest.mark.unit

ANIMALS = ["quokka", "okapi", "tapir", "axolotl", "pangolin", "narwhal", "wombat"]
VERBS = ["greets", "follows", "outruns", "admires", "ignores", "visits"]


def toy_documents():
    rng = random.Random(7)
    sentence = lambda: f"The {rng.choice(ANIMALS)} {rng.choice(VERBS)} the {rng.choice(ANIMALS)}."  # noqa: E731
    return [" ".join(sentence() for _ in range(60)) for _ in range(20)]


class ToySource(DataSource):
    """A few fixed documents, made in memory."""

    def documents(self, split):
        return datasets.Dataset.from_dict({"text": toy_documents()})

    def identity(self):
        return {"source": "toy", "documents": len(toy_documents())}


@pytest.fixture
def toy():
    SOURCES["toy"] = ToySource
    yield
    del SOURCES["toy"]


def test_a_registered_source_trains(toy, tmp_path):
    data = ["data.source=toy", f"data.cache_dir={tmp_path / 'cache'}"]
    trainer = train_run(tmp_path / "run", data, "trainer.max_steps=3")
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    # the run's tokens are the toy documents, and the cache is keyed by the toy source's identity
    assert source_identity(trainer.cfg.data)["source"] == "toy"
    assert trainer.data.data_dir.parent == tmp_path / "cache" / "datasets"
    tok, tokens = trainer.data.tokenizer, read_tokens(trainer.data, "train").tolist()
    ends = [i for i, t in enumerate(tokens) if t == tok.eos_id]
    trained = [tok.decode(tokens[a + 1:b]) for a, b in zip([-1, *ends], ends)]
    assert len(trained) == 18 and set(trained) < set(toy_documents())  # 10% held out for validation


def test_a_registered_source_is_checked_like_the_others(toy):
    assert isinstance(source_for(DataConfig(source="toy")), ToySource)
    validate_data(DataConfig(source="toy"))
    with pytest.raises(ConfigError, match="only data.source=hf or files can be streamed, not toy"):
        validate_data(DataConfig(source="toy", streaming=True))
    with pytest.raises(ConfigError) as e:
        validate_data(DataConfig(source="tyo"))
    assert str(e.value) == "data.source='tyo' is invalid: choose one of shakespeare|hf|files|toy"


def test_a_registered_source_is_summarised_and_planned(toy):
    from kimi.plan import cli

    assert "model tiny" in report(summarize(compose_config(["model=tiny", "data.source=toy"])))
    _, plan, _ = cli.plan(["model=tiny", "data.source=toy", "cluster.gpus=1", "top=1"], progress=False)
    assert "data.source=toy" in plan["layouts"][0]["overrides"]

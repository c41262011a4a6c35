"""A precision added as one class and one registry line (kimi/precision/registry.py): trainer.precision
accepts its name, and what the code asks of a precision (autocast, FSDP's gathered dtype in kimi.summary,
conversion) comes from the class. A name nobody registered is refused in one line."""

import pytest

from kimi.config import ConfigError
from kimi.precision.registry import PRECISIONS, Precision, precision_for
from kimi.summary import compose_config, report, summarize
from kimi.run.validation import validate

pytestmark = pytest.mark.unit


class Bf16Twin(Precision):
    """bf16 autocast under another name, converting nothing."""

    BF16 = True


@pytest.fixture
def twin():
    PRECISIONS["bf16_twin"] = Bf16Twin
    yield
    del PRECISIONS["bf16_twin"]


def test_a_registered_precision_is_asked_not_compared(twin):
    overrides = ["model=tiny", "parallel.dp_shard=2", "trainer.precision=bf16_twin"]
    validate(compose_config(overrides), world=2)
    s, fp32 = summarize(compose_config(overrides)), summarize(compose_config(overrides[:2]))
    # FSDP's gathered unit is counted in the precision's compute dtype: bf16, half fp32's bytes
    assert s.heaviest.bytes["transient"] * 2 == fp32.heaviest.bytes["transient"] > 0
    assert "one gathered FSDP unit (bf16" in report(s) and "one gathered FSDP unit (fp32" in report(fp32)
    assert not precision_for("bf16_twin").converts


def test_an_unregistered_precision_is_refused():
    with pytest.raises(ConfigError) as e:
        validate(compose_config(["model=tiny", "trainer.precision=bf16_twin"]))
    assert str(e.value) == "trainer.precision='bf16_twin' is invalid: choose one of fp32|bf16|fp8|mxfp8"
    with pytest.raises(ConfigError, match="trainer.precision='bf16_twin' is invalid"):
        precision_for("bf16_twin")

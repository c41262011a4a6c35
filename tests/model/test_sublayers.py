"""The sublayer contract (kimi/model/sublayer.py), held by every token mixer in the registry and both MLP
kinds: what each declares names its real parameters, tensor parallelism shards it as declared, decoding
through its cache and packed documents give a plain forward's numbers. A mixer added to the registry is
tested here without a line of this file changing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import tiny_model_cfg

from kimi.config import ConfigError, mixer_pattern
from kimi.model import KimiModel
from kimi.model.registry import MIXERS, legend, mixer_class
from kimi.schema.vocabulary import value_at
from kimi.ops.documents import cu_seqlens_from_starts

pytestmark = pytest.mark.unit

LETTERS = sorted(MIXERS)
# MoE blocks from block 1 on: both MLP kinds in every model below
MOE = dict(num_experts=4, top_k=2, hidden=16, first_dense=1)


def model_of(letter: str, moe=None) -> KimiModel:
    """Two blocks of the mixer `letter`, a dense MLP then a MoE (`moe` adds to MOE), fp64."""
    torch.manual_seed(0)
    cfg = tiny_model_cfg(num_layers=2, mla_layers=None, layer_pattern=letter, residual="standard",
                         vocab_size=64, kda=dict(backend="torch"), moe={**MOE, **(moe or {})})
    return KimiModel(cfg).double()


def test_the_pattern_and_the_list_form_agree():
    assert mixer_pattern(tiny_model_cfg(num_layers=8, mla_layers=None, layer_pattern="KKKM")) == "KKKMKKKM"
    assert mixer_pattern(tiny_model_cfg(num_layers=4, mla_layers=[1, 3])) == "KMKM"
    assert mixer_pattern(tiny_model_cfg(num_layers=4, mla_layers=None, mla_every=4)) == "KKKM"
    assert legend(tiny_model_cfg(num_layers=4, mla_layers=None, mla_every=0)) == "K=KDA"


def test_an_unknown_letter_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"model.layer_pattern: 'Z' names no token mixer; the letters are "
                                          r"K \(KDA\)"):
        mixer_class("Z")


@pytest.mark.parametrize("letter", LETTERS)
def test_declarations_name_real_parameters(letter):
    model = model_of(letter)
    rules = model.init_rules()
    assert set(rules) == {n for n, _ in model.named_parameters()}  # every parameter has its initial value
    for _, sub in model.sublayers():
        names = dict(sub.named_parameters())
        modules = dict(sub.named_modules())
        plan = sub.tp_plan()
        for owner in (*plan.colwise, *plan.rowwise):
            assert isinstance(modules.get(owner), torch.nn.Linear), f"{type(sub).__name__}: {owner}"
        for name in (*plan.by_heads, *plan.sum_grads):
            assert name in names, f"{type(sub).__name__}: {name}"
        assert sub.LABEL and sub.FAMILY
        assert sub.flops_per_token(128) >= 0
        assert 0 <= sub.inactive_params() < sum(p.numel() for p in names.values())
        for key in sub.TP_DIVIDES:
            assert isinstance(value_at(model.cfg, key), int), f"{type(sub).__name__}.TP_DIVIDES: {key}"
        for name in sub.RECORDS:
            assert hasattr(sub, name)


@pytest.mark.parametrize("letter", LETTERS)
def test_tensor_parallel_shards_as_declared(letter):
    """The real plans on a fake 2-rank tp group: every parameter's local shape is its full shape divided
    along the dimension the declaration names (what kimi.summary counts), nothing else."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from kimi.parallel.tensor_parallel import apply_tensor_parallel
    from kimi.summary import tp_dim

    with torch.device("meta"):
        model = KimiModel(model_of(letter).cfg)
        reference = KimiModel(model.cfg)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        apply_tensor_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"])
        for name, p in model.named_parameters():
            local = p.to_local().shape if isinstance(p, DTensor) else p.shape
            want = list(reference.get_parameter(name).shape)
            dim = tp_dim(reference, name)
            if dim is not None:
                want[dim] //= 2
            assert list(local) == want, name
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("letter", LETTERS)
def test_decoding_through_the_cache_equals_a_full_forward(letter):
    model = model_of(letter).eval()
    ids = torch.randint(0, 61, (2, 20))
    cache, got, start = model.new_cache(), [], 0
    with torch.no_grad():
        for n in [2, 7] + [1] * 11:  # a prefill shorter than a short conv's window, a piece, single tokens
            got.append(model(ids[:, start:start + n], cache=cache))
            start += n
        torch.testing.assert_close(torch.cat(got, dim=1), model(ids), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("letter", LETTERS)
def test_packed_documents_equal_separate_rows(letter):
    # dense: a MoE's balance statistics are per row, its output not
    model = model_of(letter, moe=dict(num_experts=0))
    ids = torch.randint(0, 61, (1, 24))
    starts = torch.zeros(1, 24, dtype=torch.bool)
    starts[0, [0, 9, 17]] = True
    with torch.no_grad():
        packed = model(ids, doc_starts=starts)
        bounds = cu_seqlens_from_starts(starts).tolist()
        alone = torch.cat([model(ids[:, a:b]) for a, b in zip(bounds, bounds[1:])], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)


def test_tensor_parallel_divides_only_what_the_pattern_uses():
    """parallel.tp must divide the sizes the model's sublayers declare (TP_DIVIDES), and only theirs: MLA's
    head count is free in a model without MLA."""
    from kimi.model.rules import check_tensor_parallel

    odd_mla = dict(mla=dict(num_heads=3), kda=dict(num_heads=2), mlp=dict(hidden=48), vocab_size=64,
                   mla_layers=None)
    check_tensor_parallel(tiny_model_cfg(**odd_mla, num_layers=2, layer_pattern="K"), 2)
    with pytest.raises(ConfigError, match=r"model.mla.num_heads=3 is not divisible by parallel.tp=2"):
        check_tensor_parallel(tiny_model_cfg(**odd_mla, num_layers=2, layer_pattern="KM"), 2)

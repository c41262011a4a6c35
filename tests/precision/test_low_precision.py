"""Low-precision training (kimi/precision): the fp8 and MXFP8 linears against torchao's own quantisation
functions and against the exact (fp64) product within their format's error, the conversion's filter, the
masters the optimizer and QK-Clip see, MXFP4 fake quantisation and its export, and the config's refusals.
All emulated on CPU (torchao's emulate / EMULATED kernels)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from helpers import tiny_model_cfg
from torch import nn
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import MXTensor
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

from kimi.config import FP8_RECIPES, Config, ConfigError
from kimi.convert import load_hf, save_hf
from kimi.model import KimiModel
from kimi.optim import build_optimizer
from kimi.parallel.engine import materialize
from kimi.precision import apply_low_precision, emulated
from kimi.precision.linear import Fp8Linear, fp8_config, to_fp8, to_mxfp8
from kimi.precision.mxfp4 import dequantize, fake_quantize, quantize
from kimi.precision.rules import validate_precision

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
E4M3_U, E5M2_U = 2.0**-4, 2.0**-3  # unit roundoff of the fp8 element types (3 and 2 mantissa bits)


def _problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g, dtype=torch.float64)
    w = torch.randn(96, 128, generator=g, dtype=torch.float64) * 0.05
    grad = torch.randn(64, 96, generator=g, dtype=torch.float64)
    return x, w, grad


def _run(layer: nn.Linear, x, grad):
    """Forward and backward under bf16 autocast (as trainer.precision=fp8|mxfp8 runs): out, dx, dw."""
    xi = x.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(xi)
    out.backward(grad.to(out.dtype))
    return out, xi.grad, layer.weight.grad


def _rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def _dequant_fp8(t, cast, role, axis, config):
    """torchao's dynamic float8 cast of `t` under `cast` (a recipe's CastConfig), dequantised in fp32."""
    f8 = hp_tensor_to_float8_dynamic(t, cast.target_dtype, LinearMMConfig(), gemm_input_role=role,
                                     scaling_granularity=cast.scaling_granularity,
                                     axiswise_dim=get_maybe_axiswise_dim(axis, cast.scaling_granularity),
                                     round_scales_to_power_of_2=config.round_scales_to_power_of_2)
    return f8._data.float() / f8._scale


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_forward_is_torchao_quantisation_then_the_product(recipe):
    x, w, grad = _problem()
    layer = nn.Linear(128, 96, bias=False)
    layer.weight.data = w.float()
    config = fp8_config(recipe, emulate=True)
    out, _, _ = _run(to_fp8(layer, config), x, grad)
    xq = _dequant_fp8(x.to(torch.bfloat16), config.cast_config_input, GemmInputRole.INPUT, -1, config)
    wq_t = _dequant_fp8(w.float().t(), config.cast_config_weight, GemmInputRole.WEIGHT, 0, config)
    assert out.dtype == torch.bfloat16  # the bf16 layer's output dtype under autocast
    torch.testing.assert_close(out, (xq @ wq_t).to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("kind", [*FP8_RECIPES, "mxfp8"])
def test_low_precision_linear_within_its_format_error_of_the_exact_product(kind):
    """Forward and both gradients against fp64: within the element type's rounding (e4m3; e5m2 for tensorwise
    gradients), and far from bf16's own error, so the quantisation did run; rowwise_with_gw_hp's weight
    gradient is high precision (bf16's error)."""
    x, w, grad = _problem()
    exact = (x @ w.T, grad @ w, grad.T @ x)
    layer = nn.Linear(128, 96, bias=False)
    layer.weight.data = w.float()
    bf16 = [_rel(a, b) for a, b in zip(_run(copy.deepcopy(layer), x, grad), exact)]
    assert max(bf16) < 2.0**-8
    low = to_mxfp8(layer, emulate=True) if kind == "mxfp8" else to_fp8(layer, fp8_config(kind, emulate=True))
    errors = [_rel(a, b) for a, b in zip(_run(low, x, grad), exact)]
    bounds = [E4M3_U, E5M2_U if kind == "tensorwise" else E4M3_U, E5M2_U if kind == "tensorwise" else E4M3_U]
    for i, (err, bound, base) in enumerate(zip(errors, bounds, bf16)):
        if kind == "rowwise_with_gw_hp" and i == 2:
            assert err < 2 * base, errors
        else:
            assert 5 * base < err < bound, (i, errors, bf16)


def test_mxfp8_forward_is_torchao_mx_blocks_then_the_product():
    x, w, grad = _problem()
    layer = nn.Linear(128, 96, bias=False)
    layer.weight.data = w.float()
    out, _, _ = _run(to_mxfp8(layer, emulate=True), x, grad)

    def mx(t):
        return MXTensor.to_mx(t.to(torch.bfloat16), torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL,
                              KernelPreference.EMULATED).dequantize(torch.bfloat16)

    torch.testing.assert_close(out, mx(x) @ mx(w).t(), rtol=0, atol=0)


def _cfg(precision="fp8", **precision_fields) -> Config:
    cfg = Config()
    cfg.model = tiny_model_cfg(num_layers=4, mla_layers=[2], d_model=32,
                               moe=dict(num_experts=4, top_k=2, hidden=32, first_dense=1, shared_experts=1))
    cfg.trainer.precision = precision
    for key, value in precision_fields.items():
        setattr(cfg.precision, key, value)
    return cfg


def _model(cfg: Config, convert: bool = True) -> tuple[KimiModel, list[str]]:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = KimiModel(cfg.model)
    names = apply_low_precision(model, cfg, CPU) if convert else []
    materialize(model, CPU)
    return model, names


def test_filter_keeps_ends_routers_and_small_projections_high_precision():
    cfg = _cfg(min_features=32)
    model, names = _model(cfg)
    assert names and all(isinstance(model.get_submodule(n), Fp8Linear) for n in names)
    assert {n.split(".")[1] for n in names} == {"1", "2"}  # blocks 0 and 3 are the ends
    assert not any(n.endswith("router") or "b_proj" in n or "lm_head" in n for n in names)
    assert "blocks.1.mlp.shared.w_gate" in names and "blocks.2.mixer.wo" in names
    # KDA's rank-16 gate projections are below min_features; the widest stay
    assert "blocks.1.mixer.f_proj_down" not in names and "blocks.1.mixer.q_proj" in names
    assert type(model.lm_head).__name__ == "LMHead"
    _, none = _model(_cfg(keep_end_blocks=2, min_features=32))
    assert none == []
    _, mx = _model(_cfg("mxfp8", keep_end_blocks=0, min_features=0))
    assert {n.split(".")[1] for n in mx} == {"0", "1", "2", "3"}  # 32-aligned dims only: no 16-wide ones
    assert not any("f_proj" in n or "g_proj_down" in n for n in mx)


def test_optimizer_updates_the_fp32_masters_as_without_conversion():
    """MuonClip (and its AdamW family) orthogonalises and updates the same plain fp32 parameters, under the
    same names, whether or not the projections compute in fp8: given equal gradients, equal updates."""
    cfg = _cfg(min_features=32)
    low, names = _model(cfg)
    plain, _ = _model(cfg, convert=False)
    assert names
    assert [n for n, _ in low.named_parameters()] == [n for n, _ in plain.named_parameters()]
    for (_, a), (_, b) in zip(low.named_parameters(), plain.named_parameters()):
        assert type(a) is nn.Parameter and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    for model in (low, plain):
        opt = build_optimizer(model, cfg.optim)
        opt.step()
    for (_, a), (_, b) in zip(low.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_qk_clip_logits_come_from_the_fp8_forward():
    """MLA's recorded max logits are those of the forward that ran: with its projections in fp8 they
    differ from the same weights' bf16 forward by about fp8's error, not by nothing."""
    cfg = _cfg(min_features=16)
    low, names = _model(cfg)
    plain, _ = _model(cfg, convert=False)
    assert "blocks.2.mixer.wkv_b" in names
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    seen = []
    for model in (low, plain):
        model.record_max_logits(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(ids).float().sum().backward()
        seen.append(model.blocks["2"].mixer.consume_max_logits())
    rel = ((seen[0] - seen[1]).abs() / seen[1].abs()).max().item()
    assert 2.0**-9 < rel < 0.5, seen


def test_mxfp4_packing_is_ocp_low_nibble_first_and_matches_torchao():
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([1.0, 6.0, -0.5, 3.0])  # block max 6: scale 2^0
    packed, scale = quantize(w)
    assert packed.dtype == scale.dtype == torch.uint8 and packed.shape == (1, 16) and scale.shape == (1, 1)
    # E2M1 codes: 1.0 -> 0b0010, 6.0 -> 0b0111, -0.5 -> 0b1001, 3.0 -> 0b0101; even element in the low nibble
    assert packed[0, :2].tolist() == [0x72, 0x59] and scale.item() == 127
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 8, 64, generator=g) * torch.logspace(-3, 2, 64)
    ref = MXTensor.to_mx(w.to(torch.bfloat16), torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.RCEIL,
                         KernelPreference.EMULATED).dequantize(torch.float32)
    torch.testing.assert_close(dequantize(*quantize(w)), ref, rtol=0, atol=0)


def test_mxfp4_fake_quantisation_has_a_straight_through_gradient():
    w = torch.randn(4, 64, requires_grad=True)
    q = fake_quantize(w)
    torch.testing.assert_close(q, dequantize(*quantize(w)), rtol=0, atol=0)
    assert not torch.equal(q, w)
    grad = torch.randn(4, 64)
    q.backward(grad)
    torch.testing.assert_close(w.grad, grad, rtol=0, atol=0)


def test_mxfp4_qat_model_exports_experts_whose_dequantised_forward_is_the_trained_one(tmp_path):
    from safetensors import safe_open

    cfg = _cfg("fp32", qat="mxfp4_experts")
    # what transformers' layout expresses (its MLA latent norm has eps 1e-6)
    cfg.model.kda.gate_bias, cfg.model.residual, cfg.model.mla.norm_eps = False, "standard", 1e-6
    model, _ = _model(cfg)
    with torch.no_grad():  # trained-like weights: not the layout of a fresh init
        for name, p in model.named_parameters():
            if ".experts.w_" in name:
                p.mul_(torch.logspace(-1, 1, p.shape[-1]))
    ids = torch.randint(0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        trained = model(ids)
        plain, _ = _model(cfg, convert=False)
        plain.load_state_dict(model.state_dict())
        assert not torch.equal(plain(ids), trained)  # the fake quantisation changes the forward
    save_hf(model, tmp_path / "hf", mxfp4_experts=True)
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        expert = "model.layers.1.block_sparse_moe.experts.0.w1"
        assert f"{expert}.weight" not in keys
        assert f.get_tensor(f"{expert}.weight_packed").shape == (32, 16)
        assert f.get_tensor(f"{expert}.weight_scale").dtype == torch.uint8
    with torch.no_grad():
        exported = load_hf(tmp_path / "hf")(ids)
    torch.testing.assert_close(exported, trained, rtol=0, atol=0)


# ---- the config's refusals ------------------------------------------------------------------------------
def test_precision_rules_refuse_with_one_line(monkeypatch):
    def refused(cfg) -> str:
        with pytest.raises(ConfigError) as e:
            validate_precision(cfg)
        assert "\n" not in str(e.value)
        return str(e.value)

    validate_precision(_cfg("fp8"))
    validate_precision(_cfg("fp32"))
    cfg = _cfg("fp8")
    cfg.parallel.engine = "deepspeed"
    assert "parallel.engine=deepspeed" in refused(cfg)
    cfg = _cfg("mxfp8")
    cfg.trainer.micro_batch_size, cfg.trainer.seq_len = 1, 48
    assert "multiple of 32" in refused(cfg)
    cfg = _cfg("bf16", qat="mxfp4_experts")
    cfg.model.moe.num_experts = 0
    assert "mixture-of-experts" in refused(cfg)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    assert "pip install -e '.[fp8]'" in refused(_cfg("fp8"))
    validate_precision(_cfg("bf16"))  # the extra is needed only when asked for


def test_gpu_without_the_formats_matmuls_is_refused_unless_emulated(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    p = _cfg().precision
    assert emulated("fp8", p, cuda) is False  # Hopper has fp8
    with pytest.raises(ConfigError, match="compute capability 10.0 or newer") as e:
        emulated("mxfp8", p, cuda)
    assert "\n" not in str(e.value)
    p.emulate = True
    assert emulated("mxfp8", p, cuda) is True
    assert emulated("fp8", _cfg().precision, CPU) is True
    p.emulate = False
    with pytest.raises(ConfigError, match="needs CUDA"):
        emulated("fp8", p, CPU)

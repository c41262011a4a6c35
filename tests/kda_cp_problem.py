"""The fp64 inputs of tests/ops/test_kda_context.py, shared with its torchrun worker tests/dist_kda_cp.py:
KDA's q, k, v, log decays and betas, a short conv with a packed input, and attention's q, k, v."""

import torch

B, T, H, K, V = 2, 32, 2, 8, 6


def inputs(b: int = B, seed: int = 0, t: int = T):
    g_ = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, H, K, generator=g_, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(b, t, H, K, generator=g_, dtype=torch.float64), dim=-1)
    v = torch.randn(b, t, H, V, generator=g_, dtype=torch.float64)
    g = -torch.rand(b, t, H, K, generator=g_, dtype=torch.float64) * 0.3  # log decays
    beta = torch.rand(b, t, H, generator=g_, dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def conv_inputs():
    """A short conv (kernel 4) and a packed input [1, T, C] for it."""
    from kimi.model.kda import ShortConv

    torch.manual_seed(3)
    conv = ShortConv(5, 4).double()
    conv.reset_parameters()
    x = torch.randn(1, T, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    return conv, x.requires_grad_()


def attention_inputs():
    g_ = torch.Generator().manual_seed(5)
    return [torch.randn(2, T, 2, 8, generator=g_, dtype=torch.float64).requires_grad_() for _ in range(3)]

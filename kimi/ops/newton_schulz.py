"""Quintic Newton-Schulz orthogonalisation (Muon's "NS5"), batched over same-shape matrices.

For G = U S V^T it returns U S' V^T where S' is near, not at, 1 except for tiny singular values: the
coefficients (3.4445, -4.7750, 2.0315) (Keller Jordan's Muon) maximise the slope at zero so small singular
values grow fast in 5 steps, at the price of oscillating around 1 instead of converging; this does not hurt
training.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G: torch.Tensor, steps: int = 5,
                  coefficients: Tuple[float, float, float] = DEFAULT_COEFFICIENTS,
                  eps: float = 1e-7, dtype: torch.dtype = torch.float32, overwrite: bool = False,
                  buffers: Optional[dict] = None) -> torch.Tensor:
    """Orthogonalise a matrix [A, B] or each matrix of a batch [N, A, B]; runs in ``dtype``, returns G's.

    Each matrix is divided by its Frobenius norm (an upper bound on the spectral norm, so all singular
    values start in [0, 1]) and transposed to be wide, so the Gram matrix X X^T is min(A, B) square:
    the cheaper side, and the same result because the iteration commutes with transposition.
    ``overwrite=True`` lets it scale G in place (a scratch batch of the caller's) instead of copying it.
    A wide G already in ``dtype`` comes back without a copy or cast at the end (MuonClip's batches).
    ``buffers``: a dict kept by the caller across calls, where the scratch tensors live (by shape), so a
    step allocates nothing; the result may then be one of them, valid until the next call.
    """
    if G.ndim not in (2, 3):
        raise ValueError(f"newton_schulz takes a matrix [A, B] or a batch [N, A, B], not {tuple(G.shape)}")
    a, b, c = coefficients
    X = G.to(dtype) if G.ndim == 3 else G.to(dtype).unsqueeze(0)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    norm = torch.linalg.matrix_norm(X, keepdim=True) + eps
    # a fresh copy (G cast to dtype) or the caller's scratch: scale in place, else into a new tensor
    X = X.div_(norm) if (overwrite or X.data_ptr() != G.data_ptr()) else X / norm
    # Buffers allocated once and reused by every iteration (large fresh allocations cost page faults on CPU)
    A = scratch(buffers, "gram", X.shape[:-1] + X.shape[-2:-1], X)
    B, Y = scratch(buffers, "poly", A.shape, X), scratch(buffers, "iterate", X.shape, X)
    for _ in range(steps):
        torch.bmm(X, X.mT, out=A)
        # X <- a X + (b A + c A^2) X, as two fused multiply-adds
        torch.baddbmm(A, A, A, beta=b, alpha=c, out=B)
        torch.baddbmm(X, B, X, beta=a, out=Y)
        X, Y = Y, (X if X.is_contiguous() else scratch(buffers, "iterate 2", Y.shape, Y))
    if tall:
        X = X.mT
    X = X if G.ndim == 3 else X.squeeze(0)
    return X.to(G.dtype).contiguous()


def scratch(buffers: Optional[dict], name: str, shape, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous tensor of like's dtype and device: from ``buffers`` (created there on first
    use) when given, else new."""
    shape, dtype, device = tuple(shape), like.dtype, like.device
    if buffers is None:
        return torch.empty(shape, dtype=dtype, device=device)
    key = (name, shape, dtype, device)
    if key not in buffers:
        buffers[key] = torch.empty(shape, dtype=dtype, device=device)
    return buffers[key]


def newton_schulz_reference(G: torch.Tensor, steps: int = 5,
                            coefficients: Tuple[float, float, float] = DEFAULT_COEFFICIENTS,
                            eps: float = 1e-7) -> torch.Tensor:
    """The same iteration written out literally in fp64, one matrix at a time, for tests."""
    if G.ndim == 3:
        return torch.stack([newton_schulz_reference(g, steps, coefficients, eps) for g in G])
    a, b, c = coefficients
    X = G.double()
    X = X / (torch.sqrt((X * X).sum()) + eps)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    for _ in range(steps):
        A = X @ X.T
        X = a * X + b * (A @ X) + c * (A @ A @ X)
    return X.T if tall else X

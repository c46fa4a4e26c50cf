"""PCANet initialisation: every convolution's filters from the principal components of its input patches.

PCANet (Chan et al., "PCANet: A Simple Deep Learning Baseline for Image Classification", IEEE TIP 24(12), 2015)
learns a filter bank without labels or gradients: the leading eigenvectors of the covariance of mean-removed
``k x k`` patches of the images, and a second stage the same way on the first stage's outputs. Here every
``nn.Conv2d`` of a network is set in forward order, each from the patches of its input as the (already set) layers
before it produce them. The FLITE paper (appendix E) uses PCANet-initialised bases as one warm start for training a
network from scratch through its latent.

What PCANet does not define (it has single-channel stages and no other layers) is our choice:

- a patch spans every input channel (``C k k`` values, as PCANet's colour variant), its mean over them removed, so
  a filter's response on the raw input equals its response on the mean-removed patch;
- a layer with more filters than patch directions of non-zero variance keeps its random filters past them (a 3x3
  single-channel layer has 8 such directions);
- the components are scaled to the root-mean-square norm of the random filters they replace, so each layer keeps its
  initialisation's scale, and each is signed so that its entry of largest magnitude is positive (reproducible);
- biases, normalisation and linear layers keep their initialisation.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

#: Bump when the filters this module computes change; it is part of the cached base's key.
VERSION = "lightning_fl.models.pcanet/1"


@dataclass(frozen=True)
class LayerPCA:
    """What :func:`pcanet_init_` did to one convolution."""

    name: str
    patch_dim: int  # C k k
    filters: int  # the layer's output channels
    pca_filters: int  # how many of them are principal components (the rest kept their random values)
    variance_kept: float  # share of the patch variance the principal-component filters span


class _Captured(Exception):
    """Raised by the capture hook to stop the forward pass once the layer's input is seen."""


def conv_order(net: nn.Module, example: torch.Tensor) -> list[tuple[str, nn.Conv2d]]:
    """The network's ``nn.Conv2d`` modules in the order a forward pass on ``example`` first calls them."""
    names = {m: n for n, m in net.named_modules() if isinstance(m, nn.Conv2d)}
    order: list[nn.Conv2d] = []
    hooks = [m.register_forward_pre_hook(lambda m, _: order.append(m) if m not in order else None) for m in names]
    try:
        net(example)
    finally:
        for h in hooks:
            h.remove()
    return [(names[m], m) for m in order]


def patch_covariance(
    net: nn.Module, conv: nn.Conv2d, images: torch.Tensor, batch_size: int = 64
) -> tuple[torch.Tensor, int]:
    """``sum_p x_p x_p^T`` (float64) over the mean-removed input patches ``x_p`` of ``conv``, and their count.

    ``images`` go through ``net`` in batches; each pass stops at ``conv``'s input."""
    dim = conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1]
    total = torch.zeros(dim, dim, dtype=torch.float64, device=images.device)
    count = 0

    def capture(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        nonlocal total, count
        cols = nn.functional.unfold(
            args[0].float(), conv.kernel_size, dilation=conv.dilation, padding=conv.padding, stride=conv.stride
        )  # (B, C k k, L)
        x = cols.transpose(1, 2).reshape(-1, dim).double()  # float64: the mean's direction must come out as zero
        x = x - x.mean(1, keepdim=True)  # PCANet's patch-mean removal
        total += x.T @ x
        count += len(x)
        raise _Captured

    hook = conv.register_forward_pre_hook(capture)
    try:
        for start in range(0, len(images), batch_size):
            with contextlib.suppress(_Captured):
                net(images[start : start + batch_size])
    finally:
        hook.remove()
    return total, count


@torch.no_grad()
def pcanet_init_(net: nn.Module, images: torch.Tensor, batch_size: int = 64) -> list[LayerPCA]:
    """Set every convolution of ``net`` (in forward order) to the principal components of its input patches.

    Args:
        net: The network (its ``nn.Conv2d`` modules must be ungrouped, with ``padding_mode='zeros'``).
        images: The unlabelled images ``(N, C, H, W)`` the patches come from.
        batch_size: Images per forward pass.

    Returns:
        One :class:`LayerPCA` per convolution, in the order they were set.
    """
    if images.ndim != 4 or len(images) == 0:
        raise ValueError(f"PCANet needs a non-empty batch of images (N, C, H, W), got shape {tuple(images.shape)}")
    was_training = net.training
    net.eval()  # normalisation layers use their running statistics, if any; nothing is updated
    try:
        order = conv_order(net, images[:2])
        if not order:
            raise ValueError(f"PCANet sets convolution filters, and {type(net).__name__} has no nn.Conv2d")
        bad = [n for n, c in order if c.groups != 1 or c.padding_mode != "zeros"]
        if bad:
            raise ValueError(f"PCANet needs ungrouped, zero-padded convolutions; {', '.join(bad)} are not")
        report = []
        for name, conv in order:
            cov, count = patch_covariance(net, conv, images, batch_size)
            values, vectors = torch.linalg.eigh(cov / max(count, 1))  # ascending
            values, vectors = values.flip(0), vectors.flip(1)
            spanned = int((values > values[0].clamp_min(0) * 1e-8).sum()) if values[0] > 0 else 0
            k = min(conv.out_channels, spanned)
            weight = conv.weight.view(conv.out_channels, -1)
            if k:
                comps = vectors[:, :k].T  # (k, C k k), orthonormal rows
                largest = comps.abs().argmax(1, keepdim=True)
                comps = comps * comps.gather(1, largest).sign()
                scale = weight.double().norm(dim=1).pow(2).mean().sqrt()
                weight[:k] = (comps * scale).to(weight)
            kept = float(values[:k].clamp_min(0).sum() / values.clamp_min(0).sum()) if k else 0.0
            report.append(LayerPCA(name, weight.shape[1], conv.out_channels, k, kept))
    finally:
        net.train(was_training)
    return report

"""The mapped weights of a round's starting latent, formed once for all of the round's clients.

Every client of a round starts from the same global latent, so its first forward pass forms the same mapped weights
``theta_pre + U V^T z`` as every other client's: with ``stored`` factors that is a pass over ``U`` (51 MB on the
cross-device CNN) per client for one result. :class:`KeptStart` keeps that result: set when a federated state is
loaded (:meth:`~lightning_fl.mapping.LatentMapping.keep_start`), used while the latent, the base tensor and the
factor are exactly those it was formed from, and given a gradient with the very operations ``torch.addmv``'s
backward runs (:class:`_Kept`), so training with it gives the same values bit for bit (tests/test_mapping.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class _Kept(torch.autograd.Function):
    """``out`` (``= base + mat @ vec``, formed before) with ``torch.addmv``'s gradient for ``vec``: ``mat.t().mv(g)``
    (derivatives.yaml: ``vec: maybe_multiply(mat.t().conj().mv(grad), alpha.conj())``, alpha 1, real tensors)."""

    @staticmethod
    def forward(ctx, vec: torch.Tensor, mat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(mat)
        return out.clone()  # (a new tensor: what the forward pass does with it cannot touch the kept one)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mat,) = ctx.saved_tensors
        return mat.t().mv(grad) if ctx.needs_input_grad[0] else None, None, None


@dataclass
class KeptStart:
    """The starting latent ``z`` and, per mapped layer, the weights formed from it (with what they were formed from)."""

    z: torch.Tensor
    layers: dict[int, tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def applies(self, latent: torch.Tensor) -> bool:
        """Whether ``latent`` is the kept start, exactly (never under ``vmap`` or ``grad`` transforms)."""
        return (
            not torch._C._functorch.is_functorch_wrapped_tensor(latent)
            and latent.shape == self.z.shape
            and latent.dtype == self.z.dtype
            and latent.device == self.z.device
            and torch.equal(latent.detach(), self.z)
        )

    def mapped(self, index: int, weight: torch.Tensor, mat: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        """``torch.addmv(weight.reshape(-1), mat, vec)``, formed the first time and then reused while ``weight`` (the
        base tensor itself, at the same version) and ``mat`` are what it was formed from."""
        kept = self.layers.get(index)
        if kept is not None and kept[0] is weight and kept[1] == weight._version and kept[2] is mat:
            return _Kept.apply(vec, mat, kept[3])
        out = torch.addmv(weight.reshape(-1), mat, vec)
        self.layers[index] = (weight, weight._version, mat, out.detach().clone())
        return out

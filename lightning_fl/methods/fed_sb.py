"""Fed-SB: federated LoRA-SB, an ``r x r`` matrix trained between frozen adapters chosen from data.

Singhal, Ponkshe, Vartak and Vepakomma, "Fed-SB: A Silver Bullet for Extreme Communication Efficiency and Performance
in (Private) Federated LoRA Fine-Tuning" (arXiv 2502.15436), on LoRA-SB (Ponkshe et al., arXiv 2411.19557): each
adapted ``m x n`` weight becomes ``W + B R A`` with ``B`` (``m x r``) and ``A`` (``r x n``) frozen, from the truncated
SVD of the first update full fine-tuning would take, and ``R`` (``r x r``) the only trained and uploaded part,
starting at that update's top singular values. Clients send ``r^2`` floats per adapted weight, and since every
client shares ``B`` and ``A``, averaging the ``R`` of the clients averages their weights exactly.

This is FLITE's two-sided family (:mod:`lightning_fl.mapping.two_sided`: ``W + A C B^T``, ``C`` a ``p x q`` grid)
with a square grid (``p = q = r``, the latent ``d = r^2`` per weight, its ``V`` the identity), the parts from public
data (``subspace: public``, :mod:`lightning_fl.methods.subspace`: the statistic is computed on public records only,
never on a client's) and the grid starting at the singular values (``latent_init: svd``). So it shares FLITE's
forward pass (the delta rides on each layer's output, never formed), its fingerprint (the parts' bytes), its
averaging-identity check, its export (merged weights) and every trainer path; only where the subspace comes from
and where ``R`` starts differ from FLITE's random subspace.
"""

from __future__ import annotations

from torch import nn

from lightning_fl.mapping.lowrank import LayerSelection
from lightning_fl.methods.language import LatentLanguageModel
from lightning_fl.methods.latent import LATENT_RECIPE
from lightning_fl.methods.schedules import Recipe


class FedSBLanguageModel(LatentLanguageModel):
    """Fed-SB (module docstring) on a pretrained language model: ``R`` (``rank x rank``) per adapted weight trains.

    Args:
        network: A pretrained causal language model (``HFCausalLM``, ``SmolLM2``).
        rank: ``r``: each adapted weight trains and sends ``r^2`` floats.
        layers: Which weights get adapters: ``linear`` (the attention and MLP projections) or name patterns.
        public_records: Public records the initial statistic (its SVD gives ``B``, ``A`` and ``R``'s start) is
            computed over.
        recipe: ``R``'s optimiser recipe; default FLITE's latent recipe (Adam at 1e-2); its learning rate also
            scales the statistic (``-lr sign(gradient)``, LoRA-SB's first Adam step), so ``R`` starts at that step.
        sample_prompt: See :class:`~lightning_fl.methods.LanguageModel`.
        sample_tokens: See :class:`~lightning_fl.methods.LanguageModel`.
        sample_top_k: See :class:`~lightning_fl.methods.LanguageModel`.
        sample_seed: See :class:`~lightning_fl.methods.LanguageModel`.
    """

    def __init__(
        self,
        network: nn.Module,
        rank: int = 16,
        layers: LayerSelection | list[str] = "linear",
        public_records: int = 64,
        recipe: Recipe = LATENT_RECIPE,
        sample_prompt: str = "To be, or not to be",
        sample_tokens: int = 200,
        sample_top_k: int | None = None,
        sample_seed: int = 0,
    ) -> None:
        super().__init__(
            network=network,
            latent_dim=rank * rank,
            rank=rank * rank,
            layers=layers,
            factors="two_sided",
            recipe=recipe,
            subspace="public",
            public_records=public_records,
            latent_init="svd",
            sample_prompt=sample_prompt,
            sample_tokens=sample_tokens,
            sample_top_k=sample_top_k,
            sample_seed=sample_seed,
        )

    def method_name(self) -> str:
        return f"Fed-SB (r = {self.hparams.rank})"

"""FLITE's steering of a frozen base by a latent, the part every latent method shares (:class:`LatentSteering`: the
latent classifier, the latent language model and LoRA's base handling; the classifier: :mod:`.latent`)."""

from __future__ import annotations

import torch

from lightning_fl.errors import ConfigError
from lightning_fl.mapping.lowrank import FactorMode, LatentMapping, LayerSelection, memory_report
from lightning_fl.methods.pretraining import Pretraining


class LatentSteering:
    """FLITE's per-module part, shared by the latent classifier and language model.

    The host module keeps a frozen network (``steered``, the module the latent maps) and a
    :class:`~lightning_fl.mapping.LatentMapping` over it (``self.mapping``); this mixin computes the forward pass
    with the mapped weights and the federated hooks that check the averaging identity.
    """

    #: The config key a base checkpoint comes from (named in errors about the file).
    init_from_key = "model.base_checkpoint="

    mapping: LatentMapping

    @staticmethod
    def base_source(
        base: str,
        base_checkpoint: str | None,
        pretraining: Pretraining,
        teacher: bool = False,
        choices: tuple[str, ...] = ("pretrained", "scratch"),
    ) -> dict:
        """``init_from`` and ``pretraining`` for the host's constructor, from ``model.base`` (one of ``choices``) and
        its checkpoint (with ``teacher``: where the teacher's weights come from; the base itself stays random).
        Every base but ``scratch`` is made and cached (``pretraining`` gives its recipe or seed, and the cache), and
        only ``pretrained`` can come from ``base_checkpoint`` instead."""
        if base not in choices:
            raise ConfigError(f"model.base must be one of {', '.join(map(repr, choices))}, got {base!r}")
        if teacher and base != "scratch":
            raise ConfigError(
                "model.latent_init is 'teacher' (a random base whose latent starts at a teacher's least-squares fit) "
                f"but model.base is {base!r}; set model.base scratch, or model.latent_init zero"
            )
        if base != "pretrained" and base_checkpoint is not None and not teacher:
            raise ConfigError(f"model.base is {base!r} but model.base_checkpoint is set; drop one of them")
        made = base != "scratch" or teacher
        return {"init_from": base_checkpoint, "pretraining": pretraining if made else None}

    @property
    def steered(self) -> torch.nn.Module:
        """The frozen network whose weights the latent maps."""
        raise NotImplementedError(f"{type(self).__name__} must say which network its latent steers")

    def steer(
        self,
        latent_dim: int | list[int],
        rank: int,
        layers: LayerSelection | list[str],
        factors: FactorMode,
        factor_seed: int,
        max_dense_bytes: int,
    ) -> None:
        """Freeze ``steered`` and build ``self.mapping`` over it (the constructor arguments of the same names)."""
        self.steered.requires_grad_(False)
        self.mapping = LatentMapping(
            self.steered,
            latent_dim=latent_dim,
            rank=rank,
            layers=layers,
            mode=factors,
            seed=factor_seed,
            max_dense_bytes=max_dense_bytes,
        )

    @torch.no_grad()
    def fit_latent(self, teacher: dict[str, torch.Tensor]) -> None:
        """Set ``z`` to the least-squares fit of ``teacher``'s mapped weights (appendix E's warm start):
        ``z_l = argmin ||theta_l + U_l V_l^T z_l - teacher_l|| = V_l U_l^T (teacher_l - theta_l)``, the minimum-norm
        solution, since ``U_l`` and ``V_l`` have orthonormal columns (dense mode: ``W_l^+ (teacher_l - theta_l)``)."""
        base = self.mapped_base()
        parts = []
        for lay in self.mapping.layers:
            delta = (teacher[lay.name].to(torch.float64) - base[lay.name].to(torch.float64)).reshape(-1)
            u = self.mapping.u_factor(lay).to(torch.float64)
            dense = self.mapping.mode == "dense"  # W_l^+ (W_l^T when its d columns are orthonormal, d <= P)
            parts.append(
                torch.linalg.pinv(u, rtol=1e-6) @ delta
                if dense
                else self.mapping.v_factor(lay).to(torch.float64) @ (u.T @ delta)
            )
        self.mapping.latent.copy_(torch.cat(parts).to(self.mapping.latent))

    def memory_report(self):
        """Analytic bytes of each factor mode for this model (see :func:`lightning_fl.mapping.memory_report`)."""
        return memory_report(self.steered, self.hparams.latent_dim, self.hparams.rank, self.hparams.layers)

    def mapped_base(self) -> dict[str, torch.Tensor]:
        """The frozen base weights of the mapped layers."""
        return {name: self.steered.get_parameter(name) for name in self.mapping.names}

    def load_federated_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load ``state``: a round's clients start there (the mapping keeps its weights: ``keep_start``)."""
        super().load_federated_state(state)
        self.mapping.keep_start()

    def steered_forward(self, *args: torch.Tensor) -> torch.Tensor:
        """``steered(*args)`` with the mapped weights ``theta_pre + U V^T z`` (differentiable in ``z``); under
        ``gradient_checkpointing`` the deltas stay attached (:meth:`~lightning_fl.mapping.LatentMapping.attach`)."""
        if getattr(self.steered, "gradient_checkpointing", False):
            self.mapping.attach(self.steered)
        return self.mapping.call(self.steered, self.mapped_base(), *args)

    @torch.no_grad()
    def averaging_identity_error(self, states: list[dict[str, torch.Tensor]]) -> float:
        """``max |mean_k theta(z_k) - theta(mean_k z_k)|`` over the mapped weights (FLITE eq. 4)."""
        zs = torch.stack([s["mapping.latent"].to(self.mapping.latent) for s in states])  # (K, D)
        per_client = [self.mapping.split(z) for z in zs]  # K lists of per-layer latents
        averaged = self.mapping.split(zs.mean(0))
        base = self.mapped_base()
        worst = 0.0
        for i, lay in enumerate(self.mapping.layers):  # one layer at a time bounds the memory
            b = base[lay.name]
            mean_theta = sum(self.mapping.mapped(lay, b, z[i]) for z in per_client) / len(per_client)
            theta_of_mean = self.mapping.mapped(lay, b, averaged[i])
            worst = max(worst, (mean_theta - theta_of_mean).abs().max().item())
        return worst

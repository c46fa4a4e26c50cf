"""The round's stages between a decoded upload and the next global state (:mod:`lightning_fl.federated.round`).

:class:`Screening` is what an accepted upload passes before it is folded: the simulated attack, the finiteness
check and the norm gate, per client as it arrives (streaming) or over the round's rows at once (with the round's
median norm). :class:`Aggregation` is the server's side: aggregate, noise (central DP), step the strategy, check
the result, and broadcast it (compressed, with ``trainer.compressed_downloads``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import lightning as L
import torch

from lightning_fl.compress.downlink import Downlink
from lightning_fl.federated.attacks import Attack
from lightning_fl.federated.gate import UploadRejectedError, non_finite_rows
from lightning_fl.federated.state import State, unflatten
from lightning_fl.federated.strategies import Strategy
from lightning_fl.federated.uploads import REJECTED, Entry, RoundUploads, SecureTotal, rows, update_norms
from lightning_fl.privacy.base import Privacy


class Screening:
    """The upload policy, the norm bounds and the simulated attack (see the trainer's arguments of those names)."""

    def __init__(
        self,
        upload_policy: str = "drop",
        attack: Attack | None = None,
        max_update_norm: float | None = None,
        max_update_norm_ratio: float | None = None,
    ) -> None:
        self.upload_policy, self.attack = upload_policy, attack
        self.max_update_norm, self.max_update_norm_ratio = max_update_norm, max_update_norm_ratio

    def reject(self, r: int, client: int, problems: list[str]) -> None:
        """Apply the upload policy to a rejected upload: raise, or warn and leave it out."""
        message = f"round {r + 1}, client {client}: upload rejected: {'; '.join(problems)}"
        if self.upload_policy == "raise":
            raise UploadRejectedError(message + " (trainer.upload_policy is 'raise'; use 'drop' to skip it)")
        warnings.warn(message + "; dropped from this round", stacklevel=4)

    def refuse(self, r: int, entry: Entry, problems: list[str]) -> None:
        self.reject(r, entry.client, problems)
        entry.status = REJECTED

    def norm_limits(self, norms: torch.Tensor | None = None, relative: bool = True) -> list[tuple[float, str]]:
        """The update-norm bounds of a round whose uploads have ``norms``, each with the reason it names.

        ``relative``: include ``max_update_norm_ratio`` times the round's median (skipped when the median is 0 or
        ``norms`` is not given).
        """
        limits = []
        if self.max_update_norm is not None:
            limits.append((self.max_update_norm, f"exceeds trainer.max_update_norm={self.max_update_norm:g}"))
        if relative and self.max_update_norm_ratio is not None and norms is not None and len(norms):
            median = float(norms.median())  # the lower median: an honest majority keeps it honest
            if median > 0:
                limits.append((
                    self.max_update_norm_ratio * median,
                    f"is more than trainer.max_update_norm_ratio={self.max_update_norm_ratio:g} times the round's "
                    f"median update norm {median:.4g}",
                ))  # fmt: skip
        return limits

    def client(self, uploads: RoundUploads, entry: Entry, row: torch.Tensor, r: int, seed: int):
        """One accepted upload through the simulated attack, the finiteness check and the absolute norm gate:
        the row to fold, or ``None`` (rejected, ``entry.status`` says so)."""
        if self.attack is not None:
            forged, attacked = self.attack.apply(r, uploads.current, row.unsqueeze(0), [entry.client], seed)
            if attacked:
                row = forged[0]
                uploads.attacked += 1
            if not bool(torch.isfinite(row).all()):
                self.refuse(r, entry, ["non-finite values"])
                return None
        entry.norm = float(update_norms(row.unsqueeze(0), uploads.current64)[0])
        problems = [f"update norm {entry.norm:.4g} {why}" for limit, why in self.norm_limits() if entry.norm > limit]
        if problems:
            self.refuse(r, entry, problems)
            return None
        return row

    def round(self, uploads: RoundUploads, r: int, seed: int) -> None:
        """The kept rows through the attack (which may forge from all of them), the finiteness check and the norm
        gate (with the round's median norm); ``uploads.rows`` and ``row_clients`` keep the rows that pass."""
        clients = list(uploads.row_clients)
        rows_ = rows(uploads.rows, list(range(len(clients))))
        if self.attack is not None:
            rows_, attacked = self.attack.apply(r, uploads.current, rows_, clients, seed)
            uploads.attacked = len(attacked)
            bad = set(non_finite_rows(rows_))
            for i in sorted(bad):
                self.refuse(r, uploads.entry(clients[i]), ["non-finite values"])
            good = [i for i in range(len(clients)) if i not in bad]
            clients, rows_ = [clients[i] for i in good], rows(rows_, good)
        norms = update_norms(rows_, uploads.current64)
        limits = self.norm_limits(norms)
        good = []
        for i, client in enumerate(clients):
            entry = uploads.entry(client)
            entry.norm = float(norms[i])
            problems = [f"update norm {entry.norm:.4g} {why}" for limit, why in limits if entry.norm > limit]
            if problems:
                self.refuse(r, entry, problems)
            else:
                good.append(i)
        uploads.row_clients, uploads.rows = [clients[i] for i in good], rows(rows_, good)


class Aggregation:
    """The server's stages of a round, from the folded uploads (or rows) to the next global state."""

    def __init__(
        self,
        fabric: L.Fabric,
        strategy: Strategy,
        screening: Screening,
        privacy: Privacy | None = None,
        secure=None,
        downlink: Downlink | None = None,
        identity: Callable[[list[State]], float] | None = None,
    ) -> None:
        self.fabric, self.strategy, self.screening = fabric, strategy, screening
        self.privacy, self.secure, self.downlink, self.identity = privacy, secure, downlink, identity

    def __call__(self, r: int, state: State, names: list[str], uploads: RoundUploads) -> tuple[State, dict]:
        """Aggregate, noise (central DP), step the strategy; keep ``state`` when the round cannot be aggregated or
        its result is unusable.

        The aggregate passes the gate's checks before it becomes the global state: finite values, and a step
        within ``max_update_norm`` (and, for linear strategies, ``max_update_norm_ratio`` times the median).
        Under central DP every round releases its noised sum (even of no upload): skipping a round because few
        uploads arrived would reveal how many did; refusing a non-finite or too large noised result is
        post-processing.
        """
        strategy, current = self.strategy, uploads.current
        central = self.privacy is not None and self.privacy.central
        folded = uploads.folded
        # (a secure round never sees an update, so it has no update norms)
        norms = torch.tensor([uploads.entry(c).norm for c in folded if self.secure is None], dtype=torch.float64)
        metrics: dict[str, float] = {}
        problem = None if central else strategy.problem(len(folded))
        if self.secure is not None:  # the exact sum of the dequantised updates, from the modular sum
            n = len(folded)
            total = (
                self.secure.recover(uploads.secure_total, n) if n else torch.zeros(len(current), dtype=torch.float64)
            )
            uploads.sum = SecureTotal(total, n)
        if problem is None:
            new_flat, extra = self._step(r, uploads, metrics)
            step = float((new_flat.double() - current.double()).norm())
            # a server optimiser's step is not bounded by the clients' updates: only the absolute bound applies
            limits = self.screening.norm_limits(norms, relative=strategy.linear)
            name = strategy.name
            if not bool(torch.isfinite(new_flat).all()):
                problem = f"aggregate refused: {name} produced non-finite values"
            elif too_far := [why for limit, why in limits if step > limit]:
                problem = f"aggregate refused: {name}'s step has norm {step:.4g}, which " + "; ".join(too_far)
            else:
                if self.downlink is None:
                    new_state = unflatten(new_flat, state, names)
                else:  # the step, compressed with the server's error feedback: what every client applies
                    delta = (new_flat.to(torch.float64) - current.to(torch.float64)).to(torch.float32)
                    new_state, payload = self.downlink.broadcast(unflatten(delta, state, names, typed=False), state)
                    metrics["comm/broadcast_bytes"] = float(payload.nbytes)
                if self.identity is not None and self.fabric.is_global_zero and len(folded):
                    metrics["fed/identity_error"] = self.identity([unflatten(u, state, names) for u in uploads.rows])
                metrics.update({f"strategy/{k}": float(v) for k, v in extra.items()})
                state = {n: t.to(state[n].device) for n, t in new_state.items()}
            if problem is not None and len(norms):
                top = int(norms.argmax())
                problem += (
                    f"; the largest update came from client {folded[top]} (norm {float(norms[top]):.4g}, the "
                    f"round's median {float(norms.median()):.4g})"
                )
        if problem is not None:
            warnings.warn(f"round {r + 1}: {problem}; the global state is unchanged", stacklevel=3)
            if self.downlink is not None:  # nothing changed: nothing to broadcast
                self.downlink.skip()
                metrics["comm/broadcast_bytes"] = 0.0
        metrics["fed/round_skipped"] = float(problem is not None)
        if len(norms):  # of the accepted updates, before any clipping: what a clip bound is chosen from
            metrics["fed/update_norm_median"] = median = float(norms.median())
            if median > 0:  # the largest over the median: the gate ratio under which this round refuses nothing
                metrics["fed/update_norm_max_ratio"] = float(norms.max()) / median
        return state, metrics

    def _step(self, r: int, uploads: RoundUploads, metrics: dict) -> tuple[torch.Tensor, dict]:
        """The strategy's new flat state from the round's sum (secure, central DP's noised one, or plain) or rows."""
        strategy, current, folded = self.strategy, uploads.current, uploads.folded
        if self.secure is not None and not (self.privacy is not None and self.privacy.central):
            return strategy.step(r, current, current.double() + uploads.sum.total / len(folded))
        if self.privacy is not None and self.privacy.central:
            mean, released = self.privacy.release(uploads.sum.total, uploads.unclipped, len(folded), r)
            if self.fabric.world_size > 1:  # noise from the OS differs per process: rank 0's release holds
                mean, released, self.privacy.bound = self.fabric.broadcast((mean, released, self.privacy.bound))
            metrics.update(released)
            return strategy.step(r, current, current.double() + mean)
        if strategy.streams:
            return strategy.step(r, current, uploads.sum.mean())
        weights = torch.tensor([uploads.entry(c).weight for c in folded], dtype=torch.float64)
        return strategy.aggregate(r, current, uploads.rows, weights, list(folded))

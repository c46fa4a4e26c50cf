"""Federated LoRA and FFA-LoRA: low-rank adapters on a frozen (pretrained) network, through Hugging Face's PEFT.

LoRA (Hu et al. (2021), "LoRA: Low-Rank Adaptation of Large Language Models") adds ``s B A`` to a frozen weight
``W0`` (``A``: ``r x in``, ``B``: ``out x r``, ``s = alpha / r``; for a convolution ``A`` is an ``r``-filter
convolution of the layer's kernel size and ``B`` a 1x1 convolution, so ``B A`` has the layer's kernel shape). ``B``
starts at zero, so the adapted network starts exactly at the base. Clients train and upload ``A`` and ``B``; the
server averages them, which is not averaging the products: ``mean_k(B_k A_k) != mean_k(B_k) mean_k(A_k)`` (the
aggregation error, logged each round as ``fed/identity_error``). FFA-LoRA (Sun, Li, Li, Ding (2024), "Improving
LoRA in Privacy-preserving Federated Learning", ICLR) freezes a random ``A`` shared by every client and trains only
``B``: then ``mean_k(B_k A) = mean_k(B_k) A`` and averaging is exact, as FLITE's frozen ``U V^T`` makes it.

The adapters are PEFT's own (``peft.inject_adapter_in_model`` with a ``LoraConfig`` over this method's target
modules); PEFT is an optional dependency (``pip install -e ".[lora]"``). PEFT wraps each target module, so its
weights move to ``<module>.base_layer.*`` in the state dict; the base's weights keep their plain names everywhere
a base is made, cached or loaded (:meth:`LoRAAdapters.own_weights`), so a LoRA run shares the pretrained base of
FLITE and FedAvg on the same architecture, data and recipe. The adapters' initial values come from ``adapter_seed``
alone (not the run's random state), so every process builds the same ``A``; the frozen tensors' digest is the
fingerprint every client must agree on.

Kept as one file: :class:`LoRAAdapters` is what both LoRA classes are (injection, base weights, the fingerprint, the
identity check, the merged weights) and each class adds a constructor; apart, one method's adapters would be read
across three files.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Literal

import torch
from torch import nn

from lightning_fl.checkpoint import digest_tensors
from lightning_fl.errors import ConfigError
from lightning_fl.mapping.lowrank import LayerSelection, select_weights
from lightning_fl.methods.classifier import Classifier
from lightning_fl.methods.language import (
    LM_PRETRAINING,
    LanguageModel,
    language_base_source,
    log_selection,
    mapped_layers,
)
from lightning_fl.methods.latent import LATENT_RECIPE, LatentSteering
from lightning_fl.methods.pretraining import PAPER_PRETRAINING, Pretraining
from lightning_fl.methods.schedules import Recipe
from lightning_fl.models.backbone import Backbone
from lightning_fl.models.heads import HeadKind

Variant = Literal["lora", "ffa"]
#: PEFT's name of the one adapter every target module gets.
ADAPTER = "default"


def target_modules(network: nn.Module, layers: LayerSelection | list[str]) -> list[str]:
    """The names of ``network``'s modules whose weights ``layers`` selects (as FLITE selects them:
    ``conv``, ``linear``, ``conv+linear`` or ``fnmatch`` patterns over weight names)."""
    return [name.removesuffix(".weight") for name in select_weights(network, layers)]


#: How LoRA's adapters train by default: FLITE's latent recipe (``LATENT_RECIPE``) without weight decay.
LORA_RECIPE = dataclasses.replace(LATENT_RECIPE, weight_decay=0.0)


class LoRAAdapters:
    """LoRA's per-module part, shared by the classifier and the language model: the host keeps its network under
    ``adapted_attr`` (``backbone``, ``network``) and calls :meth:`adapt` at the end of its constructor."""

    #: The attribute of the network that gets adapters (its state-dict prefix too).
    adapted_attr: str
    adapted: list[str]

    def adapt(self, layers: LayerSelection | list[str], variant: str, rank: int, alpha: float | None, seed: int):
        """Freeze the network, keep a copy of it as bases are trained, and inject the adapters."""
        problems = []
        if variant not in ("lora", "ffa"):
            problems.append(f"model.variant must be 'lora' or 'ffa', got {variant!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            problems.append(f"model.rank must be an integer >= 1, got {rank!r}")
        if alpha is not None and not alpha > 0:
            problems.append(f"model.alpha must be > 0 (or null: alpha = rank), got {alpha!r}")
        if problems:
            raise ConfigError("; ".join(problems))
        network = getattr(self, self.adapted_attr)
        targets = target_modules(network, layers)  # a selection of nothing is refused there, named
        # the base as it is pretrained: the network before PEFT wraps it (kept out of the module's state); a network
        # with pretrained weights is its own base and is never pretrained: no copy
        plain = None if getattr(network, "pretrained", False) else copy.deepcopy(network)
        object.__setattr__(self, "_plain_network", plain)
        self.adapted = targets
        network.requires_grad_(False)
        inject(network, targets, rank, alpha if alpha is not None else rank, seed)
        if variant == "ffa":
            for name, p in network.named_parameters():
                if ".lora_A." in name:
                    p.requires_grad_(False)

    # ----------------------------------------------------------------------------------- base weights
    def own_weights(self) -> dict[str, torch.Tensor]:
        """The base's weights under their plain names (PEFT's ``base_layer`` removed, adapters left out)."""
        return {
            plain_name(k): v
            for k, v in self.state_dict().items()
            if k.startswith(self.weight_prefixes) and ".lora_" not in k
        }

    def load_own_weights(self, weights: dict[str, torch.Tensor]) -> None:
        real = {plain_name(k): k for k in self.state_dict() if ".lora_" not in k}
        result = self.load_state_dict({real[k]: v for k, v in weights.items()}, strict=False)
        if result.unexpected_keys:  # cannot happen for keys own_weights names; refuse rather than drop silently
            raise ConfigError(f"base weights {result.unexpected_keys[:3]} have no place in {type(self).__name__}")

    # ----------------------------------------------------------------------------------- adapters
    def adapters(self) -> dict[str, tuple[str, str, float]]:
        """Per adapted module: the state-dict names of its ``A`` and ``B`` and its scale ``alpha / r``."""
        network, prefix = getattr(self, self.adapted_attr), self.adapted_attr
        return {
            name: (
                f"{prefix}.{name}.lora_A.{ADAPTER}.weight",
                f"{prefix}.{name}.lora_B.{ADAPTER}.weight",
                float(network.get_submodule(name).scaling[ADAPTER]),
            )
            for name in self.adapted
        }

    def factor_fingerprint(self) -> str:
        """The digest of every frozen tensor (the base, the head and, for FFA-LoRA, ``A``): clients refuse to train
        when theirs differs."""
        trained = set(self.trainable_parameters())
        frozen = {k: v for k, v in self.state_dict().items() if k.startswith(self.weight_prefixes) and k not in trained}
        return f"lora:{self.hparams.variant}:r{self.hparams.rank}:{digest_tensors(frozen)}"

    @torch.no_grad()
    def averaging_identity_error(self, states: list[dict[str, torch.Tensor]]) -> float:
        """``max |mean_k(s B_k A_k) - s mean_k(B_k) mean_k(A_k)|`` over the adapted weights, in float64: the error
        of averaging LoRA's factors instead of its products (for FFA-LoRA, whose ``A`` is shared, zero but for
        float64 rounding: about 1e-18)."""
        own = self.state_dict()
        worst = 0.0
        for name_a, name_b, scale in self.adapters().values():
            a = [s.get(name_a, own[name_a]).double().flatten(1) for s in states]  # (r, in * kh * kw) each
            b = [s[name_b].double().flatten(1) for s in states]  # (out, r) each
            mean_of_products = sum(bk @ ak for ak, bk in zip(a, b, strict=True)) / len(states)
            product_of_means = (sum(b) / len(states)) @ (sum(a) / len(states))
            worst = max(worst, scale * (mean_of_products - product_of_means).abs().max().item())
        return worst


class LoRAClassifier(LoRAAdapters, Classifier):
    """LoRA or FFA-LoRA adapters (PEFT) on a frozen (pretrained) backbone and head; the adapters are the federated
    state.

    Args:
        backbone: The backbone architecture (weights come from the base).
        num_classes: Number of classes.
        head: Classifier head kind; ``orthogonal`` (frozen, as FLITE's). A ``trainable`` head trains and is
            communicated too.
        base: ``pretrained`` (the base FLITE and FedAvg start from) or ``scratch`` (the random initialisation).
        base_checkpoint: Checkpoint with the base's ``backbone.*`` and ``head.*`` weights (plain names).
        pretraining: Recipe for pretraining the base when no checkpoint is given.
        variant: ``lora`` (train ``A`` and ``B``) or ``ffa`` (FFA-LoRA: ``A`` frozen at its random start, train ``B``).
        rank: ``r`` of every adapter.
        alpha: LoRA's ``alpha``; the update is ``(alpha / r) B A`` (``null``: ``alpha = r``, a scale of 1).
        layers: Which backbone layers get adapters: ``conv``, ``linear``, ``conv+linear`` or a list of weight-name
            patterns (e.g. ``["features.*.weight"]``), as FLITE's ``layers``.
        adapter_seed: Seed of the adapters' initial values (PEFT's: ``A`` Kaiming-uniform, ``B`` zero), shared by
            every client.
        recipe: The adapters' optimiser recipe; default ``LORA_RECIPE``, FLITE's latent recipe without weight
            decay: Adam at 1e-2, constant, gradient norms clipped at 1.0.
        label_smoothing: Cross-entropy label smoothing.
    """

    adapted_attr = "backbone"

    def __init__(
        self,
        backbone: Backbone,
        num_classes: int,
        head: HeadKind = "orthogonal",
        base: Literal["pretrained", "scratch"] = "pretrained",
        base_checkpoint: str | None = None,
        pretraining: Pretraining = PAPER_PRETRAINING,
        variant: Variant = "lora",
        rank: int = 4,
        alpha: float | None = None,
        layers: LayerSelection | list[str] = "conv+linear",
        adapter_seed: int = 0,
        recipe: Recipe = LORA_RECIPE,
        label_smoothing: float = 0.0,
    ) -> None:
        source = LatentSteering.base_source(base, base_checkpoint, pretraining)
        super().__init__(
            backbone=backbone,
            num_classes=num_classes,
            head=head,
            recipe=recipe,
            label_smoothing=label_smoothing,
            **source,
        )
        self.adapt(layers, variant, rank, alpha, adapter_seed)

    def base_backbone(self) -> nn.Module:
        return self._plain_network


class LoRALanguageModel(LoRAAdapters, LanguageModel):
    """LoRA or FFA-LoRA adapters (PEFT) on a frozen (pretrained) language model, e.g. TinyGPT's projections (as
    :class:`~lightning_fl.methods.LatentLanguageModel` maps them); the adapters are the federated state.

    Args:
        network: The network architecture (weights come from the base).
        base: As for :class:`~lightning_fl.methods.LatentLanguageModel` (the same cached base).
        base_checkpoint: As for :class:`~lightning_fl.methods.LatentLanguageModel` (the same cached base).
        pretraining: As for :class:`~lightning_fl.methods.LatentLanguageModel` (the same cached base).
        variant: As for :class:`LoRAClassifier`.
        rank: As for :class:`LoRAClassifier`.
        alpha: As for :class:`LoRAClassifier`.
        adapter_seed: As for :class:`LoRAClassifier`.
        layers: Which network weights get adapters: ``linear`` (every projection; on ``HFCausalLM`` its attention and
            MLP projections, never the output head: its ``default_layers``) or a list of name patterns
            (``["*.q_proj.weight", "*.v_proj.weight"]``).
        recipe: As for :class:`LoRAClassifier` (default ``LORA_RECIPE``).
        sample_prompt: As for :class:`~lightning_fl.methods.LanguageModel`.
        sample_tokens: As for :class:`~lightning_fl.methods.LanguageModel`.
        sample_top_k: As for :class:`~lightning_fl.methods.LanguageModel`.
        sample_seed: As for :class:`~lightning_fl.methods.LanguageModel`.
    """

    adapted_attr = "network"
    trains_network = False

    def __init__(
        self,
        network: nn.Module,
        base: Literal["pretrained", "scratch"] = "pretrained",
        base_checkpoint: str | None = None,
        pretraining: Pretraining = LM_PRETRAINING,
        variant: Variant = "lora",
        rank: int = 4,
        alpha: float | None = None,
        layers: LayerSelection | list[str] = "linear",
        adapter_seed: int = 0,
        recipe: Recipe = LORA_RECIPE,
        sample_prompt: str = "To be, or not to be",
        sample_tokens: int = 200,
        sample_top_k: int | None = None,
        sample_seed: int = 0,
    ) -> None:
        source = language_base_source(network, base, base_checkpoint, pretraining)
        layers = mapped_layers(network, layers)  # recorded in hparams as resolved
        super().__init__(
            network=network,
            recipe=recipe,
            **source,
            sample_prompt=sample_prompt,
            sample_tokens=sample_tokens,
            sample_top_k=sample_top_k,
            sample_seed=sample_seed,
        )
        self.adapt(layers, variant, rank, alpha, adapter_seed)
        trained = sum(p.numel() for p in self.trainable_parameters().values())
        method = f"{'FFA-LoRA' if variant == 'ffa' else 'LoRA'} (r = {rank})"
        log_selection(method, network, [f"{t}.weight" for t in self.adapted], 4 * trained)

    def base_network(self) -> nn.Module:
        return self._plain_network

    @torch.no_grad()
    def merged_weights(self) -> dict[str, torch.Tensor]:
        """The base's weights (plain names) with each adapted one replaced by ``W0 + (alpha / r) B A``, the delta
        PEFT's own layer computes (``get_delta_weight``, which also handles GPT-2's ``in x out`` layout); float32."""
        state = {plain_name(k): v.detach().float() for k, v in self.network.state_dict().items() if ".lora_" not in k}
        for name in self.adapted:
            layer = self.network.get_submodule(name)
            state[f"{name}.weight"] = layer.base_layer.weight.float() + layer.get_delta_weight(ADAPTER).float()
        return state

    def adapter_config(self) -> dict[str, object]:
        """What PEFT's ``LoraConfig`` needs to rebuild these adapters on the network's ``hf`` model (module names
        relative to it): rank, alpha and the exact target modules."""
        prefix = "hf."
        targets = [t.removeprefix(prefix) for t in self.adapted]
        return {"r": self.hparams.rank, "lora_alpha": self.hparams.alpha or self.hparams.rank, "targets": targets}


def plain_name(key: str) -> str:
    """A state-dict key without PEFT's ``base_layer`` level."""
    return key.replace(".base_layer.", ".")


def inject(network: nn.Module, targets: list[str], rank: int, alpha: float, seed: int) -> None:
    """PEFT's LoRA adapters into ``network``'s ``targets`` (exact module names), initialised from ``seed`` only."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as err:  # an optional dependency
        raise ConfigError("LoRA methods need PEFT: pip install -e '.[lora]' (or pip install peft)") from err
    from peft.tuners.tuners_utils import cast_adapter_dtype

    exactly = "|".join(re.escape(t) for t in targets)  # a string is matched whole; a list would match suffixes too
    transposed = all(type(network.get_submodule(t)).__name__ == "Conv1D" for t in targets)  # GPT-2's layout
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=f"(?:{exactly})",
        lora_dropout=0.0,
        bias="none",
        fan_in_fan_out=transposed,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, network, adapter_name=ADAPTER)
    # a bf16 base: PEFT made the adapters bf16 too; they train in float32 (PEFT's own cast, as PeftModel does)
    cast_adapter_dtype(network, ADAPTER, autocast_adapter_dtype=True)

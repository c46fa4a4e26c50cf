"""Language models: next-token prediction with a causal network (``TinyGPT``), full-weight and FLITE latent.

:class:`LanguageModel` is the text sibling of :class:`~lightning_fl.methods.Classifier`: the same optimiser
recipe, pretrained-base cache and federated contract (:class:`~lightning_fl.methods.recipe.TrainingRecipe`),
with next-token cross-entropy as the loss and ``loss``, ``ppl`` (``exp`` of the mean token loss) and ``acc``
(next-token accuracy, LEAF's Shakespeare metric) as metrics. :class:`LatentLanguageModel` freezes the network
and steers it with FLITE's latent (``lightning_fl.mapping`` unchanged), exactly as
:class:`~lightning_fl.methods.LatentClassifier` steers a backbone.

The vocabulary (the data module's characters, id 0 for unknown ones) is stored with the model as the
``vocabulary`` buffer of Unicode code points, so checkpoints and cached bases carry it: a model refuses data
whose vocabulary differs from the one it was trained on, and decodes its generated samples with it.

A network with a ``tokenizer`` (a pretrained Hugging Face model, :class:`~lightning_fl.models.HFCausalLM`) brings
its own vocabulary instead: there is no ``vocabulary`` buffer, text is encoded and decoded with the tokenizer, and
the data must be tokenised by the same tokenizer (``data.tokenizer``; the digests must agree). A network with
``pretrained = True`` is its own base: it is never pretrained (``pretraining`` is not used, ``base`` must be
``pretrained``), so ``LanguageModel``, ``LatentLanguageModel`` and ``LoRALanguageModel`` all start from its weights.

**Instruction data** (:class:`~lightning_fl.data.FederatedInstructionDataModule`, a pretrained network): the loss,
``loss``, ``ppl`` and ``acc`` cover the responses only (the prompts' targets are ignored), and every evaluation also
generates an answer for each record from its prompt (``transformers``' ``generate``: key-value cache, greedy, stopped
at the end-of-sequence token or ``data.max_new_tokens``) and scores it: ``exact_match``, overall and per label
(``exact_match/<label>``). Generation runs with the fine-tuned weights in place (:meth:`LanguageModel.tuned`), so a
FLITE latent or LoRA adapters generate as the model a user exports.

Kept as one file: :class:`LatentLanguageModel` is :class:`LanguageModel` with
:class:`~lightning_fl.methods.latent.LatentSteering` (a constructor and four one-line overrides) and shares its
vocabulary contract; in a file of its own it would be that glue alone, read only beside this one.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn
from torch.func import functional_call

from lightning_fl.checkpoint import digest_tensors
from lightning_fl.errors import ConfigError
from lightning_fl.mapping.lowrank import FactorMode, LayerSelection, select_weights
from lightning_fl.methods.latent import LATENT_RECIPE, LatentSteering
from lightning_fl.methods.pretraining import Pretraining
from lightning_fl.methods.recipe import TrainingRecipe
from lightning_fl.methods.schedules import Recipe
from lightning_fl.metrics import IGNORE_INDEX, ExactMatch, NextTokenMetrics
from lightning_fl.models.gpt import generate
from lightning_fl.models.hf import hf_generate, tied_weights

log = logging.getLogger(__name__)

#: The recipe that pretrains a language-model base when no checkpoint is given: AdamW with a half-epoch warm-up,
#: then cosine decay, and 10 epochs over the central split. Pretraining always clips gradient norms at 1.0.
LM_PRETRAINING = Pretraining(epochs=10, optimizer="adamw", lr=3e-3, weight_decay=0.01, warmup_epochs=0.5)
#: How a :class:`LanguageModel` trains by default: AdamW, no warm-up, cosine decay, gradient norms clipped at 1.0.
LM_RECIPE = Recipe(optimizer="adamw", lr=1e-3, weight_decay=0.01, warmup_epochs=0.0, schedule="cosine", grad_clip=1.0)


class LanguageModel(TrainingRecipe):
    """A causal language model trained with next-token cross-entropy.

    Args:
        network: Token ids ``(B, T)`` to logits ``(B, T, vocab_size)``, with ``vocab_size`` and ``context``
            attributes (``lightning_fl.models.TinyGPT``). ``vocab_size`` must equal the data's vocabulary. A
            network with a ``tokenizer`` (``HFCausalLM``, ``SmolLM2``) needs data tokenised by it; one with
            ``pretrained = True`` is its own base (``pretraining`` is not used).
        recipe: The optimiser recipe (:class:`~lightning_fl.methods.schedules.Recipe`); default ``LM_RECIPE``:
            AdamW at 1e-3, weight decay 0.01, no warm-up, cosine, gradient norms clipped at 1.0.
        init_from: Checkpoint whose ``network.*`` weights and vocabulary to start from (e.g. the ``last.ckpt``
            of ``configs/pretrain_shakespeare.yaml``).
        pretraining: Without ``init_from``: pretrain the network on the data module's central split
            (``train_dataloader``: the held-out plays) with this recipe (cosine schedule, gradients clipped
            at 1.0) and cache it, so every run with the same architecture, seed, data and recipe starts from
            the same base (FLITE and full-weight FedAvg share it). ``null``: random initialisation.
        sample_prompt: Prompt of the text sample logged to TensorBoard (under ``Text``) before and after training.
        sample_tokens: Tokens (characters, or the tokenizer's tokens) generated for the sample (0: no sample).
        sample_top_k: Sample among the ``top_k`` most likely tokens (temperature 1, seeded by ``sample_seed``);
            ``null``: greedy decoding.
        sample_seed: Seed of the sampled text, so samples before and after training are comparable.
    """

    weight_prefixes = ("network.", "vocabulary")
    weights_hint = "model.network (vocab_size, n_layer, n_embd, n_head, context)"
    #: Whether the network's own weights train (full fine-tuning); FLITE and LoRA freeze them.
    trains_network = True

    def __init__(
        self,
        network: nn.Module,
        recipe: Recipe = LM_RECIPE,
        init_from: str | None = None,
        pretraining: Pretraining | None = None,
        sample_prompt: str = "To be, or not to be",
        sample_tokens: int = 200,
        sample_top_k: int | None = None,
        sample_seed: int = 0,
    ) -> None:
        super().__init__()
        problems = []
        if not isinstance(network, nn.Module) or not all(hasattr(network, a) for a in ("vocab_size", "context")):
            problems.append("model.network must be a causal language model with vocab_size and context (TinyGPT)")
        if sample_tokens < 0 or not sample_prompt:
            problems.append("model.sample_tokens must be >= 0 and model.sample_prompt non-empty")
        if sample_top_k is not None and sample_top_k < 1:
            problems.append(f"model.sample_top_k must be >= 1 or null, got {sample_top_k}")
        if self.trains_network and str(getattr(network, "dtype", "float32")).removeprefix("torch.") != "float32":
            problems.append(
                f"model.network.dtype={network.dtype} keeps a frozen base in low precision, but "
                f"{type(self).__name__} trains every weight (in float32, as its optimiser state): set "
                "model.network.dtype float32, or fine-tune with LatentLanguageModel or LoRALanguageModel"
            )
        if problems:
            raise ConfigError("; ".join(problems))
        self.save_hyperparameters(ignore=self._hparams_ignore())
        self.use_recipe(recipe)
        self.network = network
        self.vocab_size = int(network.vocab_size)
        if self.tokenizer is None:  # Unicode code points of the vocabulary (-1: not yet known); saved with the weights
            self.register_buffer("vocabulary", torch.full((self.vocab_size,), -1, dtype=torch.int32))
        self.val_metrics = NextTokenMetrics("val/")
        self.test_metrics = NextTokenMetrics("test/")
        if getattr(network, "pretrained", False):  # its own weights are the base: nothing to pretrain or key
            pretraining = None
        self.pretraining = pretraining
        self._init_digest = digest_tensors(self.network.state_dict()) if pretraining is not None else ""
        self._base_ready = pretraining is None
        if init_from is not None:
            self.load_weights(init_from, self.init_from_key)
            self._base_ready = True

    def _hparams_ignore(self) -> list[str]:
        return ["network", "pretraining", "recipe"]

    # ----------------------------------------------------------------------------------- vocabulary
    @property
    def tokenizer(self):
        """The network's tokenizer (``HFCausalLM``), or ``None`` for a character model (the ``vocabulary`` buffer)."""
        return getattr(self.network, "tokenizer", None)

    @property
    def characters(self) -> list[str] | None:
        """The vocabulary as characters (id ``i`` is ``characters[i]``), or ``None`` before it is known (or with a
        tokenizer)."""
        if self.tokenizer is not None:
            return None
        codes = self.vocabulary.tolist()
        return None if min(codes) < 0 else [chr(c) for c in codes]

    def check_data(self, datamodule: object) -> None:
        """Refuse data whose vocabulary or window length does not fit; adopt the data's vocabulary if unset."""
        if self.tokenizer is not None:
            self._check_tokenised_data(datamodule)
            return
        vocabulary = getattr(datamodule, "vocabulary", None) or None  # known once the data is set up
        problems = []
        if getattr(datamodule, "tokenizer", None) is not None:
            problems.append(
                f"data.tokenizer={datamodule.tokenizer!r} but model.network ({type(self.network).__name__}) reads "
                "characters: set data.tokenizer null, or use the network that tokenizer belongs to (HFCausalLM)"
            )
        if vocabulary is not None and len(vocabulary) != self.vocab_size:
            problems.append(
                f"model.network.vocab_size={self.vocab_size} but the data's vocabulary has {len(vocabulary)} "
                f"characters: set --model.network.vocab_size {len(vocabulary)}"
            )
        context = getattr(datamodule, "context", None)
        if context is not None and context > self.network.context:
            problems.append(
                f"data.context={context} is longer than model.network.context={self.network.context}: "
                "shorten the windows or widen the network"
            )
        if not problems and vocabulary is not None:
            mine = self.characters
            if mine is None:
                self.vocabulary.copy_(torch.tensor([ord(c) for c in vocabulary], dtype=torch.int32))
            elif mine != list(vocabulary):
                differ = next(i for i, (a, b) in enumerate(zip(mine, vocabulary, strict=True)) if a != b)
                problems.append(
                    f"the model's vocabulary (from its checkpoint or base) differs from the data's at id {differ} "
                    f"({mine[differ]!r} vs {vocabulary[differ]!r}): use the data settings (data.source, "
                    "data.pretrain_plays, data.seed, fractions) the model was trained with"
                )
        if problems:
            raise ConfigError("; ".join(problems))

    def _check_tokenised_data(self, datamodule: object) -> None:
        """The data must be tokenised by the network's tokenizer (same digest), within its vocabulary and context.
        Instruction data (its ``max_new_tokens``) also sets up the scoring by generation, per label."""
        spec, digest = getattr(datamodule, "tokenizer", None), getattr(datamodule, "tokenizer_digest", None)
        mine, source = self.network.tokenizer_digest, getattr(self.network, "source", type(self.network).__name__)
        problems = []
        if spec is None:
            problems.append(
                f"model.network ({source}) reads tokens of its own tokenizer but data.tokenizer is null "
                "(characters): set data.tokenizer to the network's model (e.g. SmolLM2, or its path)"
            )
        elif digest is not None and digest != mine:
            problems.append(
                f"data.tokenizer={spec!r} is not model.network's tokenizer ({source}; digests "
                f"{digest[:12]} vs {mine[:12]}): set data.tokenizer to the network's model or path"
            )
        size = getattr(datamodule, "vocab_size", 0) or 0
        if size > self.vocab_size:
            problems.append(
                f"the data's tokenizer has {size} tokens but model.network has {self.vocab_size} "
                "logits: use the tokenizer saved with the model"
            )
        context = getattr(datamodule, "context", None)
        if context is not None and context > self.network.context:
            problems.append(
                f"data.context={context} is longer than model.network.context={self.network.context}: "
                "shorten the windows or widen the network's context"
            )
        if problems:
            raise ConfigError("; ".join(problems))
        max_new_tokens = getattr(datamodule, "max_new_tokens", None)
        if max_new_tokens is not None:  # instruction data: each evaluation generates and scores answers
            labels = [label for label in getattr(datamodule, "labels", []) if label]
            scores = {stage: ExactMatch(f"{stage}/", labels) for stage in ("val", "test")}
            self.__dict__["_scoring"] = (int(max_new_tokens), scores)  # not submodules: no state, no device

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of ``text``: the network's tokenizer (no special tokens), else the stored vocabulary (one id per
        character, unknown characters: id 0)."""
        if self.tokenizer is not None:
            return torch.tensor(self.tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)
        index = {c: i for i, c in enumerate(self.characters or [])}
        return torch.tensor([index.get(c, 0) for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids.tolist())
        chars = self.characters
        if chars is None:
            raise ValueError("the model has no vocabulary yet: train it on data or load a checkpoint first")
        return "".join(chars[i] for i in ids.tolist())

    # ----------------------------------------------------------------------------------- forward
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.network(idx)  # (B, T, V)

    def logits_function(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The function from ids to logits that generation calls repeatedly (weights prepared once)."""
        return self.network

    @contextlib.contextmanager
    def tuned(self) -> Iterator[None]:
        """Within the block, ``self.network`` computes as the fine-tuned model (its own weights here; FLITE puts its
        mapped weights in place): what generation uses."""
        yield

    @torch.no_grad()
    def merged_weights(self) -> dict[str, torch.Tensor]:
        """The fine-tuned network's weights by its own parameter names (``hf.model...`` on an ``HFCausalLM``; a tied
        weight under each of its names), in float32: here the network's weights as they are; FLITE's latent and LoRA's
        adapters are merged into the weights they adapt (:mod:`lightning_fl.methods.export` writes them out)."""
        return {k: v.detach().float() for k, v in self.network.state_dict().items()}

    @torch.no_grad()
    def generate_ids(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int) -> list[list[int]]:
        """Greedy answers to left-padded prompts ``(B, P)`` (``prompt_mask`` 1 on real tokens): per prompt the new
        tokens, up to and without the first end-of-sequence token (``transformers``' ``generate``, with its key-value
        cache, at most ``max_new_tokens``)."""
        was_training = self.training
        self.eval()
        try:
            with self.tuned():
                return hf_generate(self.network, prompt_ids, prompt_mask, max_new_tokens)
        finally:
            self.train(was_training)

    @torch.no_grad()
    def generate_text(
        self, prompt: str, max_new_tokens: int, top_k: int | None = None, seed: int = 0, chat: bool = False
    ) -> str:
        """``prompt`` continued by at most ``max_new_tokens`` tokens (characters, or the tokenizer's): greedy, or top-k
        sampling seeded by ``seed``; the prompt and its continuation. With a tokenizer (a pretrained network)
        generation runs through ``transformers``' ``generate`` (key-value cache, the whole prompt, stopped at an
        end-of-sequence token). ``chat`` sends ``prompt`` as a user's message through the tokenizer's chat template
        (Alpaca's layout when it has none, :data:`~lightning_fl.data.chat.PLAIN_TEMPLATE`) and returns the answer
        alone."""
        if self.tokenizer is not None:
            return self._generate_hf_text(prompt, max_new_tokens, top_k, seed, chat)
        if chat:
            raise ConfigError("chat generation needs a tokenizer: a pretrained network (HFCausalLM, SmolLM2)")
        was_training = self.training
        self.eval()
        try:
            idx = self.encode(prompt)[None].to(self.vocabulary.device)
            generator = torch.Generator(device=idx.device).manual_seed(seed) if top_k is not None else None
            temperature = 0.0 if top_k is None else 1.0
            out = generate(
                self.logits_function(), idx, max_new_tokens, self.network.context, temperature, top_k, generator
            )
        finally:
            self.train(was_training)
        return self.decode(out[0])

    def _generate_hf_text(self, prompt: str, max_new_tokens: int, top_k: int | None, seed: int, chat: bool) -> str:
        from lightning_fl.data.chat import PLAIN_TEMPLATE

        tokenizer = self.tokenizer
        if chat:
            template = getattr(tokenizer, "chat_template", None) or PLAIN_TEMPLATE
            message = [{"role": "user", "content": prompt}]
            prompt = tokenizer.apply_chat_template(
                message, chat_template=template, tokenize=False, add_generation_prompt=True
            )
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)], dtype=torch.long)
        device = next(self.network.parameters()).device
        was_training = self.training
        self.eval()
        try:
            with self.tuned(), torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
                torch.manual_seed(seed)
                new = hf_generate(self.network, ids.to(device), torch.ones_like(ids).to(device), max_new_tokens, top_k)
        finally:
            self.train(was_training)
        answer = tokenizer.decode(new[0], skip_special_tokens=True)
        return answer if chat else tokenizer.decode(ids[0].tolist() + new[0])

    def text_samples(self) -> dict[str, str]:
        """Markdown samples for TensorBoard's Text tab: ``{tag: text}`` (empty without a vocabulary)."""
        hp = self.hparams
        if hp.sample_tokens == 0 or (self.characters is None and self.tokenizer is None):
            return {}
        text = self.generate_text(hp.sample_prompt, hp.sample_tokens, hp.sample_top_k, hp.sample_seed)
        how = "greedy" if hp.sample_top_k is None else f"top-{hp.sample_top_k}, seed {hp.sample_seed}"
        body = "\n".join(f"    {line}" for line in text.split("\n"))  # indented: shown verbatim
        unit = "characters" if self.tokenizer is None else "tokens"
        return {"samples/generated": f"{hp.sample_tokens} {unit}, {how}:\n\n{body}"}

    def _log_samples(self) -> None:
        experiment = getattr(self.logger, "experiment", None) if self._trainer is not None else None
        if experiment is not None and hasattr(experiment, "add_text") and self.trainer.is_global_zero:
            for tag, text in self.text_samples().items():
                experiment.add_text(tag, text, self.global_step)

    def on_train_start(self) -> None:
        self._log_samples()

    def on_train_end(self) -> None:
        self._log_samples()

    # ----------------------------------------------------------------------------------- base
    def base_cache_key(self, datamodule: object) -> dict[str, object]:
        key = self.shared_base_key(datamodule) | {
            "network": f"{type(self.network).__module__}.{type(self.network).__qualname__}",
            "vocabulary": "".join(self.characters or []),
        }
        return key if self.tokenizer is None else key | {"tokenizer": self.network.tokenizer_digest}

    def prepare_base(self, datamodule: object, allow_training: bool = True) -> None:
        if not self._base_ready:  # the base is trained on, and keyed by, the data's vocabulary
            if getattr(datamodule, "vocabulary", None) == [] and callable(getattr(datamodule, "setup", None)):
                datamodule.setup("fit")
            self.check_data(datamodule)
        super().prepare_base(datamodule, allow_training)

    def base_network(self) -> nn.Module:
        """The network as a base is trained (here the network itself; a method that wraps it says otherwise)."""
        return self.network

    def pretraining_module(self) -> LanguageModel:
        """A language model with a trainable copy of this network that trains with the pretraining recipe."""
        p = self.pretraining
        pre = LanguageModel(
            network=copy.deepcopy(self.base_network()).requires_grad_(True),
            recipe=p.recipe(grad_clip=1.0),
            sample_tokens=0,
        )
        if self.tokenizer is None:
            pre.vocabulary.copy_(self.vocabulary)
        return pre

    # ----------------------------------------------------------------------------------- steps
    def compute_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over every position, in float32 (logits ``(B, T, V)``, y ``(B, T)``)."""
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def _eval_step(self, batch: tuple[torch.Tensor, torch.Tensor] | dict[str, Any], stage: str) -> None:
        if isinstance(batch, dict):  # instruction data: the response's tokens, then a generated answer per record
            self._score_instructions(batch, stage)
            return
        x, y = batch
        (self.val_metrics if stage == "val" else self.test_metrics).update(self(x), y)

    def _score_instructions(self, batch: dict[str, Any], stage: str) -> None:
        logits, targets = self._response_logits(batch["input_ids"], batch["targets"])
        (self.val_metrics if stage == "val" else self.test_metrics).update(logits, targets)
        scoring = self.__dict__.get("_scoring")
        if scoring is None:
            raise ConfigError(
                "instruction batches but the model was not set up with their data module (check_data was not called)"
            )
        max_new_tokens, scores = scoring
        new = self.generate_ids(batch["prompt_ids"], batch["prompt_mask"], max_new_tokens)
        answers = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in new]
        scores[stage].update(answers, batch["references"], batch["labels"])

    def _response_logits(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits at the positions where some record of the batch has a response target, and those targets: the
        output head (49,152 x 576 on SmolLM2) runs on a response's positions only, not on its prompt's
        (``transformers``' ``logits_to_keep``); the ignored targets in between leave the metrics unchanged."""
        positions = (y != IGNORE_INDEX).any(0).nonzero().squeeze(1)
        hf = getattr(self.network, "hf", None)
        if hf is None or len(positions) == 0:
            return self(x), y
        with self.tuned():
            logits = hf(input_ids=x, use_cache=False, logits_to_keep=positions).logits  # (B, K, V)
        return logits, y[:, positions]

    def _eval_epoch_end(self, stage: str) -> None:
        scoring = self.__dict__.get("_scoring")
        score = scoring[1][stage] if scoring is not None else None
        if score is not None and int(score.total[-1]) > 0:
            values = score.compute()
            score.reset()
            self.log_dict(values, sync_dist=True)
        super()._eval_epoch_end(stage)


class LatentLanguageModel(LatentSteering, LanguageModel):
    """FLITE on a language model: a frozen (pretrained) network steered by per-layer latents.

    Only the latent trains and only the latent is sent. With ``layers: linear`` on ``TinyGPT`` the map covers
    the ``6 n_layer`` projection matrices (36 for the FLITE paper's size), so an upload is ``4 x 6 n_layer x d`` bytes
    in float32 (147,456 at ``d = 1024``); embeddings, LayerNorms and biases stay at the base.

    Args:
        network: The network architecture (weights come from the base).
        base: ``pretrained`` (delta mode on a pretrained base) or ``scratch`` (the random initialisation).
        base_checkpoint: Checkpoint with the base's ``network.*`` weights and vocabulary (e.g. the ``last.ckpt``
            of ``configs/pretrain_shakespeare.yaml``). ``null``: pretrain per ``pretraining`` and cache.
        pretraining: Recipe for pretraining the base when no checkpoint is given.
        latent_dim: ``d`` per mapped layer: one value, or one per layer (the FLITE paper's TinyGPT: 1024).
        rank: ``r`` of the factors.
        layers: Which network weights are mapped: ``linear`` (every projection; on ``HFCausalLM``, its
            ``default_layers``: the attention and MLP projections, never the output head), or a list of name
            patterns (e.g. ``["*.q_proj.weight", "*.v_proj.weight"]``). A weight tied to another is refused.
        factors: ``stored``, ``regenerate``, ``streamed``, ``dense``, ``kronecker`` or ``two_sided`` (linear
            weights only, ``nn.Linear`` or GPT-2's ``Conv1D``: the family for large models; see
            :mod:`lightning_fl.mapping.lowrank`).
        factor_seed: The 64-bit seed of the factors, shared by every client.
        max_dense_bytes: Largest dense projection ``factors: dense`` may allocate.
        recipe: The latent's optimiser recipe; default ``LATENT_RECIPE``, the paper's: Adam at 1e-2, weight decay
            1e-4, constant, gradient norms clipped at 1.0.
        subspace: ``random`` (the seeded two-sided parts) or ``public``: the top singular vectors of a statistic of
            public records (:mod:`lightning_fl.methods.subspace`; two-sided factors only), computed once at set-up.
        public_records: Public records the ``public`` statistic is computed over.
        latent_init: ``zero`` (the model starts exactly at the base) or ``svd`` (Fed-SB's, with ``subspace:
            public`` and ``rank`` equal to ``latent_dim``: each grid starts at the statistic's singular values on its
            diagonal, so the model starts one approximate full-fine-tuning step from the base).
        sample_prompt: See :class:`LanguageModel`.
        sample_tokens: See :class:`LanguageModel`.
        sample_top_k: See :class:`LanguageModel`.
        sample_seed: See :class:`LanguageModel`.
    """

    def __init__(
        self,
        network: nn.Module,
        base: Literal["pretrained", "scratch"] = "pretrained",
        base_checkpoint: str | None = None,
        pretraining: Pretraining = LM_PRETRAINING,
        latent_dim: int | list[int] = 1024,
        rank: int = 32,
        layers: LayerSelection | list[str] = "linear",
        factors: FactorMode = "stored",
        factor_seed: int = 0,
        max_dense_bytes: int = 2**31,
        recipe: Recipe = LATENT_RECIPE,
        subspace: Literal["random", "public"] = "random",
        public_records: int = 64,
        latent_init: Literal["zero", "svd"] = "zero",
        sample_prompt: str = "To be, or not to be",
        sample_tokens: int = 200,
        sample_top_k: int | None = None,
        sample_seed: int = 0,
    ) -> None:
        problems = []
        if subspace not in ("random", "public") or latent_init not in ("zero", "svd"):
            problems.append(
                f"model.subspace must be random or public and model.latent_init zero or svd, got "
                f"{subspace!r} and {latent_init!r}"
            )
        if subspace == "public" and factors != "two_sided":
            problems.append(
                f"model.subspace public chooses two-sided parts: set model.factors two_sided, not {factors!r}"
            )
        if latent_init == "svd" and (subspace != "public" or latent_dim != rank):
            problems.append(
                "model.latent_init svd starts the grid at the public statistic's singular values: it needs "
                "model.subspace public and model.rank equal to model.latent_dim (V the identity)"
            )
        if not isinstance(public_records, int) or public_records < 1:
            problems.append(f"model.public_records must be an integer >= 1, got {public_records!r}")
        if problems:
            raise ConfigError("; ".join(problems))
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
        self.steer(latent_dim, rank, layers, factors, factor_seed, max_dense_bytes)
        log_selection(self.method_name(), network, self.mapping.names, 4 * self.mapping.latent_size)

    def method_name(self) -> str:
        """What the selection line calls this method."""
        subspace = ", a subspace of public data" if self.hparams.subspace == "public" else ""
        return f"FLITE ({self.hparams.factors} factors{subspace})"

    def prepare_base(self, datamodule: object, allow_training: bool = True) -> None:
        """The base, then (``subspace: public``) the two-sided parts from public records, once."""
        super().prepare_base(datamodule, allow_training)
        if self.hparams.subspace != "public" or self.mapping.subspace != "random":
            return
        from lightning_fl.methods.subspace import public_batches, use_public_subspace

        batches = public_batches(datamodule, self.hparams.public_records)
        device = self.mapping.latent.device
        batches = [tuple(t.to(device) for t in batch) for batch in batches]
        values = use_public_subspace(
            self.mapping, self.network, self.network, self.compute_loss, batches, self.recipe.lr
        )
        if self.hparams.latent_init == "svd":
            with torch.no_grad():
                for lay, z_l in zip(self.mapping.layers, self.mapping.split(self.mapping.latent), strict=True):
                    factor = self.mapping._two_sided[lay.index]
                    grid = torch.zeros(factor.p, factor.q)
                    k = min(factor.p, factor.q)
                    grid[range(k), range(k)] = values[lay.name][:k]
                    z_l.copy_(grid.reshape(-1))

    trains_network = False

    @property
    def steered(self) -> nn.Module:
        return self.network

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.steered_forward(idx)  # (B, T, V) from the mapped network

    def logits_function(self) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.mapping.mode == "two_sided":  # the deltas ride on the layers' outputs: nothing to prepare
            return self.steered_forward
        weights = self.mapping.weights(self.mapped_base())  # computed once for the whole generation
        return lambda idx: functional_call(self.network, weights, (idx,), strict=False)

    @torch.no_grad()
    def merged_weights(self) -> dict[str, torch.Tensor]:
        """The network's weights with every mapped weight replaced by ``theta_pre + U V^T z`` (float32)."""
        state = super().merged_weights()
        mapped = self.mapping.weights({k: v.float() for k, v in self.mapped_base().items()})
        return state | {name: w.detach().float() for name, w in mapped.items()}

    @contextlib.contextmanager
    def tuned(self) -> Iterator[None]:
        """Within the block the network computes with ``theta_pre + U V^T z``: the two-sided family's hooks, or every
        other family's mapped weights put in place of the base's (formed once, put back after the block)."""
        if self.mapping.mode == "two_sided":  # (hooks for the block, or those attached for gradient checkpointing)
            with self.mapping.applied(self.network):
                yield
            return
        with torch.no_grad():
            mapped = self.mapping.weights(self.mapped_base())
        with weights_in_place(self.network, mapped):
            yield

    def factor_fingerprint(self) -> str:
        """Fingerprint of the factors and of the base (with its vocabulary); clients refuse to train on another."""
        return f"factors:{self.mapping.fingerprint()} base:{digest_tensors(self.own_weights())}"


def language_base_source(network: nn.Module, base: str, base_checkpoint: str | None, pretraining: Pretraining) -> dict:
    """:meth:`LatentSteering.base_source` for a language model: a network with pretrained weights is its own base, so
    ``model.base`` must be ``pretrained`` (``scratch`` would have to throw its weights away)."""
    if getattr(network, "pretrained", False) and base == "scratch":
        raise ConfigError(
            f"model.base is 'scratch' but model.network ({type(network).__name__}) carries pretrained weights, which "
            "are the base: set model.base pretrained (no pretraining runs), or use an untrained network (TinyGPT)"
        )
    return LatentSteering.base_source(base, base_checkpoint, pretraining)


def mapped_layers(network: nn.Module, layers: LayerSelection | list[str]) -> LayerSelection | list[str]:
    """``layers`` as the latent map or the adapters get them: ``linear`` on a network with ``default_layers``
    (``HFCausalLM``) is that list; a selection that includes a weight tied to another (a tied LM head) is refused,
    since the tie would make the two one mapped tensor."""
    if layers == "linear" and callable(getattr(network, "default_layers", None)):
        layers = network.default_layers()
        if not layers:
            raise ConfigError(
                f"model.layers='linear' selects no projection of {type(network).__name__} (no nn.Linear or Conv1D "
                "but its output head): give name patterns of its weights, e.g. model.layers ['*.c_attn.weight']"
            )
    tied = tied_weights(network)
    if chosen := [n for n in select_weights(network, layers) if n in tied]:
        raise ConfigError(
            f"model.layers={layers!r} selects {chosen[0]}, which is tied to {tied[chosen[0]][0]} (one tensor): "
            "leave it out, e.g. model.layers ['*.q_proj.weight', '*.v_proj.weight']"
        )
    return layers


@contextlib.contextmanager
def weights_in_place(module: nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """Within the block, each named parameter of ``module`` holds the tensor ``weights`` gives it (same shape); the
    parameters' own tensors are put back after it, whatever happens inside."""
    params = {name: module.get_parameter(name) for name in weights}
    kept = {name: p.data for name, p in params.items()}
    try:
        for name, p in params.items():
            p.data = weights[name].to(p.dtype)
        yield
    finally:
        for name, p in params.items():
            p.data = kept[name]


def log_selection(method: str, network: nn.Module, names: list[str], upload_bytes: int) -> None:
    """Say once which weights ``method`` adapts (how many, by their last name, and their size) and what a client
    uploads: ``layers: linear`` on a model a user brings then shows what it selected."""
    kinds: dict[str, int] = {}
    for name in names:
        kind = name.removesuffix(".weight").rsplit(".", 1)[-1]
        kinds[kind] = kinds.get(kind, 0) + 1
    owners = (network.get_submodule(n.rpartition(".")[0]) for n in names)
    weights = sum(getattr(m, "base_layer", m).weight.numel() for m in owners)  # (PEFT wraps what it adapts)
    log.info(
        "%s adapts %d weight matrices (%s; %s weights of %s), uploading %s bytes a round",
        method,
        len(names),
        ", ".join(f"{k} x{v}" for k, v in kinds.items()),
        f"{weights:,}",
        f"{sum(p.numel() for p in network.parameters()):,}",
        f"{upload_bytes:,}",
    )

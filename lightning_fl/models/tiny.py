"""Tiny random causal language models of the architectures users bring, saved as a pretrained model is saved: what
the tests and the benchmarks' ``--tiny`` runs load in place of SmolLM2 (as timm's tiny variants stand in for its big
models), through the same loading path (:class:`~lightning_fl.models.HFCausalLM`).

:func:`save_tiny_chat_model` writes a random 2-layer model (Llama, Qwen2 with an untied head, GPT-NeoX, Phi-3,
GPT-2's ``Conv1D``) and a byte-level BPE tokenizer trained on a given text, with ChatML's special tokens and
template: an instruction-tuned model in miniature. It needs the ``llm`` extra (``transformers``, ``tokenizers``).
"""

from __future__ import annotations

from pathlib import Path

#: ChatML, as SmolLM2 and Qwen2 write it (without SmolLM2's default system message).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: The architectures users bring, as tiny random models: (transformers' config class, its arguments, tied head).
TINY_ARCHITECTURES = {
    "llama": (
        "LlamaConfig",
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
        },
        True,
    ),
    "qwen2": (
        "Qwen2Config",
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
        },
        False,
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "max_position_embeddings": 128},
        False,
    ),
    "phi3": (
        "Phi3Config",
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            "pad_token_id": 0,
        },
        False,
    ),
    "gpt2": ("GPT2Config", {"n_embd": 32, "n_head": 4, "n_positions": 128}, True),
}


def save_tiny_chat_model(
    folder: str | Path,
    text: str,
    architecture: str = "llama",
    vocab_size: int = 400,
    seed: int = 0,
    chat_template: bool = True,
) -> Path:
    """A random 2-layer model of ``architecture`` (:data:`TINY_ARCHITECTURES`) and a byte-level BPE tokenizer trained on
    ``text`` with ChatML's special tokens (``<|im_end|>`` ends a turn and the sequence, ``<|endoftext|>`` pads) and,
    with ``chat_template``, ChatML's template: what an instruction-tuned model a user brings looks like."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(
        [text], trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, special_tokens=specials)
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    if chat_template:
        tokenizer.chat_template = CHATML
    name, kwargs, tied = TINY_ARCHITECTURES[architecture]
    layers = {"n_layer": 2} if architecture == "gpt2" else {"num_hidden_layers": 2}
    config = getattr(transformers, name)(
        vocab_size=len(tokenizer),
        tie_word_embeddings=tied,
        **layers,
        **kwargs,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def task_text() -> str:
    """Text to train a tiny tokenizer on: the built-in instruction task's questions and answers (no plays, so no
    download)."""
    from lightning_fl.data import InstructionTasks

    records = InstructionTasks(tasks=["arithmetic", "units", "dates", "compare"], train_per_task=50).splits()
    return "\n".join(m["content"] for split in records.values() for r in split for m in r.messages) + "\n### Response:"

"""Records through a tokenizer's chat template, with the loss on the response only (prompt masking).

A record's **prompt** is its messages before the response, rendered with ``add_generation_prompt=True`` (what the
model is given at generation time, ending where the assistant's turn starts); its **completion** is what the full
conversation's rendering adds after that prompt: the response and the template's end of turn. Both are tokenised
apart (without the tokenizer's own special tokens: the template writes them), so training sees exactly the prompt
tokens generation is given. The completion is cut after its first end-of-sequence token (``eos_token``; appended
when the template writes none), so the model learns to stop and nothing after the stop is trained.

A training example is ``x = ids[:-1]``, ``y = ids[1:]`` of ``prompt + completion`` with every target inside the
prompt set to :data:`~lightning_fl.metrics.IGNORE_INDEX`: the loss, the perplexity and the token accuracy cover the
completion alone. An example longer than ``context + 1`` tokens is cut at its end (its completion truncated); one
whose prompt alone fills the context keeps no completion token and is left out. Both are counted
(:class:`TokenStats`) and the data module reports the counts.

Batches are padded to their longest example, not to the context: training batches on the right (a causal model's
real tokens never attend to the padding after them, so no attention mask is needed and the padded targets are
ignored), generation prompts on the left with an attention mask (every prompt then ends where generation starts).

A tokenizer without a chat template gets :data:`PLAIN_TEMPLATE` (Alpaca's ``### Instruction`` / ``### Response``
layout, the turn ended by ``eos_token``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_fl.data.instructions import InstructionRecord
from lightning_fl.errors import ConfigError
from lightning_fl.metrics import IGNORE_INDEX

#: The template of a tokenizer that has none: Alpaca's layout, each response ended by the end-of-sequence token.
PLAIN_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}### Instruction:\n{{ message['content'] }}\n\n### Response:\n"
    "{% else %}{{ message['content'] }}{{ eos_token }}\n\n{% endif %}"
    "{% endfor %}"
)


@dataclass
class TokenStats:
    """What tokenising one split did: records in, records whose completion was cut at the context, records left out
    (their prompt alone fills the context), and the tokens of their prompts and completions (before any cut)."""

    records: int = 0
    truncated: int = 0
    dropped: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def line(self, split: str) -> str:
        text = f"{split}: {self.records:,} records, {self.prompt_tokens + self.completion_tokens:,} tokens"
        notes = [f"{self.truncated:,} with their response cut at the context"] * bool(self.truncated)
        notes += [f"{self.dropped:,} left out: the prompt alone fills the context"] * bool(self.dropped)
        return text + (f" ({'; '.join(notes)})" if notes else "")


@dataclass
class Example:
    """One tokenised record: ``x``, ``y`` (targets, the prompt's ignored) and, for evaluation, the generation prompt,
    the reference answer and the label."""

    x: torch.Tensor
    y: torch.Tensor
    prompt: torch.Tensor
    reference: str
    label: str = ""
    record: int = field(default=-1, repr=False)  # its index among the split's records


class ChatFormat:
    """A tokenizer and its chat template (or :data:`PLAIN_TEMPLATE`), turning records into :class:`Example` s.

    Args:
        tokenizer: A Hugging Face tokenizer.
        context: Longest example in tokens (``len(x)``, prompt and completion).
        chat_template: A Jinja chat template to use instead of the tokenizer's (``None``: the tokenizer's, or
            :data:`PLAIN_TEMPLATE` when it has none).
    """

    def __init__(self, tokenizer: Any, context: int, chat_template: str | None = None) -> None:
        self.tokenizer, self.context = tokenizer, context
        self.template = chat_template or getattr(tokenizer, "chat_template", None) or PLAIN_TEMPLATE
        self.plain = self.template == PLAIN_TEMPLATE
        self.eos_id = tokenizer.eos_token_id
        if self.eos_id is None:
            raise ConfigError(
                "data.tokenizer has no end-of-sequence token (eos_token), so a generated answer could never stop: "
                "use a tokenizer that defines one (save it with tokenizer.eos_token set)"
            )
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.eos_id)

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
        )

    def prompt_text(self, record: InstructionRecord) -> str:
        """What the model is given at generation time for ``record``."""
        return self.render(record.prompt, generation_prompt=True)

    def split_texts(self, record: InstructionRecord) -> tuple[str, str]:
        """``(prompt, completion)`` texts of ``record`` (module docstring)."""
        prompt, full = self.prompt_text(record), self.render(list(record.messages), generation_prompt=False)
        if not full.startswith(prompt):
            raise ConfigError(
                "data.chat_template: the rendered conversation does not start with its rendered prompt (with "
                "add_generation_prompt), so the response cannot be told from the prompt; give a template whose "
                "generation prompt is how the assistant's turn starts"
            )
        return prompt, full[len(prompt) :]

    def examples(self, records: list[InstructionRecord]) -> tuple[list[Example], TokenStats]:
        """Every record as an :class:`Example` (those with no completion token left out), and what was cut."""
        stats = TokenStats(records=len(records))
        if not records:
            return [], stats
        texts = [self.split_texts(r) for r in records]
        encode = self.tokenizer  # one batched call per part: the fast tokenizer's threads
        prompts = encode([p for p, _ in texts], add_special_tokens=False)["input_ids"]
        completions = encode([c for _, c in texts], add_special_tokens=False)["input_ids"]
        out = []
        for i, (record, prompt, completion) in enumerate(zip(records, prompts, completions, strict=True)):
            completion = self._ended(completion)
            stats.prompt_tokens += len(prompt)
            stats.completion_tokens += len(completion)
            ids = prompt + completion
            if len(prompt) >= self.context + 1:
                stats.dropped += 1
                continue
            if len(ids) > self.context + 1:
                stats.truncated += 1
                ids = ids[: self.context + 1]
            tokens = torch.tensor(ids, dtype=torch.long)
            y = tokens[1:].clone()
            y[: len(prompt) - 1] = IGNORE_INDEX  # targets inside the prompt
            out.append(Example(tokens[:-1], y, tokens[: len(prompt)], record.reference, record.label or "", i))
        return out, stats

    def _ended(self, completion: list[int]) -> list[int]:
        """The completion up to and including its first end-of-sequence token (appended when it has none)."""
        if self.eos_id in completion:
            return completion[: completion.index(self.eos_id) + 1]
        return [*completion, self.eos_id]

    # ----------------------------------------------------------------------------------- batches
    def train_batch(self, examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``, right-padded to the longest example (padded targets ignored)."""
        return pad_right([e.x for e in examples], self.pad_id), pad_right([e.y for e in examples], IGNORE_INDEX)

    def eval_batch(self, examples: list[Example]) -> dict[str, Any]:
        """``input_ids``, ``targets`` (as :meth:`train_batch`), ``prompt_ids`` and ``prompt_mask`` (left-padded),
        ``references`` and ``labels`` (lists of strings)."""
        x, y = self.train_batch(examples)
        prompt_ids, prompt_mask = pad_left([e.prompt for e in examples], self.pad_id)
        return {
            "input_ids": x,
            "targets": y,
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "references": [e.reference for e in examples],
            "labels": [e.label for e in examples],
        }


def pad_right(rows: list[torch.Tensor], value: int) -> torch.Tensor:
    """``(B, T)``: each row followed by ``value`` up to the longest."""
    out = torch.full((len(rows), max(len(r) for r in rows)), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def pad_left(rows: list[torch.Tensor], value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)``, ``(B, T)`` each: each row preceded by ``value`` up to the longest, the mask 1 on real tokens."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    return ids, mask

"""Instruction and chat records, read from JSONL files, for
:class:`~lightning_fl.data.instruct.FederatedInstructionDataModule`.

A record is one conversation whose last message is the assistant's response: the model is trained to produce that
response (the loss covers it alone) and scored on it. Each line of a JSONL file is a JSON object in one of the two
formats users have:

- **Alpaca**: ``{"instruction": "...", "input": "...", "output": "..."}`` (``input`` optional, and ``system``
  too): the user's message is the instruction, followed by a blank line and the input when there is one; the
  response is ``output``.
- **Chat**: ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}``: the last
  message must be the assistant's (the response); earlier assistant turns are context, not trained.

Either format may carry ``client`` (who holds the record: one client per distinct value when the data module has no
partitioner), a label (``label``, or the field the source names: what a Dirichlet partition skews and what metrics
are broken down by) and ``answer`` (the exact answer a generated response is scored against; default: the
response itself). A line that is not a JSON object of one of these shapes is refused with one line naming the file,
the line number and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lightning_fl.errors import ConfigError, DatasetNotFoundError

RecordFormat = Literal["auto", "alpaca", "messages"]
ROLES = ("system", "user", "assistant")
#: The splits a source may give; ``train`` is required, the others are cut from it when missing.
SPLITS = ("train", "val", "test", "public")


@dataclass(frozen=True)
class InstructionRecord:
    """One conversation: ``messages`` (``{"role", "content"}`` dicts) ending with the assistant's response.

    Args:
        messages: The conversation; the last message is the response the model learns and is scored on.
        client: Who holds it (``None``: the data module's partitioner decides).
        label: A category (a task type, a topic): Dirichlet partitions skew it, metrics break down by it.
        answer: The exact answer generation is scored against (``None``: the response's text).
    """

    messages: tuple[dict[str, str], ...]
    client: str | None = None
    label: str | None = None
    answer: str | None = None

    @property
    def prompt(self) -> list[dict[str, str]]:
        """The messages before the response: what the model is given."""
        return list(self.messages[:-1])

    @property
    def response(self) -> str:
        return self.messages[-1]["content"]

    @property
    def reference(self) -> str:
        """What a generated response must equal (after normalisation) to count as correct."""
        return self.response if self.answer is None else self.answer


def parse_record(obj: object, format: RecordFormat = "auto", label_field: str = "label") -> InstructionRecord:
    """One JSON object as a record (module docstring); a ``ValueError`` says what is wrong with it."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if format == "auto":
        format = "messages" if "messages" in obj else "alpaca"
    if format == "alpaca":
        missing = [k for k in ("instruction", "output") if not isinstance(obj.get(k), str)]
        if missing:
            raise ValueError(
                f"{' and '.join(map(repr, missing))} missing or not a string (Alpaca records need instruction and "
                "output strings; chat records need a messages list)"
            )
        user = obj["instruction"] + (f"\n\n{obj['input']}" if obj.get("input") else "")
        system = [{"role": "system", "content": obj["system"]}] if obj.get("system") else []
        messages = [*system, {"role": "user", "content": user}, {"role": "assistant", "content": obj["output"]}]
    else:
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' missing or not a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} must be an object with role one of {ROLES} and a content string")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if messages[-1]["role"] != "assistant" or not any(m["role"] == "user" for m in messages):
            raise ValueError("the last message must be the assistant's response, after at least one user message")
    if not messages[-1]["content"].strip():
        raise ValueError("the response (the last message) is empty")
    fields = {}
    for key, name in (("client", "client"), ("label", label_field), ("answer", "answer")):
        value = obj.get(name)
        if value is not None and not isinstance(value, (str, int)):
            raise ValueError(f"{name!r} must be a string or an integer, got {type(value).__name__}")
        fields[key] = None if value is None else str(value)
    return InstructionRecord(tuple(messages), **fields)


def read_jsonl(
    path: str | Path, format: RecordFormat = "auto", label_field: str = "label", key: str = "data.source"
) -> list[InstructionRecord]:
    """Every record of a JSONL file (blank lines skipped); a bad line is one :class:`ConfigError` naming ``key``, the
    file and the line."""
    where = Path(path).expanduser()
    if not where.is_file():
        raise DatasetNotFoundError(f"{key}: no JSONL file at {where}; pass the path of a file of JSON records")
    records = []
    with open(where, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(parse_record(json.loads(line), format, label_field))
            except (ValueError, json.JSONDecodeError) as err:
                detail = f"not JSON ({err.msg})" if isinstance(err, json.JSONDecodeError) else str(err)
                raise ConfigError(f"{key}: line {number} of {where}: {detail}; fix that line") from None
    if not records:
        raise ConfigError(f"{key}: {where} holds no record; give one JSON object per line")
    return records


class InstructionSource:
    """Where records come from: :meth:`splits` gives ``train`` and any of ``val``, ``test``, ``public``."""

    _plugin_base = True  # not offered as a choice in CLI messages

    def prepare(self) -> None:
        """Make the files available (download them); nothing to do by default."""

    def splits(self) -> dict[str, list[InstructionRecord]]:
        """The records of each split this source has (``train`` at least)."""
        raise NotImplementedError(f"{type(self).__name__} must define splits")


class InstructionFiles(InstructionSource):
    """Records from JSONL files (Alpaca or chat, module docstring), one file per split.

    Args:
        train: The training records (dealt to clients).
        val: Validation records (scored every ``trainer.val_every_n_rounds``); ``null``: cut from ``train`` by the
            data module's ``val_fraction``.
        test: Test records (scored once at the end); ``null``: cut from ``train`` by ``test_fraction``.
        public: Records no client holds (e.g. to choose a clip bound for DP); ``null``: none.
        format: ``auto`` (per line: ``messages`` present means chat), ``alpaca`` or ``messages``.
        label_field: The field that holds a record's label.
    """

    def __init__(
        self,
        train: str,
        val: str | None = None,
        test: str | None = None,
        public: str | None = None,
        format: RecordFormat = "auto",
        label_field: str = "label",
    ) -> None:
        if format not in ("auto", "alpaca", "messages"):
            raise ConfigError(f"data.source.format must be 'auto', 'alpaca' or 'messages', got {format!r}")
        self.paths = {"train": train, "val": val, "test": test, "public": public}
        self.format, self.label_field = format, label_field

    def splits(self) -> dict[str, list[InstructionRecord]]:
        return {
            name: read_jsonl(path, self.format, self.label_field, key=f"data.source.{name}")
            for name, path in self.paths.items()
            if path is not None
        }

    def __repr__(self) -> str:
        given = ", ".join(f"{k}={v!r}" for k, v in self.paths.items() if v is not None)
        return f"InstructionFiles({given}, format={self.format!r})"

"""Federated instruction tuning data: records (:mod:`~lightning_fl.data.instructions`) dealt to clients, tokenised
through the model's chat template with the loss on the response (:mod:`~lightning_fl.data.chat`), and held-out
records scored by generation.

**Who holds what.** Without ``partition`` every training record names its ``client`` and each distinct name is a
client (``num_clients``: keep that many of them, chosen at random; ``null``: all). With a partitioner (``IID``,
``Dirichlet``, ``Shards`` of :mod:`~lightning_fl.data.partition`) the training records are dealt to ``num_clients``
clients over their labels (a Dirichlet partition skews each client towards some labels).

**Splits.** Validation records are scored every ``trainer.val_every_n_rounds`` rounds (the global model generates
an answer for each and it is compared with the reference: ``val/exact_match``; the response's perplexity beside
it); test records once, after the last round (``trainer.test_after_fit``), never to choose anything. A source
without validation or test records has them cut from its training records (``val_fraction``, ``test_fraction``,
seeded), before any client gets one. ``max_eval_samples`` keeps a seeded subset of each, the same for every method
and round.
"""

from __future__ import annotations

import logging
import time

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from lightning_fl.data import pretrained
from lightning_fl.data.chat import ChatFormat, Example, TokenStats
from lightning_fl.data.instructions import InstructionRecord, InstructionSource
from lightning_fl.data.partition import Partitioner
from lightning_fl.errors import ConfigError

log = logging.getLogger(__name__)


class FederatedInstructionDataModule(L.LightningDataModule):
    """Instruction or chat records for clients, with the client contract of
    :class:`~lightning_fl.data.FederatedDataModule` (module docstring). Set up: ``client_names``, ``vocab_size``,
    ``tokenizer_digest``, ``labels`` (the training records' distinct labels) and ``stats`` (per split, what
    tokenising cut or left out).

    Args:
        source: The records: ``InstructionFiles`` (JSONL) or ``InstructionTasks`` (the built-in task).
        tokenizer: The network's model (``SmolLM2``, a ``save_pretrained`` folder or a ``.gguf`` file), whose
            tokenizer and chat template the records go through.
        num_clients: With ``partition``: how many clients; without: how many of the records' ``client`` names to keep
            (chosen at random; ``null``: all).
        partition: ``null``: by the records' ``client`` field; else a partitioner over their labels.
        context: Longest example in tokens (prompt and response); longer ones are cut, and counted.
        val_fraction: Share of the training records held out for validation when the source has no validation split.
        test_fraction: The same for the test split.
        batch_size: Records per training batch (padded to the longest in it).
        eval_batch_size: Records per evaluation batch (and per ``generate`` call).
        max_eval_samples: Evaluate on at most this many records of each of val and test (a seeded subset).
        max_new_tokens: Most tokens generated per answer (generation stops earlier at the end-of-sequence token).
        chat_template: A Jinja chat template instead of the tokenizer's (``null``: the tokenizer's; a tokenizer without
            one gets Alpaca's layout, :data:`~lightning_fl.data.chat.PLAIN_TEMPLATE`).
        num_workers: DataLoader workers.
        seed: Seed of the held-out cut, the clients kept and the partition.
    """

    def __init__(
        self,
        source: InstructionSource,
        tokenizer: str,
        num_clients: int | None = None,
        partition: Partitioner | None = None,
        context: int = 256,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        batch_size: int = 4,
        eval_batch_size: int = 16,
        max_eval_samples: int | None = None,
        max_new_tokens: int = 32,
        chat_template: str | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        counts = [1 if v is None else v for v in (num_clients, max_eval_samples)]
        checks = {
            "num_clients, max_eval_samples must be >= 1 or null": min(counts) >= 1,
            "context, batch_size, eval_batch_size, max_new_tokens must be >= 1": min(
                context, batch_size, eval_batch_size, max_new_tokens
            )
            >= 1,
            "val_fraction, test_fraction must be >= 0 and sum to less than 1": min(val_fraction, test_fraction) >= 0
            and val_fraction + test_fraction < 1,
        }
        if problems := [f"data.{k}" for k, ok in checks.items() if not ok]:
            raise ConfigError("; ".join(problems))
        if partition is not None and num_clients is None:
            raise ConfigError("data.partition deals records to data.num_clients clients: set data.num_clients")
        self.source, self.tokenizer, self.num_clients, self.partition = source, tokenizer, num_clients, partition
        self.context, self.val_fraction, self.test_fraction = context, val_fraction, test_fraction
        self.batch_size, self.eval_batch_size, self.max_eval_samples = batch_size, eval_batch_size, max_eval_samples
        self.max_new_tokens, self.chat_template = max_new_tokens, chat_template
        self.num_workers, self.seed = num_workers, seed
        self.client_names: list[str] = []
        self.labels: list[str] = []
        self.stats: dict[str, TokenStats] = {}
        self.vocab_size, self.tokenizer_digest, self.format = 0, None, None
        self._splits: dict[str, list[Example]] = {}
        self._clients: list[list[Example]] = []

    # ----------------------------------------------------------------------------------- set-up
    def prepare_data(self) -> None:
        self.source.prepare()
        pretrained.resolve(self.tokenizer, "data.tokenizer")  # fetches a short name's files

    def describe(self) -> dict[str, object]:
        """Everything that decides the examples and the clients (cache keys use it)."""
        keys = ("num_clients", "context", "val_fraction", "test_fraction", "batch_size", "max_eval_samples", "seed")
        return {k: getattr(self, k) for k in keys} | {
            k: repr(getattr(self, k)) for k in ("source", "partition", "tokenizer", "chat_template")
        }

    def setup(self, stage: str | None = None) -> None:
        if self._clients:
            return
        started = time.perf_counter()
        records = self._held_out(self.source.splits())
        tokenizer = pretrained.load_tokenizer(pretrained.resolve(self.tokenizer, "data.tokenizer"), "data.tokenizer")
        self.tokenizer_digest, self.vocab_size = pretrained.tokenizer_digest(tokenizer), len(tokenizer)
        self.format = ChatFormat(tokenizer, self.context, self.chat_template)
        for name, split in records.items():
            self._splits[name], self.stats[name] = self.format.examples(split)
            if name in ("val", "test") and self.max_eval_samples is not None:
                keep = np.random.default_rng([self.seed, 1]).permutation(len(self._splits[name]))
                self._splits[name] = [self._splits[name][i] for i in np.sort(keep[: self.max_eval_samples])]
        kept = self._splits["train"]
        if not kept:
            raise ConfigError(f"data.context={self.context}: no training record fits it; raise data.context")
        self._deal(kept, [records["train"][e.record] for e in kept])
        template = (
            "the tokenizer's chat template"
            if not self.format.plain and not self.chat_template
            else ("data.chat_template" if self.chat_template else "no chat template in the tokenizer: Alpaca's layout")
        )
        log.info(
            "instruction data: %s over %d clients, %s, tokenised in %.1f s (%s)",
            self.partition if self.partition is not None else "by the records' client field",
            len(self._clients),
            "; ".join(self.stats[s].line(s) for s in self.stats),
            time.perf_counter() - started,
            template,
        )

    def _held_out(self, splits: dict[str, list[InstructionRecord]]) -> dict[str, list[InstructionRecord]]:
        """The source's splits with validation and test records cut from the training ones where it has none."""
        if not splits.get("train"):
            raise ConfigError("data.source has no training record")
        train = splits["train"]
        fractions = {"val": self.val_fraction, "test": self.test_fraction}
        missing = [(name, fraction) for name, fraction in fractions.items() if name not in splits]
        if missing:
            order = np.random.default_rng([self.seed, 0]).permutation(len(train))
            start = 0
            for name, fraction in missing:
                n = round(fraction * len(train))
                if n == 0:
                    raise ConfigError(
                        f"data.source has no {name} split and data.{name}_fraction={fraction} of its {len(train)} "
                        f"training records is none: give the source a {name} file or raise data.{name}_fraction"
                    )
                splits[name] = [train[i] for i in np.sort(order[start : start + n])]
                start += n
            train = [train[i] for i in np.sort(order[start:])]
        return {"train": train} | {k: v for k, v in splits.items() if k != "train"}

    def _deal(self, examples: list[Example], records: list[InstructionRecord]) -> None:
        """Deal the training examples to clients (module docstring)."""
        self.labels = sorted({r.label or "" for r in records})
        if self.partition is None:
            if any(r.client is None for r in records):
                raise ConfigError(
                    "data.partition is null, so every training record must name its client, but some have no "
                    "'client' field: add it, or set data.partition (e.g. lightning_fl.data.Dirichlet) and "
                    "data.num_clients"
                )
            names, owner = np.unique([r.client for r in records], return_inverse=True)
            k = len(names) if self.num_clients is None else self.num_clients
            if not 1 <= k <= len(names):
                raise ConfigError(
                    f"data.num_clients={k} but the records name {len(names)} clients; lower it or use null"
                )
            keep = np.sort(np.random.default_rng([self.seed, 2]).permutation(len(names))[:k])
            groups = [np.flatnonzero(owner == j) for j in keep]
            self.client_names = [str(names[j]) for j in keep]
        else:
            targets = np.searchsorted(self.labels, [r.label or "" for r in records])
            groups = list(self.partition(targets, self.num_clients, self.seed))
            self.client_names = [f"client-{k}" for k in range(len(groups))]
        self._clients = [[examples[i] for i in group] for group in groups]
        self.num_clients = len(self._clients)

    def summary_lines(self) -> list[str]:
        """What the run's closing summary says about the data: each split's records and what was cut or left out."""
        return ["instruction data: " + "; ".join(self.stats[s].line(s) for s in self.stats)] if self.stats else []

    def partition_table(self) -> str:
        """Markdown: the split sizes, then each client's name and records per label."""
        self.setup()
        sizes = ", ".join(f"{k} {len(v)}" for k, v in self._splits.items() if k != "train")
        head = f"{self.num_clients} clients, {len(self._splits['train'])} training records; {sizes}"
        columns = " | ".join(label or "(no label)" for label in self.labels)
        rows = ""
        for k, (name, examples) in enumerate(zip(self.client_names, self._clients, strict=True)):
            counts = [sum(e.label == label for e in examples) for label in self.labels]
            rows += f"\n| {k} | {name} | {len(examples)} | {' | '.join(map(str, counts))} |"
        rule = " | ".join("---" for _ in self.labels)
        return f"{head}\n\n| client | name | records | {columns} |\n| --- | --- | --- | {rule} |{rows}"

    # ----------------------------------------------------------------------------------- loaders
    def _loader(self, examples: list[Example], train: bool, seed: int | None = None) -> DataLoader:
        self.setup()
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        return DataLoader(
            examples,
            self.batch_size if train else self.eval_batch_size,
            shuffle=train,
            generator=generator,
            num_workers=self.num_workers,
            collate_fn=self.format.train_batch if train else self.format.eval_batch,
        )

    def _client(self, cid: int) -> list[Example]:
        self.setup()
        if not 0 <= cid < len(self._clients):
            raise IndexError(f"Expected a client id in [0, {len(self._clients)}), got {cid}")
        return self._clients[cid]

    def client_num_samples(self, cid: int) -> int:
        return len(self._client(cid))

    def client_dataloader(self, cid: int, seed: int | None = None) -> DataLoader:
        """Shuffled training batches ``(x, y)`` of client ``cid``'s records; ``seed`` fixes the order."""
        return self._loader(self._client(cid), train=True, seed=seed)

    def train_dataloader(self) -> DataLoader:
        """Central training: every client's records pooled."""
        self.setup()
        return self._loader([e for c in self._clients for e in c], train=True)

    def windows_dataloader(self, examples: list[Example], seed: int | None = None) -> DataLoader:
        """A client's shuffled training batches over any ``examples`` (e.g. a public group's)."""
        return self._loader(examples, train=True, seed=seed)

    def public_groups(self) -> list[list[Example]]:
        """The public records (no client holds them) in groups of a mean client's size, in a seeded order: pseudo-
        clients for a DP clip bound chosen without the clients (``tools/public_clip.py``); none without a public
        split."""
        self.setup()
        public = self._splits.get("public", [])
        if not public:
            return []
        size = max(1, round(sum(map(len, self._clients)) / len(self._clients)))
        order = np.random.default_rng([self.seed, 3]).permutation(len(public))
        return [[public[i] for i in order[k : k + size]] for k in range(0, len(order), size)]

    @property
    def val_is_test(self) -> bool:
        """Never: validation records are their own split."""
        return False

    def val_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self._splits["val"], train=False)

    def test_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self._splits["test"], train=False)

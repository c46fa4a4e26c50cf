"""Federated character-level text: a corpus of speaking roles (Shakespeare's plays,
:mod:`lightning_fl.data.shakespeare`), one client per role (LEAF's setting).

**Splits.** ``pretrain_plays`` whole plays (seeded) are public: central pretraining, public pseudo-clients
(:meth:`~FederatedTextDataModule.public_groups`). In the others, roles with at least ``partition.min_lines`` lines
form the pool; a pool role's last ``test_fraction`` of lines is test text, the ``val_fraction`` before it validation
text (LEAF's per-role split, in time order). The partition deals the pool's training windows to clients; val/test
windows come from the held-out text of the roles taking part. Tokens are characters: id 0 is the unknown character,
then the sorted characters of the training text (pretraining plays and pool training lines). With ``tokenizer`` (a
pretrained model's name or path, resolved as the network resolves it: :mod:`lightning_fl.data.pretrained`) tokens
are that tokenizer's instead: each text is encoded without special tokens and windows are ``context`` tokens long.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_fl.data import pretrained
from lightning_fl.data.roles import ByRole, Role, TextPartition, TextSource
from lightning_fl.errors import ConfigError
from lightning_fl.trainer_api import lazy_instance

UNKNOWN = "\ufffd"  # vocabulary[0]: what characters unseen in training decode to


class TextWindows(Dataset):
    """Next-character windows of one id stream: item ``i`` is ``(ids[s : s+n], ids[s+1 : s+n+1])``, s = starts[i]."""

    def __init__(self, ids: torch.Tensor, starts: np.ndarray, context: int) -> None:
        self.ids, self.starts, self.context = ids, np.asarray(starts, dtype=np.int64), context

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        return self.ids[s : s + self.context], self.ids[s + 1 : s + self.context + 1]

    def subset(self, indices: np.ndarray) -> TextWindows:
        """The windows at ``indices`` (of this set's), over the same id stream."""
        return TextWindows(self.ids, self.starts[indices], self.context)


class FederatedTextDataModule(L.LightningDataModule):
    """Next-character windows of a :class:`TextSource` for clients (splits: module docstring), with the client
    contract of :class:`~lightning_fl.data.FederatedDataModule`. Set up: ``vocabulary`` (empty with a tokenizer),
    ``vocab_size``, ``encode``, ``tokenizer_digest`` (with a tokenizer).

    Args:
        source: The corpus (``Shakespeare``).
        num_clients: Null: one per unit (``ByRole``: role, ``ByPlay``: play, ``IID``: as many as pool roles);
            fewer keeps that many units at random (seeded), for tractable runs. Names: ``client_names``.
        partition: ``ByRole(min_lines)`` (LEAF), ``ByPlay`` or ``IID``.
        context: Window length in tokens (characters by default; LEAF: 80): ``x = ids[i : i+context]``, ``y`` one on.
        stride: Step between training windows (null: ``context``; LEAF: 1). Val/test windows never overlap.
        pretrain_plays: Plays (a count, or a fraction in [0, 1)) that ``train_dataloader`` serves for central
            pretraining; with 0 it serves the pooled client windows.
        val_fraction: Share of each pool role's lines held out for validation (0: val serves the test windows).
        test_fraction: Share of each pool role's last lines held out for test.
        seed: Seed of the pretraining plays, the units kept and the partition.
        tokenizer: ``null``: characters (the vocabulary above); else the network's own tokenizer (``HFCausalLM`` checks
            it): ``SmolLM2`` (fetched as the network is), a ``save_pretrained`` folder or a ``.gguf`` file.
        max_eval_samples: Evaluate on at most this many windows of each of val and test: a seeded random subset
            (``seed``), the same for every method and round (null: all).
    """

    def __init__(
        self,
        source: TextSource,
        num_clients: int | None = None,
        partition: TextPartition = lazy_instance(ByRole),
        context: int = 80,
        stride: int | None = None,
        pretrain_plays: int | float = 0.2,
        val_fraction: float = 0.0,
        test_fraction: float = 0.2,
        batch_size: int = 64,
        eval_batch_size: int = 256,
        num_workers: int = 0,
        seed: int = 0,
        tokenizer: str | None = None,
        max_eval_samples: int | None = None,
    ) -> None:
        super().__init__()
        fractions = (val_fraction, test_fraction, 1 - val_fraction - test_fraction)
        counts = [1 if x is None else x for x in (num_clients, stride, max_eval_samples)]
        checks = {
            "num_clients, stride, max_eval_samples must be >= 1 or null": min(counts) >= 1,
            "context, batch_size, eval_batch_size must be >= 1": min(context, batch_size, eval_batch_size) >= 1,
            "pretrain_plays must be a count or a fraction in [0, 1)": 0 <= pretrain_plays == int(pretrain_plays)
            or 0 <= pretrain_plays < 1,
            "val_fraction, test_fraction must be >= 0 and leave training lines": min(fractions) >= 0 < fractions[2],
        }
        if problems := [f"data.{k}" for k, ok in checks.items() if not ok]:
            raise ConfigError("; ".join(problems))
        partition.keep(Role("", "", []))  # a method call initialises a lazy_instance default
        self.source, self.partition, self.context, self.stride = source, partition, context, stride or context
        self.pretrain_plays, self.seed = pretrain_plays, seed
        self.val_fraction, self.test_fraction, self.num_workers = val_fraction, test_fraction, num_workers
        self.batch_size, self.eval_batch_size, self.num_clients = batch_size, eval_batch_size, num_clients
        self.vocabulary, self.vocab_size, self.client_names, self._clients, self._splits = [], 0, [], [], {}
        self.tokenizer, self.tokenizer_digest, self._tokenizer = tokenizer, None, None
        self.max_eval_samples = max_eval_samples

    def encode(self, text: str) -> torch.Tensor:
        if self._tokenizer is not None:
            return torch.tensor(self._tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)
        return torch.tensor([self._index.get(c, 0) for c in text], dtype=torch.long)

    def _encode_all(self, texts: list[str]) -> list[torch.Tensor]:
        if self._tokenizer is None or not texts:
            return [self.encode(t) for t in texts]
        ids = self._tokenizer(texts, add_special_tokens=False)["input_ids"]  # one batch: the fast tokenizer's threads
        return [torch.tensor(i, dtype=torch.long) for i in ids]

    def _load_tokenizer(self) -> None:
        files = pretrained.resolve(self.tokenizer, "data.tokenizer")
        self._tokenizer = pretrained.load_tokenizer(files, "data.tokenizer")
        self.tokenizer_digest, self.vocab_size = pretrained.tokenizer_digest(self._tokenizer), len(self._tokenizer)

    def describe(self) -> dict[str, object]:
        """Everything that determines the vocabulary and the central training batches (cache keys use it)."""
        keys = ("seed", "pretrain_plays", "context", "stride", "val_fraction", "test_fraction", "batch_size")
        keys += ("max_eval_samples",) * (self.max_eval_samples is not None)  # older cache keys stay valid
        out = {k: getattr(self, k) for k in keys} | {k: repr(getattr(self, k)) for k in ("source", "partition")}
        return out if self.tokenizer is None else out | {"tokenizer": self.tokenizer}

    def prepare_data(self) -> None:
        self.source.prepare()
        if self.tokenizer is not None:
            pretrained.resolve(self.tokenizer, "data.tokenizer")  # fetches a short name's files

    def _windows(self, texts: list[str], stride: int) -> tuple[TextWindows, np.ndarray]:
        """Windows inside each text (never across two) and, per window, the index of its text."""
        encoded = [torch.zeros(0, dtype=torch.long), *self._encode_all(texts)]
        offsets = np.cumsum([len(e) for e in encoded])
        starts = [offsets[j] + np.arange(0, max(len(e) - self.context, 0), stride) for j, e in enumerate(encoded[1:])]
        owner = np.repeat(np.arange(len(starts)), [len(s) for s in starts])
        return TextWindows(torch.cat(encoded), np.concatenate([np.zeros(0), *starts]), self.context), owner

    def setup(self, stage: str | None = None) -> None:
        if self._clients:
            return
        roles = self.source.roles()
        plays = sorted({r.play for r in roles})
        n_pre = self.pretrain_plays if isinstance(self.pretrain_plays, int) else round(self.pretrain_plays * len(plays))
        if n_pre >= len(plays):
            raise ConfigError(f"data.pretrain_plays={self.pretrain_plays} leaves none of the {len(plays)} plays")
        public = set(np.random.default_rng(self.seed).permutation(plays)[:n_pre].tolist())
        pool = [r for r in roles if r.play not in public and self.partition.keep(r)]
        if not pool:
            raise ConfigError(f"No role of the client plays is kept by data.partition={self.partition!r}")
        texts: dict[str, list[str]] = {"train": [], "val": [], "test": []}
        for r in pool:  # LEAF's per-role split, in time order: train | val | test
            b = len(r.lines) - int(len(r.lines) * self.test_fraction)
            a = b - int(len(r.lines) * self.val_fraction)
            for name, part in zip(texts, (r.lines[:a], r.lines[a:b], r.lines[b:]), strict=True):
                texts[name].append("".join(f"{line}\n" for line in part))
        public_text = ["".join(f"{line}\n" for line in r.lines) for r in roles if r.play in public]
        if self.tokenizer is not None:
            self._load_tokenizer()
        else:
            self.vocabulary = [UNKNOWN, *sorted(set("".join(public_text + texts["train"])) - {UNKNOWN})]
            self._index, self.vocab_size = {c: i for i, c in enumerate(self.vocabulary)}, len(self.vocabulary)
        train, owner = self._windows(texts["train"], self.stride)
        clients = self.partition.split(pool, owner, self.num_clients, self.seed)
        pooled = np.sort(np.concatenate([w for _, w in clients]))
        taking_part = np.isin(np.arange(len(pool)), owner[pooled]).tolist()
        for name in ("val", "test"):  # the held-out text of the roles taking part
            held_out = [t * p for t, p in zip(texts[name], taking_part, strict=True)]
            windows = self._windows(held_out, self.context)[0]
            if self.max_eval_samples is not None and self.max_eval_samples < len(windows):
                keep = np.random.default_rng(self.seed + 1).permutation(len(windows))[: self.max_eval_samples]
                windows = TextWindows(windows.ids, windows.starts[np.sort(keep)], self.context)
            self._splits[name] = windows
        self._splits["public"], self._public_owner = self._windows(public_text, self.stride)
        self._splits["clients"] = TextWindows(train.ids, train.starts[pooled], self.context)
        self._clients = [TextWindows(train.ids, train.starts[w], self.context) for _, w in clients]
        self.client_names, self.num_clients = [name for name, _ in clients], len(clients)  # (was null or a count)

    def partition_table(self) -> str:
        """Markdown: the split sizes in windows, then each client's name and windows."""
        self.setup()
        sizes = ", ".join(f"{k} {len(self._splits[k])}" for k in ("public", "val", "test"))
        rows = "".join(f"\n| {k} | {name} | {len(self._clients[k])} |" for k, name in enumerate(self.client_names))
        unit = "character" if self.tokenizer is None else "token"
        head = f"{self.partition!r} over {self.num_clients} clients; {self.context}-{unit} windows: {sizes}"
        return f"{head}; vocabulary {self.vocab_size}\n\n| client | name | windows |\n| --- | --- | --- |{rows}"

    def _loader(self, data: str | TextWindows, train: bool = False, seed: int | None = None) -> DataLoader:
        self.setup()
        data, size = self._splits[data] if isinstance(data, str) else data, [self.eval_batch_size, self.batch_size]
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        return DataLoader(data, size[train], shuffle=train, generator=generator, num_workers=self.num_workers)

    def _client(self, cid: int) -> TextWindows:
        self.setup()
        if not 0 <= cid < len(self._clients):
            raise IndexError(f"Expected a client id in [0, {len(self._clients)}), got {cid}")
        return self._clients[cid]

    def client_num_samples(self, cid: int) -> int:
        return len(self._client(cid))

    def client_dataloader(self, cid: int, seed: int | None = None) -> DataLoader:
        """Shuffled training loader over client ``cid``'s windows; ``seed`` fixes the order."""
        return self.windows_dataloader(self._client(cid), seed)

    def windows_dataloader(self, windows: TextWindows, seed: int | None = None) -> DataLoader:
        """A client's shuffled training loader (batch size, order) over any ``windows``, e.g. a public group's."""
        return self._loader(windows, train=True, seed=seed)

    def public_groups(self) -> list[TextWindows]:
        """The public split's windows (the ``pretrain_plays``, no client's text) by speaking role (none without)."""
        self.setup()
        public, owner = self._splits["public"], self._public_owner
        return [TextWindows(public.ids, public.starts[owner == j], self.context) for j in np.unique(owner)]

    def train_dataloader(self) -> DataLoader:
        """Central training: the pretraining plays, or with ``pretrain_plays`` 0 the pooled client windows."""
        return self._loader("public" if self.pretrain_plays else "clients", train=True)

    @property
    def val_is_test(self) -> bool:
        """Whether ``val_dataloader`` serves the test windows (``val_fraction`` 0): ``val/*`` is then test data."""
        return self.val_fraction == 0

    def val_dataloader(self) -> DataLoader:
        return self._loader("test" if self.val_is_test else "val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

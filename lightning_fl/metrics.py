"""Metrics shared by every method: accuracy and expected calibration error (ECE).

ECE follows Guo et al. (2017): 15 equal-width confidence bins, L1 gap between accuracy and
confidence weighted by bin mass (torchmetrics ``MulticlassCalibrationError(norm="l1")``).
Accuracy is plain (micro) accuracy, not torchmetrics' default macro average.

Language models (:class:`NextTokenMetrics`) report the mean token cross-entropy, its exponential
(perplexity) and next-token accuracy (LEAF's Shakespeare metric), every token weighted alike; targets equal to
:data:`IGNORE_INDEX` (an instruction's prompt and padding) are left out, so on instruction data these are the
response's perplexity and accuracy. Tasks scored by generation (:class:`ExactMatch`) count the generated answers
equal to the reference once both are normalised (:func:`normalize_answer`).
"""

from __future__ import annotations

import math
import re
import unicodedata

import torch
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassCalibrationError

ECE_BINS = 15
#: The target id that losses and metrics leave out (PyTorch's ``cross_entropy`` default): prompt and padding tokens.
IGNORE_INDEX = -100


def classification_metrics(num_classes: int, prefix: str) -> MetricCollection:
    """``{prefix}acc`` and ``{prefix}ece``; update with ``(probs or logits (B, C) float32, targets (B,))``."""
    return MetricCollection(
        {
            "acc": MulticlassAccuracy(num_classes=num_classes, average="micro"),
            "ece": MulticlassCalibrationError(num_classes=num_classes, n_bins=ECE_BINS, norm="l1"),
        },
        prefix=prefix,
    )


class NextTokenMetrics(Metric):
    """``{prefix}loss`` (mean token cross-entropy, nats), ``{prefix}ppl`` (its exp) and ``{prefix}acc``.

    Update with ``(logits (B, T, V), targets (B, T))``; targets equal to :data:`IGNORE_INDEX` are not counted. Sums
    are kept in float64 and summed over processes.
    """

    full_state_update = False

    def __init__(self, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix
        self.add_state("loss_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("correct", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        flat = logits.reshape(-1, logits.shape[-1]).float()
        target = targets.reshape(-1)
        counted = target != IGNORE_INDEX
        loss = torch.nn.functional.cross_entropy(flat, target, reduction="sum", ignore_index=IGNORE_INDEX)
        self.loss_sum += loss.double()
        self.correct += ((flat.argmax(-1) == target) & counted).sum()
        self.tokens += counted.sum()

    def compute(self) -> dict[str, torch.Tensor]:
        if self.tokens == 0:
            raise ValueError("NextTokenMetrics.compute() called before any update")
        loss = self.loss_sum / self.tokens
        ppl = torch.exp(loss) if loss < math.log(torch.finfo(torch.float64).max) else torch.tensor(math.inf)
        acc = self.correct.double() / self.tokens
        return {f"{self.prefix}loss": loss.float(), f"{self.prefix}ppl": ppl.float(), f"{self.prefix}acc": acc.float()}


#: What :func:`normalize_answer` strips from an answer's ends: quotes, brackets and emphasis around it, and a
#: sentence's closing punctuation after it (a sign or a dash that belongs to the answer stays).
_AROUND = "\"'`*_()[]{}<>\u201c\u201d\u2018\u2019"
_AFTER = ".,;:!?"


def normalize_answer(text: str) -> str:
    """``text`` as :class:`ExactMatch` compares it: Unicode NFKC, case folded, runs of whitespace made one space,
    quotes, brackets and emphasis stripped from both ends and closing punctuation from the end (``" Hamlet."`` and
    ``"hamlet"`` match; ``"-5"`` and ``"2019-04-06"`` keep their dashes).

    >>> normalize_answer("  **The  Tempest.**")
    'the tempest'
    """
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    previous = None
    while text != previous:
        previous = text
        text = text.strip(_AROUND + " ").rstrip(_AFTER + " ")
    return text


def contains_answer(prediction: str, reference: str) -> bool:
    """Whether the normalised ``reference`` stands in the normalised ``prediction`` as a whole (not inside a longer
    word or number): ``"4 x 72 = 288"`` contains ``288``, ``"2880"`` does not.

    >>> contains_answer("4 x 72 = 288.", "288"), contains_answer("2880", "288")
    (True, False)
    """
    wanted = normalize_answer(reference)
    bounded = rf"(?<![0-9a-z]){re.escape(wanted)}(?![0-9a-z])"
    return bool(wanted) and re.search(bounded, normalize_answer(prediction)) is not None


class ExactMatch(Metric):
    """``{prefix}exact_match``: the share of generated answers equal to their reference after
    :func:`normalize_answer` (SQuAD's exact match without its article removal, which would merge "The Tempest" and
    "Tempest"), and ``{prefix}exact_match/{label}`` for each of ``labels`` (the records of that label alone).
    ``{prefix}contains_answer`` is the share whose answer holds the reference anywhere (:func:`contains_answer`): a
    model that knows the answer but not the format (``"4 x 72 = 288"`` for ``288``) scores there, not in exact match.

    Update with lists of strings: predictions, references and (with ``labels``) each record's label. Counts are
    summed over processes.
    """

    full_state_update = False

    def __init__(self, prefix: str = "", labels: list[str] | None = None) -> None:
        super().__init__()
        self.prefix, self.labels = prefix, list(labels or [])
        size = len(self.labels) + 1  # per label, then all records
        self.add_state("matches", default=torch.zeros(size, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", default=torch.zeros(size, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("contains", default=torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, predictions: list[str], references: list[str], labels: list[str] | None = None) -> None:
        if len(predictions) != len(references) or (labels is not None and len(labels) != len(references)):
            raise ValueError(
                f"Expected as many predictions, references and labels, got {len(predictions)}, {len(references)} "
                f"and {len(labels) if labels is not None else 'no'} labels"
            )
        where = {label: i for i, label in enumerate(self.labels)}
        for i, (p, r) in enumerate(zip(predictions, references, strict=True)):
            hit = int(normalize_answer(p) == normalize_answer(r))
            self.contains += int(contains_answer(p, r))
            slots = [-1] + ([where[labels[i]]] if labels is not None and labels[i] in where else [])
            for slot in slots:
                self.matches[slot] += hit
                self.total[slot] += 1

    def compute(self) -> dict[str, torch.Tensor]:
        if self.total[-1] == 0:
            raise ValueError("ExactMatch.compute() called before any update")
        share = self.matches.double() / self.total.clamp(min=1)
        out = {f"{self.prefix}exact_match": share[-1].float()}
        out[f"{self.prefix}contains_answer"] = (self.contains.double() / self.total[-1]).float()
        for i, label in enumerate(self.labels):
            if self.total[i] > 0:
                out[f"{self.prefix}exact_match/{label}"] = share[i].float()
        return out

"""A built-in instruction task with exact answers, generated offline and deterministically (no instruction data set
can be downloaded here): :class:`InstructionTasks`.

**It is synthetic.** Five task types, each a question with one exact answer that the assistant's response states
alone (no explanation), so exact match (:class:`~lightning_fl.metrics.ExactMatch`) scores it:

=============  =======================================================================  ================
type           question                                                                 answer
=============  =======================================================================  ================
``arithmetic`` "What is 47 + 38?" (sums and differences of 2-digit numbers, a 1-digit     ``85``
               by 2-digit product)
``units``      "How many metres are in 7 kilometres?" (nine integer conversions)          ``7000``
``dates``      "What date is 12 days after 2019-03-25?" (1-60 days, 2000-2029)            ``2019-04-06``
``compare``    "Which number is larger, 4817 or 4871?" (2-4 digits, often close)          ``4871``
``play``       "Which play by Shakespeare is this line from? ..." with four titles to      ``Macbeth``
               choose from (a line of at least six words from the 37 plays of
               :class:`~lightning_fl.data.Shakespeare`; chance 1 in 4)
=============  =======================================================================  ================

What it measures: whether a model learns to follow an instruction's answer format and to compute, convert, count
days or recall a play, from clients that each hold mostly some task types (the data module's partition, e.g.
``Dirichlet`` over the type). It does not measure open-ended instruction following or knowledge beyond these five
families. Every record's label is its type, so the data module reports exact match per type too.

Splits never share a question: each type's distinct questions are drawn once (seeded by ``seed``) and cut into
train, validation, test and public parts; the ``play`` type cuts the lines themselves, so a test line was never
seen in training.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import numpy as np

from lightning_fl.data.instructions import InstructionRecord, InstructionSource
from lightning_fl.errors import ConfigError

#: The plays' titles by the file names :class:`~lightning_fl.data.Shakespeare` gives them.
TITLES = {
    "alls_well_that_ends_well": "All's Well That Ends Well",
    "antony_and_cleopatra": "Antony and Cleopatra",
    "as_you_like_it": "As You Like It",
    "comedy_of_errors": "The Comedy of Errors",
    "coriolanus": "Coriolanus",
    "cymbeline": "Cymbeline",
    "hamlet": "Hamlet",
    "henry_iv_part_1": "Henry IV, Part 1",
    "henry_iv_part_2": "Henry IV, Part 2",
    "henry_v": "Henry V",
    "henry_vi_part_1": "Henry VI, Part 1",
    "henry_vi_part_2": "Henry VI, Part 2",
    "henry_vi_part_3": "Henry VI, Part 3",
    "henry_viii": "Henry VIII",
    "john": "King John",
    "julius_caesar": "Julius Caesar",
    "lear": "King Lear",
    "loves_labours_lost": "Love's Labour's Lost",
    "macbeth": "Macbeth",
    "measure_for_measure": "Measure for Measure",
    "merchant_of_venice": "The Merchant of Venice",
    "merry_wives_of_windsor": "The Merry Wives of Windsor",
    "midsummer_nights_dream": "A Midsummer Night's Dream",
    "much_ado_about_nothing": "Much Ado About Nothing",
    "othello": "Othello",
    "pericles": "Pericles",
    "richard_ii": "Richard II",
    "richard_iii": "Richard III",
    "romeo_and_juliet": "Romeo and Juliet",
    "taming_of_the_shrew": "The Taming of the Shrew",
    "tempest": "The Tempest",
    "timon_of_athens": "Timon of Athens",
    "tragedy_of_titus_andronicus": "Titus Andronicus",
    "troilus_and_cressida": "Troilus and Cressida",
    "twelfth_night": "Twelfth Night",
    "two_gentlemen_of_verona": "The Two Gentlemen of Verona",
    "winters_tale": "The Winter's Tale",
}
TASK_TYPES = ("arithmetic", "units", "dates", "compare", "play")
#: (plural of the large unit, plural of the small one, how many small ones make a large one)
UNITS = (
    ("kilometres", "metres", 1000),
    ("metres", "centimetres", 100),
    ("kilograms", "grams", 1000),
    ("litres", "millilitres", 1000),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("days", "hours", 24),
    ("weeks", "days", 7),
    ("feet", "inches", 12),
)
#: Fewest words a line needs to be asked about in the ``play`` task.
MIN_WORDS = 6

Question = tuple[str, str]  # (the user's message, the exact answer)


def _arithmetic(rng: np.random.Generator) -> Question:
    kind = rng.integers(3)
    if kind == 2:
        a, b = int(rng.integers(2, 10)), int(rng.integers(10, 100))
        return f"What is {a} x {b}? Answer with the number only.", str(a * b)
    a, b = (int(v) for v in rng.integers(10, 100, size=2))
    if kind == 0:
        return f"What is {a} + {b}? Answer with the number only.", str(a + b)
    return f"What is {a} - {b}? Answer with the number only.", str(a - b)


def _units(rng: np.random.Generator) -> Question:
    large, small, factor = UNITS[rng.integers(len(UNITS))]
    amount = int(rng.integers(2, 100))
    return f"How many {small} are in {amount} {large}? Answer with the number only.", str(amount * factor)


def _dates(rng: np.random.Generator) -> Question:
    start = datetime.date(2000, 1, 1) + datetime.timedelta(days=int(rng.integers(0, 30 * 365)))
    days = int(rng.integers(1, 61))
    end = start + datetime.timedelta(days=days)
    question = f"What date is {days} days after {start.isoformat()}? Answer in the form YYYY-MM-DD."
    return question, end.isoformat()


def _compare(rng: np.random.Generator) -> Question:
    digits = int(rng.integers(2, 5))
    a = int(rng.integers(10 ** (digits - 1), 10**digits))
    b = a
    while b == a:  # often close: the same number with two digits swapped, else another of its length
        s = list(str(a))
        if rng.random() < 0.5 and len(set(s)) > 1:
            i, j = rng.choice(len(s), size=2, replace=False)
            s[i], s[j] = s[j], s[i]
            b = int("".join(s)) if s[0] != "0" else a
        else:
            b = int(rng.integers(10 ** (digits - 1), 10**digits))
    return f"Which number is larger, {a} or {b}? Answer with the number only.", str(max(a, b))


GENERATORS: dict[str, Callable[[np.random.Generator], Question]] = {
    "arithmetic": _arithmetic,
    "units": _units,
    "dates": _dates,
    "compare": _compare,
}


class InstructionTasks(InstructionSource):
    """The built-in synthetic task (module docstring): ``len(tasks)`` types, each with ``train_per_task`` training,
    ``val_per_task`` validation, ``test_per_task`` test and ``public_per_task`` public records; the record's label is
    its type and its response the exact answer.

    Args:
        tasks: Which task types (of ``arithmetic``, ``units``, ``dates``, ``compare``, ``play``); ``null``: all five.
        train_per_task: Training records per type (dealt to clients).
        val_per_task: Validation records per type.
        test_per_task: Test records per type.
        public_per_task: Public records per type (no client holds them; e.g. to choose a DP clip bound).
        seed: Seed of the questions (the same task for every seed of a study; the data module's ``seed`` varies
            the partition).
        root: Folder of Shakespeare's plays for the ``play`` type (:class:`~lightning_fl.data.Shakespeare`'s
            ``root``; ``null``: the data folders).
        download: Fetch the plays when missing (the ``play`` type only).
    """

    def __init__(
        self,
        tasks: list[str] | None = None,
        train_per_task: int = 400,
        val_per_task: int = 40,
        test_per_task: int = 40,
        public_per_task: int = 40,
        seed: int = 0,
        root: str | None = None,
        download: bool = True,
    ) -> None:
        tasks = list(TASK_TYPES) if tasks is None else list(tasks)
        unknown = [t for t in tasks if t not in TASK_TYPES]
        sizes = (train_per_task, val_per_task, test_per_task, public_per_task)
        if unknown or not tasks or len(set(tasks)) != len(tasks):
            raise ConfigError(f"data.source.tasks must be distinct names of {TASK_TYPES}, got {tasks!r}")
        if train_per_task < 1 or min(sizes) < 0:
            raise ConfigError(
                "data.source.train_per_task must be >= 1 and val_per_task, test_per_task, public_per_task >= 0"
            )
        self.tasks, self.seed = list(tasks), seed
        self.sizes = dict(zip(("train", "val", "test", "public"), sizes, strict=True))
        self.root, self.download = root, download

    def _plays(self):
        from lightning_fl.data.shakespeare import Shakespeare

        return Shakespeare(root=self.root, download=self.download)

    def prepare(self) -> None:
        if "play" in self.tasks:
            self._plays().prepare()

    def splits(self) -> dict[str, list[InstructionRecord]]:
        out: dict[str, list[InstructionRecord]] = {name: [] for name, n in self.sizes.items() if n or name == "train"}
        total = sum(self.sizes.values())
        for t, task in enumerate(self.tasks):
            rng = np.random.default_rng([self.seed, t])
            questions = self._play_questions(rng, total) if task == "play" else _distinct(GENERATORS[task], rng, total)
            start = 0
            for name, n in self.sizes.items():
                for user, answer in questions[start : start + n]:
                    messages = ({"role": "user", "content": user}, {"role": "assistant", "content": answer})
                    out[name].append(InstructionRecord(messages, label=task, answer=answer))
                start += n
        return out

    def _play_questions(self, rng: np.random.Generator, total: int) -> list[Question]:
        """``total`` questions about distinct lines (drawn without replacement), each with four titles to choose
        from."""
        lines: dict[str, str] = {}
        for role in self._plays().roles():
            if role.play not in TITLES:
                raise ConfigError(f"data.source: the play {role.play!r} has no title here; use the built-in plays")
            for line in role.lines:
                if len(line.split()) >= MIN_WORDS:
                    lines.setdefault(line, role.play)  # a line spoken in two plays counts for the first
        pool = sorted(lines)
        if total > len(pool):
            raise ConfigError(f"data.source: the play task has {len(pool):,} lines; ask for at most that many records")
        titles = sorted(TITLES)
        questions = []
        for i in rng.permutation(len(pool))[:total]:
            line, play = pool[i], lines[pool[i]]
            others = rng.choice([p for p in titles if p != play], size=3, replace=False).tolist()
            options = [TITLES[p] for p in rng.permutation([play, *others])]
            questions.append(
                (
                    f'Which play by Shakespeare is this line from?\n"{line}"\nChoose one: {"; ".join(options)}. '
                    "Answer with the title only.",
                    TITLES[play],
                )
            )
        return questions

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}_per_task={v}" for k, v in self.sizes.items())
        return f"InstructionTasks(tasks={self.tasks!r}, {sizes}, seed={self.seed})"


def _distinct(generate: Callable[[np.random.Generator], Question], rng: np.random.Generator, n: int) -> list[Question]:
    """``n`` questions with distinct texts (drawn until there are ``n``; refused when the family has fewer)."""
    seen: dict[str, str] = {}
    attempts = 0
    while len(seen) < n:
        question, answer = generate(rng)
        seen.setdefault(question, answer)
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ConfigError(f"data.source: could not draw {n:,} distinct questions; ask for fewer records")
    return list(seen.items())

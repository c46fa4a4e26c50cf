"""Who spoils secure sums: what a server that sees only sums can still learn about a misbehaving client.

Under secure aggregation (SecAgg+ is the semi-honest protocol) a client that masks something other than its
quantised update, e.g. its vector shifted by ``M / 2``, makes the round's sum invalid (off the grid, outside
``[0, n T]``): the round has no aggregate, and the sum cannot say whose upload it was. Asking for sums over other
subsets of the same round would tell (by their differences) but would also reveal honest clients' updates, which
is what secure aggregation exists to prevent. What the server may use is what it sees anyway: which clients each
sum included, and whether the sum was valid. A client in every invalid sum and in no valid one is a **suspect**;
when one suspect is left after two invalid sums or more, it is **left out** of the secure rounds that follow
(named in a warning), so the honest clients keep training. With every client in every round (no sampling)
nothing narrows; with several misbehaving clients no one may be in every invalid sum (said so). A suspect is what
the evidence points to, not proof; the record lives in memory (a resumed run starts it again).
"""

from __future__ import annotations


class Suspects:
    """The record of valid and invalid secure sums, and the clients it points to (module docstring)."""

    def __init__(self) -> None:
        self.invalid: list[set[int]] = []  # the clients of each invalid sum
        self.valid: set[int] = set()  # every client of a valid sum
        self.left_out: set[int] = set()

    def record(self, included: list[int], valid: bool) -> str | None:
        """Record a sum of ``included``; what to say about it (``None``: nothing)."""
        if valid:
            self.valid.update(included)
            return None
        self.invalid.append(set(included))
        suspects = sorted(set.intersection(*self.invalid) - self.valid)
        if not suspects:
            return ("no client was in every invalid secure sum and in no valid one: more than one client may be "
                    "misbehaving")  # fmt: skip
        if len(suspects) == 1 and len(self.invalid) >= 2:
            self.left_out.add(suspects[0])
            return (f"client {suspects[0]} was in all {len(self.invalid)} invalid secure sums and in no valid one: it "
                    "is left out of the secure rounds that follow")  # fmt: skip
        return f"suspects (in every invalid secure sum so far, in no valid one): {suspects[:10]}"

"""Who spoils secure sums: what a server that sees only sums can still learn about a misbehaving client.

Under secure aggregation (SecAgg+ is the semi-honest protocol) a client that masks something other than its
quantised update, e.g. its vector shifted by ``M / 2``, makes the round's sum invalid (off the grid, outside
``[0, n T]``): the round has no aggregate, and the sum cannot say whose upload it was. Asking for sums over other
subsets of the same round would tell (by their differences) but would also reveal honest clients' updates, which
is what secure aggregation exists to prevent. What the server may use is what it sees anyway: which clients each
sum included, and whether the sum was valid.

The rule. With one hostile client, every invalid sum contains it, so it is in the **intersection of the invalid
sums' clients**; nothing else is certain. A valid sum clears no one: a hostile client that spoils only the rounds
that include a chosen honest client (a node learns its cohort when SecAgg+ shares keys) is in valid sums whenever
that client is not, and a rule that cleared it there named and left out the honest client instead (306 of 3,600
seeded cases within 10 rounds, issue 72). So:

- the clients in every invalid sum so far are the **candidates**, named in a warning with each invalid sum;
- a client is **left out** of the secure rounds that follow only when, after two invalid sums or more, it is the
  intersection by itself: with one hostile client that client is the hostile one, never an honest one.

The cost, chosen over leaving out the whole intersection (the attacker with its victim): a hostile client that
conditions its spoiling on another client keeps both in the intersection, so neither is left out and every round
with both stays void (the global state is kept) until the operator removes a node; the candidates name the
pair. Rounds a hostile client voids are a denial of service that SecAgg+ without proofs of correct masking cannot
prevent, whatever the rule. Two or more colluding hostile clients can leave an honest client alone in the
intersection (each spoiling only rounds with it), so with more than one hostile client a left-out client is what the
evidence points to, not proof. With every client in every round (no sampling) nothing narrows; the record lives in
memory (a resumed run starts it again).
"""

from __future__ import annotations


class Suspects:
    """The record of invalid secure sums, and the clients it points to (module docstring)."""

    def __init__(self) -> None:
        self.invalid: list[set[int]] = []  # the clients of each invalid sum
        self.left_out: set[int] = set()

    @property
    def candidates(self) -> list[int]:
        """The clients in every invalid sum so far (with one hostile client, it is among them)."""
        return sorted(set.intersection(*self.invalid)) if self.invalid else []

    def record(self, included: list[int], valid: bool) -> str | None:
        """Record a sum of ``included``; what to say about it (``None``: nothing)."""
        if valid:
            return None
        self.invalid.append(set(included))
        candidates = self.candidates
        if not candidates:
            return "no client was in every invalid secure sum: more than one client may be misbehaving"
        if len(candidates) == 1 and len(self.invalid) >= 2:
            self.left_out.add(candidates[0])
            return (
                f"client {candidates[0]} alone was in all {len(self.invalid)} invalid secure sums: it is left out "
                "of the secure rounds that follow"
            )
        listed = f"{candidates[:10]}{' ...' if len(candidates) > 10 else ''}"
        return (
            f"candidates (in every invalid secure sum so far, a hostile client among them): {listed}; no one is "
            "left out while more than one client is in every invalid sum"
        )

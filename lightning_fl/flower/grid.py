"""Pushing messages to a Flower grid and pulling their replies: what the transport's rounds and SecAgg+'s stages
(:mod:`lightning_fl.flower.secure`) both send through.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid

FIRST_POLL, LONGEST_POLL = 0.01, 0.2  # seconds between pulls for replies: doubling from the first to the longest


def exchange(
    grid: Grid,
    messages: Iterable[Message],
    timeout: float | None,
    *,
    pending: Iterable[str] = (),
    need: int | None = None,
) -> list[Message]:
    """Push ``messages``, then pull their replies until all are in or ``timeout`` seconds have passed (``None``:
    until all are in; the SuperLink answers for a node that left). The first pull follows the push at once, then
    every 10 ms doubling to 200 ms: a reply waits at most that long, where Flower's ``Grid.send_and_receive``
    sleeps 3 s between pulls. A message the SuperLink did not take (its id ``None``) gets no reply.

    ``pending``: ids of messages pushed before whose replies are pulled too (late replies, run config ``quorum``);
    ``need``: stop once this many of ``messages`` have replied instead of all (with none pushed, once any reply
    has come). Whatever stops the wait, every reply pulled is returned."""
    messages, pending = list(messages), set(pending)
    if not messages and not pending:
        return []
    started = time.monotonic()
    own = {i for i in grid.push_messages(messages) if i} if messages else set()
    need = len(own) if need is None else min(need, len(own))
    waiting, answered = own | pending, 0
    replies: list[Message] = []
    delay = FIRST_POLL
    while waiting:
        got = list(grid.pull_messages(sorted(waiting)))
        replies += got
        ids = {reply.metadata.reply_to_message_id for reply in got}
        answered += len(ids & own & waiting)
        waiting -= ids
        left = None if timeout is None else timeout - (time.monotonic() - started)
        if (answered >= need if own else bool(replies)) or (left is not None and left <= 0):
            break
        time.sleep(delay if left is None else min(delay, left))
        delay = min(2 * delay, LONGEST_POLL)
    return replies

"""The server round: :class:`~lightning_fl.federated.server.round.RoundRunner` and the round it carries, how uploads are
collected and gated, the mechanisms as stages (:mod:`.stages`, with the one builder), the strategies, the
simulated attacks, and the record of spoiled secure sums."""

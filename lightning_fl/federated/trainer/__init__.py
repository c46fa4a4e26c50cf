"""Orchestration: :class:`~lightning_fl.federated.FederatedTrainer` (its arguments and their checks, its set-up, the
callbacks, the evaluation and the run's summary) and the module contract it trains (``FederatedModule``)."""

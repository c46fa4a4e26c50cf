"""Client training: the job a client receives (:class:`~lightning_fl.federated.clients.local.ClientJob`), the runners
that train one client, a vectorised cohort or clients in lockstep (with or without DP-SGD), and the transports that
deliver a round's job to its clients."""

"""Run a config on Flower: our round loop in a ServerApp, our client runner in a ClientApp.

Needs the ``flower`` extra (``pip install "lightning-fl[flower]"``, flwr 1.42). ``lightning_fl.flower.server:app``
and ``lightning_fl.flower.client:app`` are the app components ``pyproject.toml`` declares for ``flwr run``;
:func:`~lightning_fl.flower.server.server_app` builds a ServerApp for ``flwr.simulation.run_simulation``.
See docs/deploy.md.
"""

try:
    import flwr  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the install
    from lightning_fl.errors import UserError

    raise UserError('lightning_fl.flower needs Flower: pip install "lightning-fl[flower]" (flwr 1.42)') from err

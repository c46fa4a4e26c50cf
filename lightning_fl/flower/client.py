"""The ClientApp Flower starts for each message a SuperNode receives (``lightning_fl.flower.client:app``).

With ``worker`` in the node's ``--node-config`` (a Unix socket path), it is a thin proxy: it imports no torch and
hands the message and the node's context to that node's warm worker (:mod:`lightning_fl.flower.worker`), which
runs the node's app and keeps torch, Lightning and the built run loaded between messages. Without it, it runs
the node's app (:mod:`lightning_fl.flower.node`, where the node config's other keys are described) in this
process, rebuilding the run for every message as Flower's per-message process requires.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

app = ClientApp()


@app.query()
def query(message: Message, context: Context) -> Message:
    """The server's hello (which client this node serves), through the worker if the node has one."""
    return handle(message, context)


@app.train()
def train(message: Message, context: Context) -> Message:
    """A round's training (and SecAgg+'s stages), through the worker if the node has one."""
    return handle(message, context)


def handle(message: Message, context: Context) -> Message:
    path = context.node_config.get("worker")
    if path in (None, ""):
        from lightning_fl.flower.node import app as node_app

        return node_app(message, context)
    from lightning_fl.flower.worker import forward

    return forward(str(path), message, context)

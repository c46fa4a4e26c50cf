"""A ClientApp for the SecAgg+ deployment test: ours, plus nodes told to misbehave.

The test names a control folder in ``LIGHTNING_FL_TEST_CONTROL``. A node whose partition id ``p`` finds
``stall-<p>`` there stops at SecAgg+'s unmask stage, after its masked upload, writes its process id to
``stalled-<p>`` and waits to be killed; one that finds ``hostile-<p>`` replaces its masked upload with bytes
that are not an array. Nothing here is part of the package.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from flwr.clientapp import ClientApp

from lightning_fl.flower import node as ours

CONFIGS = "secaggplus_configs"


def misbehave(message, context, call_next):
    control = Path(os.environ.get("LIGHTNING_FL_TEST_CONTROL", "/nonexistent"))
    me = context.node_config.get("partition-id")
    configs = message.content.config_records.get(CONFIGS) if message.has_content() else None
    stage = configs.get("stage") if configs is not None else None
    if stage == "unmask" and (control / f"stall-{me}").exists():
        (control / f"stalled-{me}").write_text(str(os.getpid()))
        time.sleep(600)  # the test kills this node now
    reply = call_next(message, context)
    if stage == "collect_masked_vectors" and (control / f"hostile-{me}").exists():
        reply.content.config_records[CONFIGS]["masked_params"] = [b"not an array", b"at all"]
    return reply


app = ClientApp(mods=[misbehave, ours._secure_aggregation_if_asked])
app.query()(ours.hello)
app.train()(ours.train)

"""The clock's arrivals at their place in the round: it times what the stages say each client downloads (so it runs
after every stage's ``start``, the compressed broadcast's included), and it says once when an upload's bytes differ
from what it timed."""

import warnings

import lightning as L
import pytest
import torch

from helpers import CraftedClients, Population
from lightning_fl.compress import FP32
from lightning_fl.federated import ByteLedger, Clock, FedAvg, LocalTraining
from lightning_fl.federated.arrivals import Timed, layout_bytes
from lightning_fl.federated.server.collect import Uploads
from lightning_fl.federated.server.round import RoundRunner
from lightning_fl.federated.server.stages import Stage

#: 1 Mbit/s down and up, no latency, no spread, no compute: a client's download takes 8 * bytes microseconds.
SLOW = {"step_s": 1e-9, "device_sigma": 0.0, "link_sigma": 0.0, "latency_s": 0.0, "down_mbps": 1.0, "up_mbps": 1.0}


class SmallDownloads(Stage):
    """What the compressed broadcast does at ``start``: says each sampled client downloads ``nbytes``."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def start(self, rnd):
        rnd.downloads = dict.fromkeys(rnd.sampled, self.nbytes)


def one_round(arrivals, stages, rounds=1, clients=3):
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[])
    local = LocalTraining(steps=1)
    collection = Uploads(CraftedClients(lambda c, r: torch.full((6,), 0.1)), FP32(), local, arrivals=arrivals)
    runner = RoundRunner(fabric, FedAvg(), collection, stages, ByteLedger(clients))
    state, out = {"a": torch.zeros(2, 2), "b": torch.ones(2)}, []
    for r in range(rounds):
        state, metrics = runner.run(None, Population(clients), state, r, 0, clients)
        out.append(metrics)
    return out


def test_the_clock_times_the_downloads_the_stages_set_at_start():
    """A compressed broadcast says at ``start`` what each client downloads; the clock, after every stage's ``start``,
    times those bytes (1,000 bytes at 1 Mbit/s: 8 ms), not the full state's (24 bytes: 0.192 ms)."""
    timed = Timed(Clock(**SLOW), LocalTraining(steps=1), layout_bytes(FP32()))
    (metrics,) = one_round(timed, [SmallDownloads(1000)])
    assert metrics["time/client_download_s"] == pytest.approx(8000 / 1e6)
    assert metrics["comm/round_down_bytes"] == 3 * 1000


def test_the_clock_warns_once_when_an_upload_differs_from_what_it_timed():
    timed = Timed(Clock(**SLOW), LocalTraining(steps=1), lambda state: 999)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one_round(timed, [], rounds=3)
    said = [str(w.message) for w in caught if "trainer.clock timed" in str(w.message)]
    assert said == [
        "trainer.clock timed each upload as 999 bytes (the codec's layout), but client 0 sent 24: the "
        "simulated times are off by that difference"
    ]

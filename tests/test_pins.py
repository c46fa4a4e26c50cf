"""A node's ``require-privacy`` pin is checked against the mechanism's class, so a subclass keeps its pin and another
mechanism is named."""

from types import SimpleNamespace

from lightning_fl.flower.pins import pin_problem
from lightning_fl.privacy import CentralDP, LocalDP


class TunedLocalDP(LocalDP):
    """A user's own variant of local DP (still local DP: each client noises its own upload)."""


def client_side(stage):
    return SimpleNamespace(upload_stage=stage, secure=None, dp_sgd=None)


def test_a_subclass_of_the_pinned_mechanism_passes_its_pin_and_another_mechanism_is_named():
    assert (
        pin_problem(client_side(LocalDP(clip_norm=1.0, noise_multiplier=1.0)), {"require-privacy": "LocalDP"}) is None
    )
    tuned = client_side(TunedLocalDP(clip_norm=1.0, noise_multiplier=1.0))
    assert pin_problem(tuned, {"require-privacy": "LocalDP"}) is None
    central = client_side(CentralDP(clip_norm=1.0, noise_multiplier=1.0))
    assert pin_problem(central, {"require-privacy": "LocalDP"}) == (
        "this node pins require-privacy LocalDP, and the run's client-side trainer.privacy is CentralDP"
    )
    assert pin_problem(client_side(None), {"require-privacy": "DistributedDP"}) == (
        "this node pins require-privacy DistributedDP, and the run's client-side trainer.privacy is none"
    )

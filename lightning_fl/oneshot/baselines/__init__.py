"""One-shot and local Bayesian baselines of the FMP paper (section V-1), one file each.

Every baseline is a :class:`lightning_fl.oneshot.base.OneShotMethod`: list it under ``model.methods``
(by its short name, e.g. ``{"class_path": "CBNN"}``) and the same ``test`` command evaluates it on the same
tasks as FMP.
"""

from lightning_fl.oneshot.baselines.bpc import BPC
from lightning_fl.oneshot.baselines.cbnn import CBNN
from lightning_fl.oneshot.baselines.cfmp import CFMP
from lightning_fl.oneshot.baselines.fedlpa import FedLPA
from lightning_fl.oneshot.baselines.laplace import BNN, LBNN

__all__ = ["BNN", "BPC", "CBNN", "CFMP", "LBNN", "FedLPA"]

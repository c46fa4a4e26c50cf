"""One-shot and local Bayesian baselines of the FMP paper (section V-1), one file each.

Every baseline is a :class:`lightning_fl.oneshot.base.OneShotMethod`: list it under ``model.methods``
and the same ``test`` command evaluates it on the same tasks as FMP.
"""

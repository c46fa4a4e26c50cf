"""jsonargparse's lazy defaults, made without walking the stack (``lightning_fl.trainer_api.lazy_instance``)."""

from __future__ import annotations

import sys


def test_lazy_instance_is_jsonargparses_without_the_stack_walk():
    import numpy as np
    from jsonargparse import ArgumentParser
    from jsonargparse import lazy_instance as theirs

    from lightning_fl.data import IID, Dirichlet, Partitioner
    from lightning_fl.trainer_api import lazy_instance

    this_module = sys.modules[__name__]
    ours = lazy_instance(Dirichlet, alpha=0.3)
    lazy_class = type(ours)
    assert lazy_class.__name__ == "LazyInstance_Dirichlet" and lazy_class.__module__ == __name__
    assert this_module.LazyInstance_Dirichlet is lazy_class and type(lazy_instance(Dirichlet)) is lazy_class
    assert type(theirs(Dirichlet, alpha=0.3)) is lazy_class  # jsonargparse finds and reuses the same class
    assert ours.lazy_get_init_data() == theirs(Dirichlet, alpha=0.3).lazy_get_init_data()
    assert isinstance(ours, Dirichlet) and "alpha" not in vars(ours)
    ours.assign(np.arange(40) % 2, 2, np.random.default_rng(0))  # a method's first call builds it
    assert ours.alpha == 0.3

    parser = ArgumentParser()
    parser.add_argument("--partition", type=Partitioner, default=lazy_instance(IID))
    assert "class_path: lightning_fl.data.IID" in parser.dump(parser.parse_args([]))

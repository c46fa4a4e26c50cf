"""A broken mechanism for the privacy audit to catch: ``python -m lightning_fl`` with central DP releasing ``1 / K`` of
the noise its accountant charges for.

    python benchmarks/_noise_cut.py K fit --config ... --trainer.privacy CentralDP ...

The positive control of ``benchmarks/privacy_audit.py --noise-cut K``: the accountant still composes the configured
noise multiplier ``z``, while every Gaussian draw of the central mechanism is divided by ``K`` (a released noise
multiplier ``z / K``). An audit whose verdicts can fail must fail here. Never a way to run anything private.
"""

from __future__ import annotations

import sys


def main() -> None:
    cut = float(sys.argv[1])
    import lightning_fl.privacy.central as central

    real = central.randomness

    class Cut:
        """Every draw of a real source divided by ``cut``."""

        def __init__(self, source):
            self.source = source

        def randn(self, *args, **kwargs):
            return self.source.randn(*args, **kwargs) / cut

    central.randomness = lambda *args, **kwargs: Cut(real(*args, **kwargs))
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    from lightning_fl.__main__ import main as run

    run()


if __name__ == "__main__":
    main()

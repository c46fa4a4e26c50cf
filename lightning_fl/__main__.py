"""``python -m lightning_fl fit|validate|test|export ...``: :func:`lightning_fl.cli.command.main`, after the pre-check.

The pre-check (:mod:`lightning_fl.cli.precheck`) answers ``--help`` (``-h``, no arguments), a mistyped subcommand
and a ``--config`` file that does not exist, breaks YAML's syntax or has an unknown top-level key before torch and
Lightning are imported (a fraction of a second instead of five on a small machine); everything else goes to the
full parser.
"""

import sys

from lightning_fl.cli.precheck import precheck


def main() -> None:
    argv = sys.argv[1:]
    precheck(argv)  # exits with code 2 and one line on a mistake it can see
    from lightning_fl.cli import main as run

    run(argv)


if __name__ == "__main__":
    main()

"""The pre-check: config mistakes answered before torch is imported, in the full parser's words."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import CONFIGS, REPO
from lightning_fl.cli.precheck import SUBCOMMANDS, TOP_KEYS, check

DIGITS = str(CONFIGS / "pretrain_digits.yaml")
BAD_YAML = "trainer:\n  init_args:\n    rounds: 1\n   devices: 1\n"

# Runs ``python -m lightning_fl ARGS`` (as runpy does) once per case in one process; after each, what it said (on
# stdout and stderr), its exit code and which heavy modules were loaded by then.
PROBE = """
import contextlib, io, json, runpy, sys
out = []
for argv in json.loads(sys.argv[1]):
    sys.argv = ["lightning_fl", *argv]
    said, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("lightning_fl", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            code = stop.code
    heavy = [m for m in ("torch", "lightning", "jsonargparse", "numpy") if m in sys.modules]
    out.append({"code": code, "out": said.getvalue(), "err": err.getvalue(), "heavy": heavy})
print(json.dumps(out))
"""


def probe(argvs: list[list[str]], cwd) -> list[dict]:
    """:data:`PROBE`'s report of each ``python -m lightning_fl ARGV``, run one after another in one process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argvs)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_mistakes_are_answered_before_torch_is_imported(tmp_path):
    (tmp_path / "bad.yaml").write_text(BAD_YAML)
    (tmp_path / "typo.yaml").write_text("modle:\n  class_path: Classifier\n")
    cases = {
        "missing": (["fit", "--config", "nope.yaml"], f"error: fit: config file {tmp_path / 'nope.yaml'} does not"),
        "syntax": (["fit", "-c", "bad.yaml"], "error: fit: config file bad.yaml: YAML syntax error at line 4, col"),
        "top key": (["fit", "--config", DIGITS, "--config=typo.yaml"], "error: fit: unknown key 'modle'. Did you"),
        "subcommand": (["fitt", "--config", DIGITS], "error: unknown subcommand 'fitt'. Did you mean 'fit'?"),
    }
    results = probe([argv for argv, _ in cases.values()], tmp_path)
    for (name, (_, expected)), result in zip(cases.items(), results, strict=True):
        assert result["code"] == 2, name
        assert result["err"].startswith(expected), (name, result["err"])
        assert len(result["err"].splitlines()) == 2, name  # the line and the hint
        assert result["heavy"] == [], f"{name}: answered after importing {result['heavy']}"


def test_the_top_level_help_is_answered_before_torch_is_imported(tmp_path):
    """``--help``, ``-h`` and no arguments (an error: code 2) print the subcommands, an example, where the configs
    and the docs are, without the seconds of torch's and Lightning's imports (a subcommand's help needs them)."""
    results = probe([["--help"], ["-h"], []], tmp_path)
    for argv, result in zip(["--help", "-h", "no arguments"], results, strict=True):
        assert result["heavy"] == [], f"{argv}: answered after importing {result['heavy']}"
        missing = argv == "no arguments"
        text = result["err"] if missing else result["out"]
        assert result["code"] == (2 if missing else 0), argv
        start = "error: give a subcommand: fit, validate, test, export.\n\n" if missing else ""
        assert text.startswith(f"{start}usage: python -m lightning_fl {{fit,validate,test,export}} --config FILE"), argv
        for name, what in SUBCOMMANDS.items():
            assert f"  {name} " in text and what in text, (argv, name)
        assert "  python -m lightning_fl fit --config configs/quickstart.yaml\n" in text, argv
        assert "configs/ in the repository" in text and "docs/index.md" in text and "mkdocs serve" in text, argv
        # what fit --help lists (test_the_subcommand_parser_has_exactly_the_top_keys), and where every key is
        assert "fit --help lists the top-level keys" in text and "--print_config every key" in text, argv


def full_parser_message(argv: list[str]) -> str:
    """What the full parser (no pre-check) says about ``argv``."""
    from lightning_fl.cli import ConfigParseError, build

    with pytest.raises(ConfigParseError) as refused:
        build(argv)
    return str(refused.value)


@pytest.mark.parametrize(
    "config",
    [
        None,  # no such file
        BAD_YAML,
        "trainer:\n  init_args:\n    devices: [0, 1\n",  # an unclosed bracket
        "modle:\n  class_path: Classifier\n",
        "modle.init_args.lr: 0.1\n",  # a dotted key names its first part
        "seed_everything: 1\nthreds: 2\n",
        "trainer.foo: 1\n",  # under a top-level key: the full parser's to name
    ],
    ids=["missing", "syntax", "unclosed", "top key", "dotted", "second key", "nested"],
)
def test_the_precheck_says_what_the_full_parser_says(config, in_tmp):
    if config is not None:
        (in_tmp / "extra.yaml").write_text(config)
    argv = ["fit", "--config", DIGITS, "--config", "extra.yaml"]
    mine = check(argv)
    if config == "trainer.foo: 1\n":
        assert mine is None
        return
    assert mine is not None and mine == full_parser_message(argv)


def test_the_precheck_says_what_the_full_parser_says_of_a_subcommand_and_an_inline_config(in_tmp):
    for argv in (["fitt", "--config", DIGITS], ["fit", "--config", DIGITS, "--config", "{modle: 1}"]):
        mine = check(argv)
        assert mine is not None and mine == full_parser_message(argv)


@pytest.mark.parametrize(
    "config",
    [
        "modle: {}\n",  # sets nothing: jsonargparse accepts it
        "modle: {a: {}}\n",
        "__path__: x\n",
        "validate: {}\n",
        "model.init_args.lr: 0.5\n",
        "model:\n  init_args:\n    lr: 0.5\n",
        "[1, 2]\n",  # not a mapping: the full parser's to refuse
        "",
        "when: 2001-13-45\n",  # a value the safe loader cannot build: left to jsonargparse's loader
    ],
)
def test_the_precheck_leaves_what_it_cannot_be_sure_of(config, in_tmp):
    (in_tmp / "extra.yaml").write_text(config)
    assert check(["fit", "--config", DIGITS, "--config", "extra.yaml"]) is None


def test_the_precheck_reads_no_further_than_the_parser():
    assert check(["fit", "--config", DIGITS]) is None
    assert check(["fit", "--help", "--config", "nope.yaml"]) is None  # help is printed first
    assert check(["fit", "--model.help", "Classifier", "--config", "nope.yaml"]) is None
    assert check(["fit", "--config", "nope.yaml", "--help"]) is not None  # the config is read first
    assert check(["--help"]) is None and check([]) is None
    assert check(["fit", "--config", "{model: {init_args: {lr: 0.5}}}"]) is None  # an inline config


def test_the_subcommand_parser_has_exactly_the_top_keys():
    from lightning_fl.cli.parser import _subcommand_parser

    parser = _subcommand_parser("fit")
    keys = [a.dest for a in parser._actions if a.dest not in ("help", "print_config") and not a.dest.endswith(".help")]
    assert keys == ["config", *(k for k in TOP_KEYS if k != "config")]

"""Every shipped YAML parses through the real CLI parser and builds its plug-ins."""

import re
import shlex

import pytest
import yaml

from conftest import CONFIGS
from lightning_fl.cli import build_parser

CONFIG_FILES = sorted(CONFIGS.glob("*.yaml"))


def test_configs_are_shipped():
    names = {p.name for p in CONFIG_FILES}
    for dataset in ("cifar10", "cifar100", "tinyimagenet", "fashion_mnist", "digits"):
        assert f"pretrain_{dataset}.yaml" in names
    for dataset in ("cifar10", "cifar100", "tinyimagenet", "fashion_mnist"):
        assert f"flite_{dataset}.yaml" in names
    assert "quickstart.yaml" in names


def loads_a_pretrained_model(path):
    """Configs whose network is a real pretrained model (SmolLM2: a 98 MB download and 20 s to load): built here only
    in the slow suite; tests/test_llm_federated.py runs each of them on a tiny model in the default one."""
    return pytest.param(path, marks=pytest.mark.slow) if "SmolLM2" in path.read_text() else path


@pytest.mark.parametrize("path", [loads_a_pretrained_model(p) for p in CONFIG_FILES], ids=lambda p: p.name)
def test_config_parses_and_instantiates(path):
    text = path.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any("python -m lightning_fl" in line for line in header), "header must give the command"
    assert any("Expected" in line for line in header) and any("Time" in line for line in header)
    assert set(yaml.safe_load(text)) <= {"seed_everything", "trainer", "model", "data", "ckpt_path"}
    parser = build_parser()
    cfg = parser.parse_args(["fit", "--config", str(path)])
    init = parser.instantiate(cfg) if hasattr(parser, "instantiate") else parser.instantiate_classes(cfg)
    run = init.fit
    for method in ("fit", "validate", "test"):
        assert callable(getattr(run.trainer, method))
    if hasattr(run.model, "check_data"):
        run.model.check_data(run.data)  # classes, channels and image size agree


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_private_configs_draw_their_noise_from_the_os(path):
    """A shipped config of a private run seeds none of its randomness (noise, cohorts, DP-SGD's sampling, secure
    rounding): a seed is public, so a config copied into a deployment must not carry one. A sweep that must
    reproduce pins it in its own spec (``config_args``)."""
    trainer = (yaml.safe_load(path.read_text()).get("trainer") or {}).get("init_args") or {}
    for key, seed in (("privacy", "noise_seed"), ("dp_sgd", "noise_seed"), ("secure_aggregation", "rounding_seed")):
        plugin = trainer.get(key)
        if isinstance(plugin, dict):
            assert (plugin.get("init_args") or {}).get(seed) is None, f"trainer.{key}.{seed} in {path.name}"


def header_commands(path):
    """The ``python -m lightning_fl ...`` commands given in a config's header (continuations joined)."""
    lines = [line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#")]
    commands, current = [], None
    for line in lines:
        if current is not None:
            current += " " + line.rstrip("\\").strip()
            if not line.endswith("\\"):
                commands.append(current)
                current = None
        elif line.startswith("python -m lightning_fl"):
            if line.endswith("\\"):
                current = line.rstrip("\\").strip()
            else:
                commands.append(line)
    return commands


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_commands_in_the_header_parse(path):
    commands = header_commands(path)
    assert commands
    for command in commands:
        command = re.sub(r"\[[^\]]*\]", "", command.split("#")[0])  # drop optional [--key VALUE] parts
        args = shlex.split(command)[3:]
        args = ["/dev/null" if a.startswith("runs/") and a.endswith(".ckpt") else a for a in args]
        args = [str(CONFIGS.parent / a) if a.startswith("configs/") else a for a in args]
        build_parser().parse_args(args)

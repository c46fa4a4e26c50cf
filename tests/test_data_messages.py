"""A missing data set's message names the config key that is right for the config in use, and that key works."""

import re

import pytest

from conftest import CONFIGS, run_cli

FAMILIES = {  # config: the key of its data source
    "flite_cifar10.yaml": "data.source",  # federated image configs (FederatedDataModule)
    "pretrain_tinyimagenet.yaml": "data.source",  # centralised image configs
    "fmp_cifar10.yaml": "data.features.source",  # FMP on features of a trained extractor
    "fmp_mnist.yaml": "data.features.source",  # FMP on pixel features
    "flite_shakespeare.yaml": "data.source",  # text
}


@pytest.mark.parametrize("config", sorted(FAMILIES))
def test_a_missing_data_set_names_the_key_of_this_config_and_the_key_works(config, in_tmp, capsys):
    (in_tmp / "empty").mkdir()
    key = FAMILIES[config]
    args = ["fit", "--config", str(CONFIGS / config), f"--{key}.root", "empty", f"--{key}.download", "false"]
    assert run_cli(*args) == 2
    err = capsys.readouterr().err
    err = err[err.index("error: ") :]  # (Lightning may log before it, to a stream an earlier test's capture closed)
    assert "was not found" in err and "Traceback" not in err
    suggested = set(re.findall(r"--([\w.]+)\.root DIR", err))
    assert suggested == {key}  # the fix names this config's key (and no other)

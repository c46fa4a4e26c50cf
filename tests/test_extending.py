"""docs/extending.md: its compressor and method, selected by its config, run through the CLI."""

import torch
import yaml

from conftest import REPO, run_cli


def blocks(text: str, lang: str) -> list[str]:
    return [b.split("```", 1)[0] for b in text.split(f"```{lang}\n")[1:]]


def test_the_documented_compressor_and_method_run(in_tmp, monkeypatch):
    doc = (REPO / "docs" / "extending.md").read_text()
    code = "\n".join(blocks(doc, "python"))
    config, _ = blocks(doc, "yaml")
    package = in_tmp / "my_fl"
    package.mkdir()
    (package / "__init__.py").write_text(code)
    (in_tmp / "my_partial_sign.yaml").write_text(config)
    monkeypatch.syspath_prepend(str(in_tmp))
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    args = ["--trainer.rounds", "2", "--model.pretraining.epochs", "1"]
    assert run_cli("fit", "--config", str(in_tmp / "my_partial_sign.yaml"), *args) == 0
    (ckpt,) = (in_tmp / "runs" / "partial_sign").glob("version_*/checkpoints/last.ckpt")
    ckpt = torch.load(ckpt, weights_only=True)
    assert sorted(ckpt["global_state"]) == ["backbone.fc.bias", "backbone.fc.weight"]
    assert ckpt["history"][-1]["comm/client_up_bytes"] == 4096 + 16 + 8
    assert set(ckpt["codec"]["residuals"]) == {str(c) for c in range(8)}
    assert yaml.safe_load(config)["trainer"]["init_args"]["codec"]["class_path"] == "my_fl.ScaledSign"


def test_the_documented_strategy_runs_from_its_config(in_tmp, monkeypatch):
    doc = (REPO / "docs" / "extending.md").read_text()
    package = in_tmp / "my_fl"
    package.mkdir()
    (package / "__init__.py").write_text("\n".join(blocks(doc, "python")))
    _, config = blocks(doc, "yaml")
    (in_tmp / "my_clipped.yaml").write_text(config)
    monkeypatch.syspath_prepend(str(in_tmp))
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    args = ["--trainer.rounds", "2", "--model.pretraining.epochs", "1"]
    assert run_cli("fit", "--config", str(in_tmp / "my_clipped.yaml"), *args) == 0
    (ckpt,) = (in_tmp / "runs" / "clipped").glob("version_*/checkpoints/last.ckpt")
    ckpt = torch.load(ckpt, weights_only=True)
    assert ckpt["strategy_class"] == "NormClippedMean"
    last = ckpt["history"][-1]
    assert last["strategy/clipped"] >= 1 and last["fed/attacked_clients"] == 1
    assert "fed/identity_error" not in last and torch.isfinite(ckpt["global_state"]["mapping.latent"]).all()
    assert run_cli("fit", "--config", str(in_tmp / "my_clipped.yaml"), *args, "--trainer.strategy.max_norm", "0") == 2

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import CONFIGS, REPO, run_cli
from lightning_fl.cli import main
from lightning_fl.cli.build_errors import build_error
from lightning_fl.compress import FP32
from lightning_fl.data import Digits
from lightning_fl.errors import ConfigError

DIGITS = str(CONFIGS / "pretrain_digits.yaml")
QUIET = ["--trainer.enable_model_summary", "false"]


def events(run_dir: Path) -> EventAccumulator:
    return EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0}).Reload()


def test_fit_writes_config_events_and_checkpoints_then_resumes_at_epoch_2(in_tmp):
    assert run_cli("fit", "--config", DIGITS, "--trainer.max_epochs", "1", *QUIET) == 0
    run = in_tmp / "runs" / "pretrain_digits" / "version_0"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["seed_everything"] == 0 and saved["trainer"]["init_args"]["max_epochs"] == 1
    assert saved["model"]["init_args"]["recipe"]["nesterov"] is False  # defaults are written too
    assert saved["data"]["init_args"]["source"]["class_path"] == "lightning_fl.data.Digits"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch000.ckpt", "last.ckpt"]
    acc = events(run)
    assert {"train/loss_epoch", "val/acc", "val/ece", "val/loss"} <= set(acc.Tags()["scalars"])
    assert {"config/text_summary", "data/partition/text_summary"} <= set(acc.Tags()["tensors"])
    assert len(acc.Scalars("val/acc")) == 1

    last = run / "checkpoints" / "last.ckpt"
    assert run_cli("fit", "--config", DIGITS, "--trainer.max_epochs", "2", "--ckpt_path", str(last), *QUIET) == 0
    resumed = in_tmp / "runs" / "pretrain_digits" / "version_1"
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["epoch001.ckpt", "last.ckpt"]
    state = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)
    first = torch.load(last, weights_only=True)
    assert state["epoch"] == 1 and state["global_step"] == 2 * first["global_step"]
    assert [e.step for e in events(resumed).Scalars("epoch")][-1] == state["global_step"] - 1


def test_validate_and_test_load_the_checkpoint_and_say_where_they_wrote(in_tmp, capsys):
    """An evaluation writes its config and logs to a new folder of its own (``test_N``, ``validate_N``), named in
    what it prints; fits keep numbering ``version_N``."""
    assert run_cli("fit", "--config", DIGITS, "--trainer.max_epochs", "2", *QUIET) == 0
    runs = Path("runs") / "pretrain_digits"  # (in in_tmp)
    ckpt = str(runs / "version_0" / "checkpoints" / "last.ckpt")
    capsys.readouterr()
    (metrics,) = main(["test", "--config", DIGITS, "--ckpt_path", ckpt, *QUIET])
    assert set(metrics) == {"test/acc", "test/ece", "test/loss"} and metrics["test/acc"] > 0.8
    (val,) = main(["validate", "--config", DIGITS, "--ckpt_path", ckpt, *QUIET])
    assert val["val/acc"] == pytest.approx(metrics["test/acc"])  # val is the test split without val_fraction
    out = capsys.readouterr().out
    for folder in ("test_0", "validate_0"):
        assert f"{folder.split('_')[0]}: written to {runs / folder} (a new folder for this evaluation)\n" in out
        assert (runs / folder / "config.yaml").is_file()
    assert out.endswith(
        "validate_0 (a new folder for this evaluation)\n  val/* is the test split (no validation "
        "split: data.val_fraction 0)\n"
    )
    assert run_cli("fit", "--config", DIGITS, "--trainer.max_epochs", "1", *QUIET) == 0
    assert sorted(p.name for p in runs.iterdir()) == ["test_0", "validate_0", "version_0", "version_1"]


def test_print_config_shows_every_default(capsys):
    assert run_cli("fit", "--config", DIGITS, "--model.recipe.lr", "0.1", "--print_config") == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["init_args"]["recipe"]["lr"] == 0.1
    assert printed["model"]["init_args"]["recipe"]["nesterov"] is False
    assert printed["model"]["init_args"]["label_smoothing"] == 0.0
    assert printed["data"]["init_args"]["partition"]["class_path"] == "lightning_fl.data.IID"


def test_a_partial_recipe_keeps_the_methods_own_defaults(capsys):
    """``model.recipe`` given in part: the other keys are the method's defaults (FLITE's), not Recipe's."""
    from lightning_fl.methods import LATENT_RECIPE, Recipe

    assert (
        run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--model.recipe.lr", "0.3", "--print_config") == 0
    )
    recipe = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["recipe"]
    expected = dataclasses.replace(LATENT_RECIPE, lr=0.3, grad_clip=1.0)  # quickstart.yaml sets grad_clip, lr, ...
    assert recipe == dataclasses.asdict(expected) and Recipe(**recipe) != Recipe(lr=0.3, grad_clip=1.0)
    assert recipe["schedule"] == "constant" and recipe["warmup_epochs"] == 0.0  # Recipe()'s are cosine and 3


def test_one_shot_classes_have_short_names_without_a_config(capsys):
    """Importing the package imports the one-shot package, so its classes resolve like ``Classifier`` does."""
    args = ["--model", "FMPMetaLearner", "--model.summariser", "MeanPooling", "--data", "FederatedTasks"]
    args += ["--data.features", "PixelFeatures", "--model.methods", '[{"class_path": "CBNN"}, {"class_path": "MP"}]']
    assert run_cli("fit", *args, "--print_config") == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    methods = [m["class_path"] for m in printed["model"]["init_args"]["methods"]]
    assert methods == ["lightning_fl.oneshot.baselines.CBNN", "lightning_fl.oneshot.MP"]
    assert printed["model"]["class_path"] == "lightning_fl.oneshot.FMPMetaLearner"
    assert printed["model"]["init_args"]["summariser"]["class_path"] == "lightning_fl.oneshot.MeanPooling"
    assert printed["data"]["init_args"]["features"]["class_path"] == "lightning_fl.oneshot.PixelFeatures"


def test_short_class_names_and_a_plugin_trainer(in_tmp):
    import helpers

    args = [
        "--model",
        "Classifier",
        "--model.backbone",
        "SmallCNN",
        "--model.backbone.image_size",
        "8",
        "--model.num_classes",
        "10",
        "--data",
        "FederatedDataModule",
        "--data.source",
        "Digits",
        "--data.partition",
        "Dirichlet",
        "--data.partition.alpha",
        "0.3",
    ]
    assert run_cli("fit", "--trainer", "RecordingTrainer", "--trainer.rounds", "3", *args) == 0
    trainer = helpers.RecordingTrainer.last
    assert trainer.rounds == 3
    ((name, model, data, ckpt),) = trainer.calls
    assert (name, type(model).__name__, type(data).__name__, ckpt) == ("fit", "Classifier", "FederatedDataModule", None)
    assert data.partition.alpha == 0.3
    assert "class_path: helpers.RecordingTrainer" in trainer.config_yaml
    assert run_cli("test", "--trainer", "helpers.RecordingTrainer", "--seed_everything", "true", *args) == 0
    assert helpers.RecordingTrainer.last.calls[0][0] == "test"
    assert "seed_everything: 0\n" in helpers.RecordingTrainer.last.config_yaml  # the concrete seed is recorded


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


BAD_CASES = {
    "misspelt key": (["--model.num_clases", "3"], ["model.num_clases", "'model.num_classes'?", "Accepted: backbone"]),
    "misspelt recipe key": (["--model.recipe.lrr", "0.1"], ["model.recipe.lrr", "Did you mean 'model.recipe.lr'?"]),
    "misspelt nested key": (["--data.source.test_fractoin", "0.1"], ["data.source.test_fractoin", "test_fraction"]),
    "misspelt trainer key": (["--trainer.max_epoch", "3"], ["trainer.max_epoch", "'trainer.max_epochs'"]),
    "wrong type": (["--model.recipe.lr", "fast"], ["model.recipe.lr: expected float, got 'fast'"]),
    "wrong literal": (["--model.head", "orthognal"], ["model.head", "'orthogonal', 'kaiming', 'trainable'"]),
    "unknown class": (["--data.source", "CIFAR11"], ["data.source: unknown class 'CIFAR11'", "CIFAR10, CIFAR100"]),
    "unknown trainer": (["--trainer", "Trainr"], ["trainer: unknown class 'Trainr'", "Trainer"]),
    "missing config file": (["--config", "nope.yaml"], ["config file", "nope.yaml does not exist"]),
    "invalid value": (["--model.recipe.lr", "-1"], ["model.recipe.lr must be > 0"]),
    "missing checkpoint": (["--ckpt_path", "gone.ckpt"], ["ckpt_path gone.ckpt does not exist"]),
    "missing data set": (
        [
            "--data.source",
            "CIFAR10",
            "--data.source.root",
            "c10",
            "--data.source.download",
            "false",
            "--model.backbone",
            "ResNet18",
            "--model.backbone.width",
            "8",
            "--model.backbone.norm_groups",
            "4",
        ],
        ["CIFAR-10: the root given (c10) does not exist and download is off", "fix the path, or turn download on"],
    ),
    "mismatched classes": (["--model.num_classes", "7"], ["model.num_classes=7 but the data has 10 classes"]),
}


@pytest.mark.parametrize("case", list(BAD_CASES), ids=list(BAD_CASES))
def test_bad_input_exits_2_with_one_clear_message(case, in_tmp, capsys):
    args, expected = BAD_CASES[case]
    assert run_cli("fit", "--config", DIGITS, *args, "--trainer.max_epochs", "1", *QUIET) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    for text in expected:
        assert text in err
    assert "Traceback" not in err


def test_yaml_typos_are_named(in_tmp, capsys):
    top = write(in_tmp / "top.yaml", "modle:\n  class_path: Classifier\n")
    assert run_cli("fit", "--config", DIGITS, "--config", top) == 2
    assert "unknown key 'modle'. Did you mean 'model'?" in capsys.readouterr().err
    nested = write(in_tmp / "nested.yaml", "model:\n  init_args:\n    recipe:\n      wieght_decay: 0.1\n")
    assert run_cli("fit", "--config", DIGITS, "--config", nested) == 2
    assert "Did you mean 'model.recipe.weight_decay'?" in capsys.readouterr().err
    assert run_cli("fitt", "--config", DIGITS) == 2
    assert "unknown subcommand 'fitt'. Did you mean 'fit'?" in capsys.readouterr().err


QUICKSTART = str(CONFIGS / "quickstart.yaml")  # a FederatedTrainer
FMP = str(CONFIGS / "fmp_digits.yaml")  # lightning.Trainer, a model with an optional summariser class
DP = str(CONFIGS / "dp_fedavg_fashion_mnist.yaml")  # CentralDP, noise_seed: null
DP_SGD = str(CONFIGS / "dp_sgd_fashion_mnist.yaml")  # DPSGD, noise_seed: null


class StrictDigits(Digits):
    """A data source that refuses a value without naming its key."""

    def __init__(self, strictness: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        if strictness:
            raise ConfigError("strictness must be 0 for this source")


class PickyCodec(FP32):
    """A codec (built inside the trainer, a Union member) that refuses a value without naming its key."""

    def __init__(self, level: int = 0) -> None:
        super().__init__()
        if level:
            raise ConfigError(f"level {level} is not supported; drop it")


# The config, the arguments, and what the one line must say: the dotted key, the problem and the fix.
REAL_CAUSES = {
    "unknown codec": (
        QUICKSTART,
        ["--trainer.codec", "Foo"],
        ["error: fit: trainer.codec: unknown class 'Foo'. Accepted short names: FP32, PowerSGD, Quantize, TopK;"],
    ),
    "codec of another base": (
        QUICKSTART,
        ["--trainer.codec", "lightning_fl.data.Digits"],
        ["trainer.codec: 'lightning_fl.data.Digits' is not a Codec subclass. Accepted short names: FP32"],
    ),
    "unknown key of the federated trainer": (
        QUICKSTART,
        ["--trainer.aggregation", "median"],
        [
            "error: fit: unknown key 'trainer.aggregation' for lightning_fl.federated.trainer.loop.FederatedTrainer.",
            "Accepted: rounds,",
        ],
    ),
    "literal of the federated trainer": (
        QUICKSTART,
        ["--trainer.upload_policy", "ignore"],
        ["error: fit: trainer.upload_policy: expected one of 'drop', 'raise', got 'ignore'.\n"],
    ),
    "type of the federated trainer": (
        QUICKSTART,
        ["--trainer.clients_per_round", "x"],
        ["error: fit: trainer.clients_per_round: expected int or null, got 'x'.\n"],
    ),
    "unknown optional class": (
        FMP,
        ["--model.summariser", "Foo"],
        ["error: fit: model.summariser: unknown class 'Foo'. Accepted short names: Identity, KMeans, MeanPooling, PMA"],
    ),
    "unknown logger": (
        DIGITS,
        ["--trainer.logger", "Foo"],
        ["error: fit: trainer.logger: unknown class 'Foo'. Accepted short names: CSVLogger", "TensorBoardLogger"],
    ),
    # a float key given nan: YAML reads nan as text (jsonargparse: "expected float") and .nan as NaN
    "nan": (
        DP,
        ["--trainer.privacy.clip_norm", "nan"],
        ["error: fit: trainer.privacy.clip_norm must be a finite number, got nan\n"],
    ),
    "nan to a float or null": (
        DP,
        ["--trainer.privacy.target_epsilon", "NaN"],
        ["error: fit: trainer.privacy.target_epsilon must be a finite number, got nan\n"],
    ),
    "YAML's nan": (
        QUICKSTART,
        ["--trainer.max_update_norm", ".nan"],
        ["error: fit: trainer.max_update_norm must be a finite number, got nan\n"],
    ),
    "refused by the federated trainer": (
        QUICKSTART,
        ["--trainer.rounds", "0"],
        ["error: fit: could not build the config: trainer.rounds must be >= 1, got 0\n"],
    ),
    "refused by a codec, named from its level": (
        QUICKSTART,
        ["--trainer.codec", "Quantize", "--trainer.codec.bits", "3"],
        ["error: fit: could not build the config: trainer.codec.bits must be one of (2, 4, 8, 16), got 3\n"],
    ),
    "refused by a codec, unnamed": (
        QUICKSTART,
        ["--trainer.codec", f"{__name__}.PickyCodec", "--trainer.codec.level", "2"],
        ["error: fit: could not build the config: trainer.codec: level 2 is not supported; drop it\n"],
    ),
    "refused by an optional class": (
        FMP,
        ["--model.summariser.num_points", "0"],
        ["error: fit: could not build the config: model.summariser.num_points must be >= 1, got 0\n"],
    ),
    "refused by the model": (
        QUICKSTART,
        ["--model.rank", "0"],
        ["error: fit: could not build the config: model.latent_dim and model.rank must be >= 1, got 64 and 0\n"],
    ),
    "refused by a data source, unnamed": (
        DIGITS,
        ["--data.source", f"{__name__}.StrictDigits", "--data.source.strictness", "1"],
        ["error: fit: could not build the config: data.source: strictness must be 0 for this source\n"],
    ),
    "federated devices": (
        QUICKSTART,
        ["--trainer.devices", "0"],
        ["could not build the config: trainer.devices must be a number of processes >= 1, -1 (all GPUs), 'auto'"],
    ),
    "federated GPU indices on cpu": (
        QUICKSTART,
        ["--trainer.devices", "0,1"],
        ["trainer.devices '0,1' selects GPUs but trainer.accelerator is cpu: give a number of processes\n"],
    ),
    "lightning devices": (
        DIGITS,
        ["--trainer.devices", "0"],
        [
            "error: fit: could not build the config: trainer.devices: `Trainer(devices='0')` value is not a valid",
            "give a number of devices >= 1 or 'auto'",
        ],
    ),
}


@pytest.mark.parametrize("case", list(REAL_CAUSES), ids=list(REAL_CAUSES))
def test_the_real_cause_comes_first_in_one_line_naming_the_key(case, in_tmp, capsys):
    config, args, expected = REAL_CAUSES[case]
    assert run_cli("fit", "--config", config, *args) == 2
    err = capsys.readouterr().err
    for text in expected:
        assert text in err
    assert len(err.splitlines()) == 2  # the reason, then the --help hint
    for noise in ("Traceback", "Given value", "Namespace(", "Union subtypes", "lightning_fl.FederatedTrainer"):
        assert noise not in err


def test_null_on_the_command_line_reaches_a_class_inside_the_trainer(in_tmp):
    """``--trainer.privacy.noise_seed null``: jsonargparse read ``null`` for the trainer, then handed the privacy
    class the text ``None`` (refused: "expected int or null, got 'None'"); here over a config that seeds the noise
    (the shipped DP configs say null). The same from a YAML config, for DP-SGD, and one class deeper."""
    from lightning_fl.cli import build

    def seeded(key: str, value: str) -> str:
        text = f"trainer:\n  init_args:\n    {key}:\n      init_args:\n        noise_seed: {value}\n"
        return write(in_tmp / f"{key}_{value}.yaml", text)

    central = build(["fit", "--config", DP, "--config", seeded("privacy", "0"), "--trainer.privacy.noise_seed", "null"])
    assert central.trainer.privacy.noise_seed is None
    assert "noise_seed: null" in central.config_yaml
    sgd_seeded = seeded("dp_sgd", "0")
    dp_sgd = build(["fit", "--config", DP_SGD, "--config", sgd_seeded, "--trainer.dp_sgd.noise_seed", "null"])
    assert dp_sgd.trainer.dp_sgd.noise_seed is None
    configs = ["--config", DP, "--config", seeded("privacy", "0"), "--config", seeded("privacy", "null")]
    assert build(["fit", *configs]).trainer.privacy.noise_seed is None
    assert build(["fit", "--config", DP, "--trainer.privacy.noise_seed", "0"]).trainer.privacy.noise_seed == 0
    adaptive = ["--trainer.privacy.adaptive", "AdaptiveClipping", "--trainer.privacy.adaptive.count_std"]
    assert build(["fit", "--config", DP, *adaptive, "null"]).trainer.privacy.adaptive.count_std is None
    assert build(["fit", "--config", DP, *adaptive, "0.5"]).trainer.privacy.adaptive.count_std == 0.5


# Without a config: help for a class, and keys given before their class is chosen.
NO_CONFIG = {
    "help for an unknown model": (
        ["--model.help", "Foo"],
        "error: fit: model: unknown class 'Foo'. Accepted short names: Classifier, FMPMetaLearner, FedProx, "
        "FedSBLanguageModel, Language",
    ),
    "a model key before the model": (
        ["--model.recipe.lr", "3"],
        "error: fit: model.recipe.lr: choose the model class first, with --model CLASS or a --config that sets "
        "model.\n",
    ),
    "help inside a model not chosen": (
        ["--model.summariser.help", "Foo"],
        "error: fit: model.summariser.help: choose the model class first, with --model CLASS or a --config",
    ),
    "a data key before the data": (["--data.batch_size", "3"], "error: fit: data.batch_size: choose the data class"),
}


@pytest.mark.parametrize("case", list(NO_CONFIG), ids=list(NO_CONFIG))
def test_without_a_config_the_message_names_the_key(case, capsys):
    args, expected = NO_CONFIG[case]
    assert run_cli("fit", *args) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.splitlines()) == 2
    assert "TrainingRecipe" not in err and "Accepted: ." not in err


def test_a_yaml_syntax_error_names_the_file_and_the_line(in_tmp, capsys):
    bad = write(in_tmp / "bad.yaml", "trainer:\n  init_args:\n    rounds: 1\n   devices: 1\n")
    assert run_cli("fit", "--config", QUICKSTART, "--config", bad) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: fit: config file {bad}: YAML syntax error at line 4, column 4: ")
    assert "check the indentation" in err and len(err.splitlines()) == 2
    unclosed = write(in_tmp / "unclosed.yaml", "trainer:\n  init_args:\n    devices: [0, 1\n")
    assert run_cli("fit", f"--config={unclosed}") == 2
    err = capsys.readouterr().err
    assert f"config file {unclosed}: YAML syntax error at line 4" in err and "flow sequence at line 3" in err


def test_lightning_refusing_its_settings_at_the_start_is_one_line(in_tmp, capsys):
    args = ["--trainer.max_epochs", "1", "--trainer.val_check_interval", "1000", *QUIET]
    assert run_cli("fit", "--config", DIGITS, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: fit: trainer.val_check_interval: `val_check_interval` (1000) must be less than")
    assert len(err.splitlines()) == 2 and "Traceback" not in err
    assert run_cli("fit", "--config", QUICKSTART, "--trainer.accelerator", "tpuu") == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "error: fit: trainer.accelerator: You selected an invalid accelerator name: `accelerator='tpuu'`"
    )


def test_a_union_report_without_the_built_class_keeps_the_given_members_failure():
    # jsonargparse's report alone, as when it takes no instantiator for the call
    report = (
        "Does not validate against any of the Union subtypes\n"
        "Subtypes: [<class 'lightning_fl.oneshot.summarize.Summariser'>, <class 'NoneType'>]\n"
        "Errors:\n"
        "  - model.summariser.num_points must be >= 1, got 0\n"
        "  - Expected a <class 'NoneType'>\n"
        "Given value type: <class 'jsonargparse._namespace.Namespace'>\n"
        "Given value: Namespace(class_path='lightning_fl.oneshot.PMASummariser', init_args=Namespace(num_points=0))\n"
    )
    assert build_error(ValueError(report)) == "model.summariser.num_points must be >= 1, got 0"


def test_real_process_prints_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_fl", "fit", "--config", DIGITS, "--data.num_clientz", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": ""},
    )
    assert proc.returncode == 2
    assert "Did you mean 'data.num_clients'?" in proc.stderr and "Traceback" not in proc.stderr


def test_the_documented_baseline_example_runs_through_the_cli(in_tmp, monkeypatch):
    """docs/how-to/new-method.md's method, in a package of its own, selected by its class path."""
    page = (REPO / "docs" / "how-to" / "new-method.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    package = in_tmp / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "methods.py").write_text(code)
    monkeypatch.syspath_prepend(str(in_tmp))
    args = [
        "--model",
        "my_pkg.methods.MixupClassifier",
        "--model.mixup_alpha",
        "0.4",
        "--model.backbone",
        "SmallCNN",
        "--model.backbone.image_size",
        "8",
        "--model.num_classes",
        "10",
    ]
    assert run_cli("fit", "--config", DIGITS, *args, "--trainer.max_epochs", "1", *QUIET) == 0
    saved = (in_tmp / "runs" / "pretrain_digits" / "version_0" / "config.yaml").read_text()
    assert "class_path: my_pkg.methods.MixupClassifier" in saved and "mixup_alpha: 0.4" in saved


def test_ci_runs_exactly_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    blocks = [b.split("```", 1)[0].strip() for b in readme.split("```bash\n")[1:3]]
    assert "lightning_fl fit --config configs/quickstart.yaml" in blocks[0]
    assert "pytest" in blocks[1]
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert blocks[1] in ci


@pytest.mark.slow
@pytest.mark.distributed
def test_two_cpu_processes_write_one_run_folder(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_fl",
            "fit",
            "--config",
            DIGITS,
            "--trainer.max_epochs",
            "1",
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "2",
            "--trainer.strategy",
            "ddp",
            *QUIET,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = sorted((tmp_path / "runs" / "pretrain_digits").iterdir())
    assert [r.name for r in runs] == ["version_0"]
    assert (runs[0] / "config.yaml").is_file() and (runs[0] / "checkpoints" / "last.ckpt").is_file()


def test_threads_default_leaves_a_core_free_and_an_explicit_number_is_kept(monkeypatch, capsys):
    from lightning_fl import threads
    from lightning_fl.cli import build

    before = torch.get_num_threads()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # restored after the test
        monkeypatch.setenv(name, threads.os.environ.get(name, "1"))
    try:
        monkeypatch.setattr(threads, "usable_cores", lambda: 8)
        build(["fit", "--config", DIGITS])
        assert torch.get_num_threads() == 7 and threads.os.environ["OMP_NUM_THREADS"] == "7"
        assert threads.share_among(2) == 3  # two processes on the node share the 7
        build(["fit", "--config", DIGITS, "--threads", "2"])
        assert torch.get_num_threads() == 2 and threads.share_among(2) == 2  # explicit: per process
        monkeypatch.setattr(threads, "usable_cores", lambda: 2)
        run = build(["fit", "--config", DIGITS])
        assert torch.get_num_threads() == 1 and "threads: null" in run.config_yaml
        assert threads.share_among(4) == 1
        assert run_cli("fit", "--config", DIGITS, "--threads", "0") == 2
        assert "fit: threads must be a whole number >= 1 or null (the default), got 0" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_client_fraction_null_needs_clients_per_round(in_tmp, capsys):
    """``client_fraction: null`` is one line naming the key unless ``clients_per_round`` says how many (it was a
    TypeError about '<' before)."""
    args = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--trainer.client_fraction", "null"]
    assert run_cli(*args, "--trainer.rounds", "1") == 2
    assert (
        "trainer.client_fraction must be in (0, 1] (or null with trainer.clients_per_round set)"
        in capsys.readouterr().err
    )
    from lightning_fl.cli import build

    trainer = build([*args, "--trainer.clients_per_round", "3", "--trainer.logger", "false"]).trainer
    assert trainer._clients_per_round(10) == 3


def test_warnings_print_as_one_line_without_a_source_path(monkeypatch):
    import warnings

    from lightning_fl.quiet import quiet_lightning

    monkeypatch.delenv("LIGHTNING_FL_DEBUG", raising=False)
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after the test
    quiet_lightning()
    assert warnings.formatwarning("round 2: lost", UserWarning, "/x/round.py", 110) == "warning: round 2: lost\n"
    assert warnings.formatwarning("old", DeprecationWarning, "/x/a.py", 1) == "DeprecationWarning: old\n"


def test_a_lightning_checkpoint_of_another_model_is_one_line(in_tmp, capsys):
    """``validate --ckpt_path`` with a Lightning checkpoint whose weights do not fit the model: one line naming the
    file and the first mismatches, exit code 2 (it was Lightning's RuntimeError traceback)."""
    assert run_cli("fit", "--config", DIGITS, "--trainer.max_epochs", "1", *QUIET) == 0
    ckpt = torch.load(
        in_tmp / "runs" / "pretrain_digits" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True
    )
    name = next(k for k, v in ckpt["state_dict"].items() if v.dim() > 1)
    ckpt["state_dict"][name] = torch.zeros(3, 3)
    torch.save(ckpt, in_tmp / "other.ckpt")
    assert run_cli("validate", "--config", DIGITS, "--ckpt_path", str(in_tmp / "other.ckpt"), *QUIET) == 2
    err = capsys.readouterr().err
    assert f"ckpt_path {in_tmp / 'other.ckpt'} does not fit this model (shape (file vs model) ['{name} (3, 3)" in err
    assert "Traceback" not in err


def test_class_help_names_the_whole_key(capsys):
    """``--trainer.strategy.help FedAdam`` lists ``--trainer.strategy.server_lr`` (jsonargparse prints
    ``--strategy.server_lr``, which the command line then refuses)."""
    assert run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--trainer.strategy.help", "FedAdam") == 0
    out = capsys.readouterr().out
    assert "--trainer.strategy.server_lr" in out and " --strategy.server_lr" not in out and "[--strategy." not in out


def test_a_class_help_is_named_as_typed_and_opens_with_a_whole_sentence(capsys):
    """``--KEY.help CLASS`` prints ``usage: python -m lightning_fl SUBCOMMAND ...`` (jsonargparse names the parser
    it makes for it after ``sys.argv[0]``: ``__main__.py``), and heads the options with the docstring's whole first
    sentence (docstring_parser's short description is the first line, cut where the sentence wraps)."""
    quickstart = str(CONFIGS / "quickstart.yaml")
    headings = {
        ("validate", "--trainer.help", "FederatedTrainer"): "Federated training of a LightningModule over the "
        "clients of a federated data module",
        ("fit", "--config", quickstart, "--trainer.privacy.help", "DistributedDP"): "User-level DP with the noise "
        "drawn by the clients: each clips its update and adds a ``1 / m`` share of the central noise's variance; "
        "the server sums and divides by ``m``",
    }
    for argv, heading in headings.items():
        assert run_cli(*argv) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: python -m lightning_fl {argv[0]} [--trainer."), out[:200]
        assert f"\n\n{heading}:\n  --trainer." in out, argv


def test_the_trainer_help_shows_the_doc_under_each_field(capsys):
    """TrainerArguments documents each field with the string under it (an attribute docstring, as Sphinx and
    mkdocstrings read it); ``--trainer.help FederatedTrainer`` prints every one beside its key."""
    from docstring_parser import parse_from_object

    from lightning_fl.cli.parser import asks_for_help, plain_roles
    from lightning_fl.federated.trainer.arguments import TrainerArguments

    docs = {p.arg_name: p.description for p in parse_from_object(TrainerArguments).params}
    assert docs.keys() == {f.name for f in dataclasses.fields(TrainerArguments)}, "a field without its doc"
    assert docs["rounds"] == "Communication rounds R." and docs["transport"].startswith("How rounds reach clients:")
    assert run_cli("fit", "--trainer.help", "FederatedTrainer") == 0
    printed = capsys.readouterr().out
    assert not re.search(r":(class|meth|func|attr|data|mod):`", printed)  # roles print as plain names
    out = re.sub(r"\s", "", printed)  # (the help wraps lines, long words too)
    docs = {name: plain_roles(doc) for name, doc in docs.items()}
    for name, doc in docs.items():  # "--trainer.rounds ROUNDS Communication rounds R. (type: int, default: 10)"
        value = r"(?:[A-Z_]+|\{[a-z,]+\})"  # ROUNDS, {true,false}
        option = rf"--trainer\.{name}{value}(?:,--trainer\.{name}\+{value})?"  # (a list also takes --KEY+ VALUE)
        assert re.search(rf"{option}{re.escape(''.join(doc.split()))}\(type:", out), name
    # Only help reads attribute docstrings (a run parses without them: they cost 0.8 s on quickstart.yaml).
    assert asks_for_help(["fit", "--trainer.help", "FederatedTrainer"]) and asks_for_help(["fit", "-h"])
    assert not asks_for_help(["fit", "--config", "quickstart.yaml", "--trainer.rounds", "2"])


def test_sphinx_roles_print_as_plain_names():
    from lightning_fl.cli.parser import plain_roles

    text = "see :class:`~lightning_fl.federated.FedAvg`, :meth:`~a.B.run`, :func:`a.b.f` and :data:`X`; `code` stays"
    assert plain_roles(text) == "see FedAvg, run(), a.b.f() and X; `code` stays"


def test_readme_python_example_runs(in_tmp, monkeypatch):
    """README's "The same in Python", at 1 pretraining epoch and 1 round: it builds and fits, writing its run."""
    readme = (REPO / "README.md").read_text()
    code = readme[readme.index("## The same in Python") :].split("```python\n", 1)[1].split("```", 1)[0]
    assert "rounds=30" in code and "epochs=30" in code
    code = code.replace("rounds=30", "rounds=1").replace("epochs=30", "epochs=1")
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    assert (in_tmp / "runs" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt").is_file()


def test_progress_lines_print_once_when_a_dependency_puts_a_handler_on_the_root_logger():
    """``import opacus`` adds a handler to Python's root logger: the package's lines must not reach it as well."""
    code = (
        "import logging\n"
        "from lightning_fl.quiet import show_progress\n"
        "logging.basicConfig(format='ROOT:%(message)s')  # what opacus does on import\n"
        "show_progress()\n"
        "logging.getLogger('lightning_fl.methods.centralised').info('pretraining epoch 1/15')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["pretraining epoch 1/15"]

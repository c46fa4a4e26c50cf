"""One command for a GPU machine: the GPU-only tests, FMP under mixed precision, FLITE's ResNet-18 client step, a
federated round of two configs and a SmolLM2 client step per method; each part under its own time limit, one JSON
per part (issue 76).

    python benchmarks/gpu_check.py --out gpu_check --fashion-mnist data/fashion-mnist   # on a GPU machine
    python benchmarks/gpu_check.py --out gpu_check --tiny --accelerator cpu             # tiny sizes: checks the script

Parts, in this order (``--parts`` picks some):

- ``tests``: ``pytest -m gpu`` over the suite (the tests that need CUDA; on a CPU they are selected and skipped),
  then a short sample of the default suite (``--sample``, 8 workers; ``--tiny``: one GPU test file and one default
  test). Tests choose their accelerator themselves:
  ``FederatedTrainer`` and ``lightning.Trainer`` default to ``accelerator: auto``, so a test that names none runs on
  the GPU where there is one, and tests that pass ``accelerator="cpu"`` stay on the CPU; ``--accelerator cpu``
  hides the GPU from them (``CUDA_VISIBLE_DEVICES`` empty). Counts from pytest's JUnit XML, the failures by name.
- ``fmp``: configs/fmp_digits.yaml's meta-training (validation off) under ``32-true``, ``bf16-mixed`` and
  ``16-mixed``: each step's loss and wall time, steps per second per phase (the k-means warm-up, then the theta
  distance), and each mixed run's loss curve against ``32-true``'s (largest, median and final relative
  differences). Shortened so that both phases run: 100 warm-up steps of 400 (the config: 600 of 900), each fit
  stopped after ``--fmp-seconds`` (15 s) of steps; ``16-mixed`` on a CPU is recorded as unsupported (Lightning
  would run it as bf16).
- ``flite``: the client step of ResNet-18 GN (CIFAR stem, 32x32 inputs, 100 classes) through the package's step loop
  (``lightning_fl.steps.train_steps``, a Fabric of the precision, the module's optimiser and clipping): full
  weights against the latent (d = 64, r = 32 on the conv layers) with every factor family that applies to conv
  weights, under ``32-true`` and ``bf16-mixed`` (batch 128, width 64; ``--tiny``: 2 and 8); wall time per step (sides
  alternated), the latent / full ratios per repeat and, on a GPU, each side's resident memory and a step's peak
  above it.
- ``rounds``: ``--rounds`` federated rounds of configs/quickstart.yaml and configs/flite_fashion_mnist.yaml (base
  pretrained first, on the same accelerator), on the GPU and then on this machine's CPU: each round's
  ``time/round_s`` and ``time/clients_and_server_s`` and the GPU / CPU ratio of the last round's. Fashion-MNIST's
  IDX files come from ``--fashion-mnist`` (never downloaded).
- ``smollm2``: one client step per method (full weights, FLITE ``two_sided`` d = r = 1444 as
  configs/smollm2_flite.yaml, LoRA and FFA-LoRA of rank 1), built by benchmarks/llm_step.py's helpers, in ``32-true``
  and ``bf16-mixed``, batch 4 x 64 tokens as the configs, one method at a time: wall time per step and, on a GPU,
  memory. SmolLM2-135M from ``--smollm2 GGUF``, or by default a random Llama of its shape (its 134,515,008 weights;
  the 98 MB GGUF is more than a 64 MiB device call carries); ``--tiny``: a random 2-layer Llama.

Each part runs in a child forked from this process, which imports torch but never touches CUDA (so each child
initialises its own), under its time limit (``--limit PART=SECONDS``): a part that raises or outruns its limit is
written as such, with the end of its output, and the next part runs. A part writes its JSON as it goes, so one
stopped at its limit keeps what it had measured. Every JSON holds ``part``, ``status`` (``ok``, ``failed`` or
``timeout``), ``seconds``, ``limit_s``, ``tiny``, ``accelerator``, ``environment`` (device name, torch, CUDA and
cuDNN versions, GPU memory, the machine), ``results`` and ``errors``; ``summary.json`` lists the parts' statuses;
``gpu_check.log`` holds every part's output. Exit code 0 when every part is ok, 1 when one is not, 2 for bad
arguments. Results: docs/results-systems.md, "On a GPU".
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PARTS = ("tests", "fmp", "flite", "rounds", "smollm2")
#: Seconds per part on a GPU machine: 6 minutes in all, so one run and a rerun fit 15 minutes of device time.
LIMITS = {"tests": 100, "fmp": 60, "flite": 75, "rounds": 80, "smollm2": 45}
TINY_LIMITS = dict.fromkeys(PARTS, 300)  # generous: a shared 2-core machine can be 5x slower than idle
#: Default-suite tests whose trainers take ``accelerator: auto`` (FederatedTrainer, lightning.Trainer), so they run
#: on the GPU (55 tests: 200 s on 2 CPU cores with 2 workers, 104 s of CPU time).
SAMPLE = ["tests/test_federated.py", "tests/test_steps.py", "tests/test_cohort.py", "tests/test_lora.py"]
TINY_SAMPLE = ["tests/test_federated.py::test_round_logs_metrics_bytes_and_identity"]
#: Where ``-m gpu`` looks with ``--tiny``: one file that holds a GPU test (collecting the whole suite, as a full run
#: does, takes 15 s on 2 cores).
TINY_GPU_PATHS = ["tests/test_seeding.py"]
FMP_CONFIG = "configs/fmp_digits.yaml"
FMP_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
#: Overrides of the FMP config: both phases (k-means warm-up, then the theta distance) in a short run.
FMP_FULL = {"model.warmup_steps": 100, "trainer.max_steps": 400}
FMP_TINY = {
    "model.warmup_steps": 2,
    "trainer.max_steps": 6,
    "model.generator_training.steps": 3,
    "model.generator_training.eval_tasks": 1,
    "data.val_tasks": 1,
    "data.test_tasks": 1,
    "model.num_generated": 20,
    "model.test_samples": 2,
    "data.meta_tasks": 40,
}
PRECISIONS = ("32-true", "bf16-mixed")
#: Factor families of conv weights; ``dense`` (a P x d matrix: tens of GB for ResNet-18) and ``two_sided`` (linear
#: weights only) do not apply.
FLITE_MODES = ("stored", "regenerate", "streamed", "kronecker")
ROUND_CONFIGS = {"quickstart": "configs/quickstart.yaml", "flite_fashion_mnist": "configs/flite_fashion_mnist.yaml"}
SMOLLM2_WEIGHTS = 134_515_008
LLM_METHODS = ("full", "flite", "lora", "ffa")


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2
        print(f"gpu_check: {message}", file=sys.stderr)
        raise SystemExit(2)


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON files (made if missing)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, steps and samples: checks the script")
    parser.add_argument("--accelerator", choices=["auto", "cpu", "gpu"], default="auto", help="auto: a GPU if any")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run, in order")
    parser.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS", help="a part's time limit")
    parser.add_argument("--fashion-mnist", type=Path, default=None, help="folder of Fashion-MNIST's 4 IDX files")
    parser.add_argument("--smollm2", type=Path, default=None, help="SmolLM2's GGUF; default: random, same shape")
    parser.add_argument("--sample", nargs="+", default=None, help="default-suite tests to run (paths or node ids)")
    parser.add_argument("--workers", type=int, default=None, help="pytest-xdist workers for the sample (0: none)")
    parser.add_argument("--fmp-seconds", type=float, default=None, help="time cap of each FMP precision's fit")
    parser.add_argument("--rounds", type=int, default=None, help="federated rounds per config and accelerator")
    parser.add_argument("--work", type=Path, default=None, help="keep runs, caches and logs here (default: temp)")
    args = parser.parse_args(argv)
    limits = dict(TINY_LIMITS if args.tiny else LIMITS)
    for item in args.limit:
        part, _, seconds = item.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = math.nan
        if part not in PARTS or not value > 0:
            parser.error(f"--limit {item}: give PART=SECONDS, PART one of {', '.join(PARTS)}, SECONDS > 0")
        limits[part] = value
    args.limits = limits
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: not a folder")
    if args.fashion_mnist is not None and not args.fashion_mnist.is_dir():
        parser.error(f"--fashion-mnist {args.fashion_mnist}: no such folder")
    if args.smollm2 is not None and not args.smollm2.is_file():
        parser.error(f"--smollm2 {args.smollm2}: no such file")
    for name in ("workers", "rounds", "fmp_seconds"):
        value = getattr(args, name)
        if value is not None and (value < 0 or (value == 0 and name != "workers")):
            parser.error(f"--{name.replace('_', '-')} {value}: must be {'>= 0' if name == 'workers' else '> 0'}")
    args.rounds = args.rounds or (1 if args.tiny else 2)
    args.workers = (0 if args.tiny else 8) if args.workers is None else args.workers
    args.fmp_seconds = args.fmp_seconds or (60.0 if args.tiny else 15.0)
    args.sample = args.sample or (TINY_SAMPLE if args.tiny else SAMPLE)
    return args


# ------------------------------------------------------------------------------ the parts' children
def run_forked(fn: Callable[[], None], limit: float, log: Path, group: bool = True) -> tuple[str, int | None, float]:
    """``fn()`` in a child forked from this process, its output appended to ``log``; killed after ``limit`` seconds
    (with its process group, which it leads when ``group``). Returns ``ok``, ``failed`` or ``timeout``, its exit code
    (None after a timeout) and the seconds it ran."""
    sys.stdout.flush(), sys.stderr.flush()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if group:
                os.setsid()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1), os.dup2(fd, 2)
            sys.stdout = open(1, "w", closefd=False, buffering=1)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False, buffering=1)  # noqa: SIM115
            fn()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            if code and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return ("ok" if code == 0 else "failed"), code, time.monotonic() - start
        if time.monotonic() - start > limit:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL) if group else os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", None, time.monotonic() - start
        time.sleep(0.05)


class Record:
    """A part's JSON, written whenever it changes (a part stopped at its limit keeps what it had written)."""

    def __init__(self, path: Path, part: str, args: argparse.Namespace) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "part": part,
            "status": "running",
            "seconds": None,
            "limit_s": args.limits[part],
            "tiny": args.tiny,
            "accelerator": None,
            "environment": None,
            "results": {},
            "errors": [],
        }

    @property
    def results(self) -> dict[str, Any]:
        return self.data["results"]

    def error(self, where: str, err: BaseException) -> dict[str, str]:
        """Note a failed measurement (the part goes on, and ends failed)."""
        line = f"{where}: {type(err).__name__}: {' '.join(str(err).split())[:600]}"
        traceback.print_exc()
        self.data["errors"].append(line)
        self.save()
        return {"status": "failed", "error": line}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)


def environment(device) -> dict[str, Any]:
    """The device, the versions and the machine (benchmarks/_harness.py's ``machine``)."""
    import lightning
    import torch
    from _harness import machine

    env = {
        "device": device.type,
        "lightning": lightning.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        **machine(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name,
            gpu_memory_bytes=props.total_memory,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            bf16_supported=torch.cuda.is_bf16_supported(),
        )
        if shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", str(device.index or 0)]
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                env["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    else:
        env["device_name"] = cpu_name()
    return env


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


class Context:
    """What a part's child holds: the arguments, its device and accelerator name, its JSON, the work folder.

    The device comes from the probe (``args.cuda``), not from CUDA: a process that has touched CUDA (even
    ``torch.cuda.is_available()``) cannot fork a child that uses it, and the tests part forks its pytest sessions.
    :meth:`describe` (which does touch it) records the environment: at the start of a part, or after its children.
    """

    def __init__(self, args: argparse.Namespace, part: str, record: Record) -> None:
        import torch

        self.args, self.part, self.record, self.tiny = args, part, record, args.tiny
        self.device = torch.device("cuda", 0) if args.cuda else torch.device("cpu")
        self.accelerator = "gpu" if args.cuda else "cpu"
        self.work = args.work / part
        self.work.mkdir(parents=True, exist_ok=True)
        record.data["accelerator"] = self.accelerator
        record.save()

    def describe(self) -> None:
        self.record.data["environment"] = environment(self.device)
        self.record.save()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def supports(self, precision: str) -> str | None:
        """Why ``precision`` cannot run on this device, or None."""
        import torch

        if precision == "16-mixed" and not self.cuda:
            return "16-mixed on a CPU: Lightning would run it as bf16-mixed (measured already)"
        if precision == "bf16-mixed" and self.cuda and not torch.cuda.is_bf16_supported():
            return f"{torch.cuda.get_device_name(self.device)} has no bfloat16"
        return None

    def memory(self) -> GpuMemory:
        return GpuMemory(self)

    def placeholder(self, value: str) -> str:
        """``value`` with the work and data folders written as WORK and DATA (no machine's paths in the JSON)."""
        value = value.replace(str(self.args.work), "WORK")
        if self.args.fashion_mnist is not None:
            value = value.replace(str(self.args.fashion_mnist.resolve()), "DATA")
        return value.replace(str(REPO) + os.sep, "")


class GpuMemory:
    """A side's resident GPU memory (allocated after it was built and took a step, less before) and a step's peak
    above that; None on a CPU."""

    def __init__(self, ctx: Context) -> None:
        import torch

        self.ctx, self.torch = ctx, torch
        self.start = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else None

    def after_warmup(self, step: Callable[[], None]) -> dict[str, int | None]:
        """Call once the side has taken its warm-up step: run ``step`` once more and measure."""
        if not self.ctx.cuda:
            step()
            return {"resident_bytes": None, "step_peak_extra_bytes": None, "peak_allocated_bytes": None}
        cuda, device = self.torch.cuda, self.ctx.device
        self.ctx.sync()
        resident = cuda.memory_allocated(device)
        cuda.reset_peak_memory_stats(device)
        step()
        self.ctx.sync()
        return {
            "resident_bytes": resident - self.start,
            "step_peak_extra_bytes": cuda.max_memory_allocated(device) - resident,
            "peak_allocated_bytes": cuda.max_memory_allocated(device),
        }


def quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_fl"):
        logging.getLogger(name).setLevel(logging.ERROR)


def flags(keys: dict[str, Any]) -> list[str]:
    """Command-line overrides ``--key=value``."""
    return [f"--{key}={value}" for key, value in keys.items()]


# ------------------------------------------------------------------------------ tests
def part_tests(ctx: Context) -> None:
    """``pytest -m gpu``, then the sample of the default suite; each a pytest session in its own child."""
    if ctx.args.accelerator == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    paths = TINY_GPU_PATHS if ctx.tiny else ["tests"]
    runs = {"gpu_marked": ["-m", "gpu", "-n", "0", *paths], "sample": ["-n", str(ctx.args.workers), *ctx.args.sample]}
    try:
        run_sessions(ctx, runs)
    finally:
        ctx.describe()  # CUDA touched only now, after the sessions were forked


def run_sessions(ctx: Context, runs: dict[str, list[str]]) -> None:
    for name, selection in runs.items():
        ctx.record.results[name] = result = pytest_session(ctx, name, selection)
        ctx.record.save()
        if name == "gpu_marked" and not result.get("selected"):
            ctx.record.data["errors"].append("gpu_marked: no test carries the gpu marker (pytest -m gpu selects none)")
        elif result.get("exit_code") != 0:
            ctx.record.data["errors"].append(f"{name}: pytest exited with {result.get('exit_code')}")
        ctx.record.save()


def pytest_session(ctx: Context, name: str, selection: list[str]) -> dict[str, Any]:
    xml = ctx.work / f"{name}.xml"
    argv = [
        "-c",
        "pyproject.toml",
        "--rootdir",
        ".",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfE",
        "-o",
        "junit_family=xunit2",
        "--continue-on-collection-errors",
        f"--junitxml={xml}",
        f"--basetemp={ctx.work / (name + '-tmp')}",
        *selection,
    ]

    def session() -> None:
        import pytest

        os.chdir(REPO)
        raise SystemExit(int(pytest.main(argv)))

    log = ctx.work / f"{name}.log"
    _, code, seconds = run_forked(session, ctx.args.limits["tests"], log, group=False)  # killed with the part
    print(log.read_text()[-4000:], flush=True)
    out: dict[str, Any] = {"argv": ["pytest", *[ctx.placeholder(a) for a in argv]], "seconds": seconds}
    out["exit_code"] = code
    if xml.is_file():
        out.update(junit_counts(xml))
    return out


def junit_counts(path: Path) -> dict[str, Any]:
    """Per outcome, the tests pytest's JUnit XML reports (a module that failed to import is a collection error, not
    a test), and the failed ones by name with the first 300 characters of their message."""
    import xml.etree.ElementTree as ET

    counts = dict.fromkeys(("selected", "passed", "failed", "errors", "skipped"), 0)
    failures, collection = [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        message = "" if bad is None else " ".join((bad.get("message") or "").split())[:300]
        name = f"{case.get('classname')}::{case.get('name')}".lstrip(":")
        if bad is not None and bad.tag == "error" and message == "collection failure":
            collection.append({"module": name, "message": " ".join((bad.text or "").split())[-300:]})
            continue
        counts["selected"] += 1
        if bad is not None:
            counts["failed" if bad.tag == "failure" else "errors"] += 1
            failures.append({"test": name, "message": message})
        else:
            counts["skipped" if case.find("skipped") is not None else "passed"] += 1
    return {**counts, "failures": failures, "collection_errors": collection}


# ------------------------------------------------------------------------------ FMP
def part_fmp(ctx: Context) -> None:
    """configs/fmp_digits.yaml per precision (32-true first: the reference, and it caches the generator)."""
    quiet()
    extra = FMP_TINY if ctx.tiny else FMP_FULL
    results = ctx.record.results
    results.update(config=FMP_CONFIG, overrides=extra, max_time_s=ctx.args.fmp_seconds, precisions={})
    ctx.record.save()
    curves: dict[str, list[float]] = {}
    for precision in FMP_PRECISIONS:
        if (why := ctx.supports(precision)) is not None:
            results["precisions"][precision] = {"status": "unsupported", "reason": why}
        else:
            try:
                results["precisions"][precision] = out = fmp_fit(ctx, precision, extra)
                curves[precision] = out.pop("loss")
                out["loss_curve"] = curves[precision]
                if precision != "32-true" and "32-true" in curves:
                    out["against_32_true"] = agreement(curves["32-true"], curves[precision], out["warmup_steps"])
            except Exception as err:
                results["precisions"][precision] = ctx.record.error(f"fmp {precision}", err)
        ctx.record.save()


def fmp_fit(ctx: Context, precision: str, overrides: dict[str, int]) -> dict[str, Any]:
    import lightning as L

    from lightning_fl.cli.command import build

    class StepClock(L.Callback):
        """Each step's loss and the wall time at its end (the step syncs already: it checks its loss is finite)."""

        def __init__(self) -> None:
            self.ends: list[float] = []
            self.loss: list[float] = []

        def on_train_start(self, trainer, pl_module) -> None:
            ctx.sync()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.loss.append(float(loss))
            self.ends.append(time.perf_counter())

    seconds = int(ctx.args.fmp_seconds)
    keys = {
        "trainer.accelerator": ctx.accelerator,
        "trainer.precision": precision,
        "trainer.logger": "false",
        "trainer.limit_val_batches": 0,
        "trainer.max_time": f"00:00:{seconds // 60:02d}:{seconds % 60:02d}",
        "trainer.default_root_dir": ctx.work / precision,
    }
    argv = ["fit", "--config", str(REPO / FMP_CONFIG), *flags(overrides), *flags(keys)]
    run = build(argv)
    clock = StepClock()
    run.trainer.callbacks.append(clock)
    started = time.perf_counter()
    run.trainer.fit(run.model, datamodule=run.data)
    fit_s = time.perf_counter() - started
    warmup = int(run.model.warmup_steps)
    steps = [b - a for a, b in zip([clock.start, *clock.ends], clock.ends, strict=False)]
    phases = {"warmup": steps[:warmup], "theta_distance": steps[warmup:]}
    return {
        "argv": [ctx.placeholder(a) for a in argv[1:]],
        "status": "ok",
        "fit_s": fit_s,
        "steps": len(steps),
        "warmup_steps": warmup,
        "steps_per_s": {k: rate(v) for k, v in phases.items()},
        "loss": clock.loss,
    }


def rate(seconds: list[float]) -> dict[str, Any]:
    """Steps per second over a phase, its first 2 steps left out (first calls, allocations); None without steps."""
    timed = seconds[2:] or seconds
    if not timed:
        return {"steps": 0, "mean": None, "median": None}
    return {"steps": len(timed), "mean": len(timed) / sum(timed), "median": 1 / statistics.median(timed)}


def agreement(reference: list[float], other: list[float], warmup: int) -> dict[str, Any]:
    """``other``'s loss curve against ``reference``'s over the steps both took, per phase: the largest and median
    relative difference per step, and that of the mean over the last tenth of the phase's steps."""
    n = min(len(reference), len(other))
    out: dict[str, Any] = {"steps_compared": n}
    for phase, (a, b) in {"warmup": (0, min(warmup, n)), "theta_distance": (min(warmup, n), n)}.items():
        if b <= a:
            continue
        ref, oth = reference[a:b], other[a:b]
        rel = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(ref, oth, strict=True)]
        tail = max(1, (b - a) // 10)
        last_ref, last_oth = statistics.fmean(ref[-tail:]), statistics.fmean(oth[-tail:])
        out[phase] = {
            "steps": b - a,
            "max_rel_diff": max(rel),
            "median_rel_diff": statistics.median(rel),
            "last_mean_rel_diff": abs(last_oth - last_ref) / max(abs(last_ref), 1e-12),
            "last_mean_32_true": last_ref,
            "last_mean": last_oth,
        }
    return out


# ------------------------------------------------------------------------------ FLITE's ResNet-18 client step
def part_flite(ctx: Context) -> None:
    quiet()
    width, batch, steps, repeats = (8, 2, 1, 1) if ctx.tiny else (64, 128, 2, 3)
    results = ctx.record.results
    results.update(
        model="ResNet-18 GN, CIFAR stem",
        width=width,
        batch=batch,
        image=32,
        classes=100,
        latent_dim=64,
        rank=32,
        layers="conv",
        modes=list(FLITE_MODES),
        steps_per_sample=steps,
        repeats=repeats,
        not_applicable={
            "dense": "a P x d matrix (tens of GB at ResNet-18's 11M conv weights)",
            "two_sided": "nn.Linear weights only",
        },
        precisions={},
    )
    ctx.record.save()
    for precision in PRECISIONS:
        if (why := ctx.supports(precision)) is not None:
            results["precisions"][precision] = {"status": "unsupported", "reason": why}
        else:
            try:
                results["precisions"][precision] = flite_step(ctx, precision, width, batch, steps, repeats)
            except Exception as err:
                results["precisions"][precision] = ctx.record.error(f"flite {precision}", err)
        ctx.record.save()
        gc.collect()


def flite_step(ctx: Context, precision: str, width: int, batch: int, steps: int, repeats: int) -> dict[str, Any]:
    import torch
    from _harness import alternate, ratios, summarise
    from latent_overhead import resnet18

    from lightning_fl.context import StepContext, attached
    from lightning_fl.federated.clients.client import configure_optimizer, gradient_clip
    from lightning_fl.federated.clients.local import LocalTraining
    from lightning_fl.methods import Classifier, LatentClassifier, Recipe
    from lightning_fl.methods.centralised import step_fabric
    from lightning_fl.steps import train_steps

    # configs/fedavg_cifar100.yaml's client recipe for full weights; the latent's default is FLITE's (Adam, clip 1)
    full_recipe = Recipe(
        optimizer="sgd", lr=0.01, momentum=0.9, weight_decay=5e-4, warmup_epochs=0, schedule="constant"
    )

    fabric = step_fabric(ctx.device, precision)  # the package's one-device Fabric: autocast, a scaler for 16-mixed
    torch.manual_seed(0)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 100, (batch,))  # made on the CPU, as a client's batches

    def client(module) -> Callable[[int], None]:
        """A client's local training of ``n`` steps on the batch (the round's step loop), synchronised."""
        module = module.to(ctx.device)
        optimizer, scheduler = configure_optimizer(module)
        optimizer = fabric.setup_optimizers(optimizer)
        clip, context = gradient_clip(module, LocalTraining()), StepContext(fabric, client=0, round=0)
        module.train()

        def run(n: int) -> None:
            with attached(module, context):
                train_steps(module, optimizer, scheduler, [(x, y)] * n, fabric, context, clip=clip)
            ctx.sync()

        return run

    sides: dict[str, Callable[[int], None]] = {}
    memory: dict[str, Any] = {}
    for side in ("full", *FLITE_MODES):
        meter = ctx.memory()
        if side == "full":
            module = Classifier(resnet18(width), 100, recipe=full_recipe)  # the head stays frozen
        else:
            module = LatentClassifier(resnet18(width), 100, base="scratch", latent_dim=64, rank=32, factors=side)
        sides[side] = run = client(module)
        run(1)  # warm-up: optimiser state, factors built, kernels chosen
        memory[side] = meter.after_warmup(lambda run=run: run(1))
    samples = alternate({name: (lambda run=run: run(steps)) for name, run in sides.items()}, repeats)
    summary = summarise(samples, per=steps)
    return {
        "status": "ok",
        "step_s": {k: v["wall"] for k, v in summary.items()},
        "cpu_s": {k: v["cpu"] for k, v in summary.items()},
        "latent_over_full": {m: ratios(samples, m, "full")["wall"] for m in FLITE_MODES},
        "memory": memory,
    }


# ------------------------------------------------------------------------------ federated rounds
def part_rounds(ctx: Context) -> None:
    quiet()
    results = ctx.record.results
    accelerators = ["gpu", "cpu"] if ctx.cuda else ["cpu"]
    results.update(rounds=ctx.args.rounds, accelerators=accelerators, configs={})
    ctx.record.save()
    for name in ROUND_CONFIGS:
        results["configs"][name] = out = {}
        for accelerator in accelerators:
            try:
                out[accelerator] = federated_rounds(ctx, name, accelerator)
            except Exception as err:
                out[accelerator] = ctx.record.error(f"rounds {name} {accelerator}", err)
            ctx.record.save()
        if all(out.get(a, {}).get("status") == "ok" for a in ("gpu", "cpu")):
            out["gpu_over_cpu_last_round"] = out["gpu"]["last_round_s"] / out["cpu"]["last_round_s"]
        ctx.record.save()


def federated_rounds(ctx: Context, name: str, accelerator: str) -> dict[str, Any]:
    from lightning_fl.cli.command import build

    keys = {
        "trainer.accelerator": accelerator,
        "trainer.rounds": ctx.args.rounds,
        "trainer.logger": "false",
        "trainer.enable_progress_bar": "false",
        "trainer.default_root_dir": ctx.work / "runs",
        "trainer.name": f"{name}_{accelerator}",
        "model.pretraining.accelerator": accelerator,
    }
    if ctx.tiny:
        keys["model.pretraining.epochs"] = 1
    if name == "flite_fashion_mnist":
        if ctx.args.fashion_mnist is not None:
            keys["data.source.root"] = ctx.args.fashion_mnist.resolve()
        keys["data.source.download"] = "false"
        if ctx.tiny:
            keys.update({"data.max_train_samples": 400, "trainer.limit_val_batches": 2})
    argv = ["fit", "--config", str(REPO / ROUND_CONFIGS[name]), *flags(keys)]
    run = build(argv)
    started = time.perf_counter()
    run.trainer.fit(run.model, datamodule=run.data)
    fit_s = time.perf_counter() - started
    rows = [h for h in run.trainer.history if h.get("round", 0) >= 1]
    if not rows:
        raise RuntimeError(f"{name} on {accelerator}: no round finished")
    keys = {"time/round_s": "round_s", "time/clients_and_server_s": "clients_and_server_s", "val/acc": "val_acc"}
    per_round = [{"round": int(h["round"]), **{v: h.get(k) for k, v in keys.items()}} for h in rows]
    return {
        "status": "ok",
        "argv": [ctx.placeholder(a) for a in argv[1:]],
        "fit_s": fit_s,
        "rounds": per_round,
        "last_round_s": per_round[-1]["round_s"],
        "threads": __import__("torch").get_num_threads(),
    }


# ------------------------------------------------------------------------------ SmolLM2
def part_smollm2(ctx: Context) -> None:
    quiet()
    import torch
    from llm_step import PROJECTIONS, unique_numel

    from lightning_fl.mapping import select_weights

    try:
        base, model = language_model(ctx)
    except Exception as err:
        ctx.record.error("smollm2 model", err)
        raise SystemExit(1) from None
    batch, context, d, rank, steps = (1, 8, 4, 4, 1) if ctx.tiny else (4, 64, 1444, 1444, 3)
    targets = [n.removesuffix(".weight") for n in select_weights(base, PROJECTIONS)]
    results = ctx.record.results
    results.update(
        model=model,
        weights=unique_numel(base),
        projections=len(targets),
        batch=batch,
        context=context,
        lora_rank=1,
        latent_dim=d,
        rank=rank,
        factors="two_sided",
        steps_timed=steps,
        methods=list(LLM_METHODS),
        precisions={},
    )
    ctx.record.save()
    torch.manual_seed(1)
    vocab = base.config.vocab_size
    x, y = torch.randint(vocab, (batch, context)), torch.randint(vocab, (batch, context))
    for precision in PRECISIONS:
        if (why := ctx.supports(precision)) is not None:
            results["precisions"][precision] = {"status": "unsupported", "reason": why}
            continue
        results["precisions"][precision] = per_method = {}
        for method in LLM_METHODS:
            try:
                per_method[method] = llm_side_step(ctx, base, targets, method, precision, x, y, d, rank, steps)
            except Exception as err:
                per_method[method] = ctx.record.error(f"smollm2 {precision} {method}", err)
            ctx.record.save()
            gc.collect()
            if ctx.cuda:
                torch.cuda.empty_cache()


def language_model(ctx: Context):
    """The tiny random Llama, SmolLM2 from its GGUF, or a random Llama of SmolLM2-135M's shape (float32)."""
    import torch
    from llm_step import load, unique_numel

    if ctx.tiny or ctx.args.smollm2 is not None:
        model = load(argparse.Namespace(tiny=ctx.tiny, gguf=ctx.args.smollm2, context=64))
        name = "random tiny Llama (2 layers, 32 wide)" if ctx.tiny else "SmolLM2-135M (Q4_1 GGUF, float32)"
        return model.requires_grad_(False), name
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(config).float().requires_grad_(False)
    if unique_numel(model) != SMOLLM2_WEIGHTS:
        raise RuntimeError(f"the random SmolLM2 has {unique_numel(model):,} weights, not {SMOLLM2_WEIGHTS:,}")
    return model, "random Llama of SmolLM2-135M's shape (30 layers, 576 wide, float32)"


def llm_side_step(ctx: Context, base, targets, method, precision, x, y, d, rank, steps) -> dict[str, Any]:
    import copy

    from _harness import alternate, summarise
    from llm_step import Side, flite_side, logits_of, lora_side, unique_numel
    from torch.nn import functional as F

    from lightning_fl.methods.centralised import step_fabric

    fabric = step_fabric(ctx.device, precision)
    meter = ctx.memory()
    extra = []
    if method == "full":
        model = copy.deepcopy(base).requires_grad_(True)
        side = Side(model, logits_of(model), list(model.parameters()), unique_numel(base))
    elif method == "flite":
        side, mapping = flite_side(base, d, rank, "two_sided")
        extra.append(mapping)
    else:
        side = lora_side(base, targets, 1, method)
    for module in (side.model, *extra):  # parameters move in place: the optimiser keeps them
        module.to(ctx.device)
    xd, yd = fabric.to_device(x), fabric.to_device(y)

    def step() -> None:
        with fabric.autocast():
            logits = side.forward(xd)
            loss = F.cross_entropy(logits.float().flatten(0, 1), yd.flatten())
        loss.backward()
        side.opt.step()
        side.opt.zero_grad(set_to_none=True)
        ctx.sync()

    step()  # warm-up
    memory = meter.after_warmup(step)
    samples = alternate({method: lambda: [step() for _ in range(steps)]}, 1)
    summary = summarise(samples, per=steps)[method]
    return {"status": "ok", "upload_floats": side.upload, "step_s": summary["wall"], "cpu_s": summary["cpu"], **memory}


# ------------------------------------------------------------------------------ the driver
def probe(args: argparse.Namespace, path: Path) -> None:
    """The environment, from a child (this process must not initialise CUDA before it forks the parts)."""
    import torch

    device = torch.device("cuda", 0) if args.accelerator != "cpu" and torch.cuda.is_available() else torch.device("cpu")
    path.write_text(json.dumps({"cuda_available": torch.cuda.is_available(), **environment(device)}, default=str))


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    temporary = args.work is None
    args.work = Path(tempfile.mkdtemp(prefix="gpu_check-")) if temporary else args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ["LIGHTNING_FL_CACHE"] = str(args.work / "cache")  # bases, generators: nothing from earlier runs
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        return drive(args)
    finally:
        if temporary:
            shutil.rmtree(args.work, ignore_errors=True)


def drive(args: argparse.Namespace) -> int:
    import lightning  # noqa: F401  (imported once here, not in every part's child)
    import torch

    import lightning_fl.cli.command
    import lightning_fl.methods  # noqa: F401

    if "smollm2" in args.parts:
        with contextlib.suppress(ImportError):
            import peft  # noqa: F401
            import transformers  # noqa: F401
    log = args.out / "gpu_check.log"
    log.write_text("")
    env_path = args.work / "environment.json"
    status, _, _ = run_forked(lambda: probe(args, env_path), 120, log)
    env = json.loads(env_path.read_text()) if status == "ok" else {}
    args.cuda = args.accelerator != "cpu" and bool(env.get("cuda_available"))
    if args.accelerator == "gpu" and not args.cuda:
        print(f"gpu_check: --accelerator gpu, but torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    print(
        f"[gpu_check] {env.get('device_name')} ({env.get('device')}), torch {torch.__version__}, CUDA "
        f"{torch.version.cuda}; parts {', '.join(args.parts)}; JSON in {args.out}",
        flush=True,
    )
    summary = {"environment": env, "tiny": args.tiny, "accelerator": args.accelerator, "parts": {}}
    functions = {
        "tests": part_tests,
        "fmp": part_fmp,
        "flite": part_flite,
        "rounds": part_rounds,
        "smollm2": part_smollm2,
    }
    for part in args.parts:
        path = args.out / f"{part}.json"
        record = Record(path, part, args)
        record.save()
        part_log = args.work / f"{part}.log"
        part_log.write_text("")

        def child(part=part, record=record) -> None:
            ctx = Context(args, part, record)
            if part != "tests":  # (it forks pytest sessions first)
                ctx.describe()
            functions[part](ctx)
            if record.data["errors"]:
                raise SystemExit(1)

        status, _, seconds = run_forked(child, args.limits[part], part_log)
        data = json.loads(path.read_text())
        text = part_log.read_text()
        with log.open("a") as f:
            f.write(f"===== {part}: {status} in {seconds:.1f} s\n{text}\n")
        data.update(status=status, seconds=seconds)
        if status == "timeout":
            data["errors"].append(f"ran past its limit of {args.limits[part]:g} s")
        elif status == "failed" and not data["errors"]:
            data["errors"].append(text.strip()[-2000:] or "the part's child failed without output")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
        tmp.replace(path)
        summary["parts"][part] = {"status": status, "seconds": seconds, "errors": data["errors"]}
        print(f"[gpu_check] {part}: {status} in {seconds:.1f} s -> {path}", flush=True)
        for line in data["errors"]:
            print(f"[gpu_check]   {line[-1000:]}", flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    bad = [p for p, s in summary["parts"].items() if s["status"] != "ok"]
    verdict = f"not ok: {', '.join(bad)}" if bad else "every part ok"
    print(f"[gpu_check] wrote {args.out / 'summary.json'}; {verdict}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The arguments of :class:`~lightning_fl.federated.FederatedTrainer` (the CLI's ``trainer.*`` keys) as a typed
dataclass, checked when it is made: every impossible value or combination, one line each naming the key and what to
write instead, raised together.

Kept as one file: the fields are one table, the CLI's ``trainer.*`` keys with their documentation, and their checks
read them together (a combination of keys is refused as often as one value)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from lightning_fl.compress.base import FP32, Codec
from lightning_fl.compress.error_feedback import UpdateCompressor
from lightning_fl.errors import ConfigError
from lightning_fl.federated.attacks import Attack
from lightning_fl.federated.budget import ledger_problems
from lightning_fl.federated.buffered import FedBuff, buffered_problems
from lightning_fl.federated.callbacks import Callback
from lightning_fl.federated.clock import Clock
from lightning_fl.federated.strategies import FedAvg, Strategy
from lightning_fl.federated.strategies.base import configured_name
from lightning_fl.federated.transport import Transport
from lightning_fl.privacy.audit import PrivacyAudit
from lightning_fl.privacy.base import Privacy
from lightning_fl.privacy.dpsgd import DPSGD
from lightning_fl.privacy.secure import SecureAggregation
from lightning_fl.trainer_api import lazy_instance


@dataclass(eq=False, repr=False)
class TrainerArguments:
    """What a federated run is configured by (:class:`~lightning_fl.federated.FederatedTrainer`'s arguments, the
    CLI's ``trainer.*`` keys), checked when it is made: every impossible value or combination is one line naming the
    key, all raised together as a :class:`~lightning_fl.errors.ConfigError`. Each field's doc is the string under it
    (what ``--trainer.help FederatedTrainer`` prints).
    """

    rounds: int = 10
    """Communication rounds R."""
    client_fraction: float | None = 1.0
    """Share of the K clients sampled each round (at least one); ``null`` with ``clients_per_round`` set."""
    clients_per_round: int | None = None
    """Number of clients sampled each round; overrides ``client_fraction``."""
    local_epochs: int = 1
    """Local epochs E per round."""
    local_steps: int | None = None
    """Local optimiser steps per round instead of epochs (cycling the client's data)."""
    strategy: Strategy = lazy_instance(FedAvg)
    """Server algorithm: which clients train and how uploads are aggregated (``FedAvg``, ``FedAvgM``, ``FedAdagrad``,
    ``FedAdam``, ``FedYogi``, ``Median``, ``TrimmedMean``, ``Krum``, or yours)."""
    codec: Codec = lazy_instance(FP32)
    """Upload codec (``FP32``, ``Quantize``, or a compressor: ``TopK``, ``PowerSGD``)."""
    compressed_downloads: bool = False
    """The server broadcasts its step compressed by a copy of the codec (a compressor) and clients apply it to the state
    they hold; ``false``: clients download the float32 state. In process only (docs/methods.md, "Compressed
    downloads")."""
    upload_policy: Literal["drop", "raise"] = "drop"
    """What the gate does with a malformed or non-finite upload (or a client whose training diverges): ``drop`` it from
    the round (logged) or ``raise`` an error naming client and round."""
    max_update_norm: float | None = None
    """The gate refuses an upload whose change to the global state (L2 norm over the whole federated state) exceeds
    this; ``null``: no absolute bound. The aggregate's step obeys it too."""
    max_update_norm_ratio: float | Literal["auto"] | None = "auto"
    """The gate refuses an upload whose update norm is more than this many times the round's median update norm;
    ``null``: off. With a linear strategy the aggregate's step obeys it too. ``auto`` (default): 10, and off under a
    mechanism that clips every upload (``privacy`` CentralDP or DistributedDP, ``secure_aggregation``), whose clip
    bound already bounds it and which a gate relative to the other clients' updates would break (the run's summary
    says so)."""
    max_client_weight: float | None = None
    """The most samples a client's upload may weigh under a sample-weighted strategy (a larger declared count is capped,
    warned): on Flower each node declares its own count."""
    dropout: float = 0.0
    """Probability that a sampled client is unavailable in a round (seeded per client and round): its download is
    counted, its upload never arrives."""
    attack: Attack | None = None
    """Hostile clients for robustness studies (``SignFlip``, ``Scaling``, ``GaussianNoise``, ``ALIE``, ``NaNUpload``);
    ``null``: every client is honest."""
    privacy: Privacy | None = None
    """User-level differential privacy (``CentralDP``, ``DistributedDP``, ``LocalDP``), with an accountant; ``null``:
    none. See docs/privacy.md."""
    dp_sgd: DPSGD | None = None
    """Record-level DP-SGD inside every client (``DPSGD``), with each client's own accountant; combines with
    ``privacy``. ``null``: plain local training. See docs/privacy.md."""
    privacy_audit: PrivacyAudit | None = None
    """Canary clients that measure what the released states leak (``PrivacyAudit``: Andrew et al.'s one-shot
    epsilon-hat and Steinke et al.'s one-run lower bound), printed beside the accountant's epsilon and written to
    ``privacy_audit.json``; needs ``privacy`` or ``dp_sgd``. ``null``: no audit. See docs/privacy.md."""
    privacy_ledger: str | None = None
    """Folder of the population privacy ledgers a private run charges (every released round of every run drawing on
    the same data set and partition, docs/privacy.md, "The population's ledger"); ``null``: the environment variable
    ``LIGHTNING_FL_PRIVACY_LEDGER``, else ``<user cache>/lightning_fl/privacy_ledger``."""
    population: str | None = None
    """A label that starts a new private population deliberately (e.g. data collected anew under the same settings):
    its ledger starts empty. ``null``: the data module's identity alone names the population."""
    secure_aggregation: SecureAggregation | None = None
    """The server learns only the sum of each round's updates (``SecureAggregation``: SecAgg+'s clipping, quantisation
    and modular sum); linear, unweighted strategies only. ``null``: off."""
    clock: Clock | None = None
    """Simulated time for every round (``Clock``: each client's device speed and link, a deadline, over-selection):
    ``time/simulated_round_s`` and ``time/simulated_elapsed_s``; in process only. ``null``: no clock. See
    docs/explanations/time.md."""
    buffered: FedBuff | None = None
    """Buffered asynchronous aggregation (``FedBuff``: ``concurrency`` clients train at once, the server steps every
    ``buffer_size`` updates, discounted by staleness): one of ``rounds`` is one server step; needs ``clock``, in process
    only. ``null``: synchronous rounds. See docs/explanations/time.md."""
    sampling: Literal["fixed", "poisson"] = "fixed"
    """``fixed`` (``clients_per_round`` clients without replacement) or ``poisson`` (each client with probability
    ``clients_per_round / num_clients``, as most DP analyses assume)."""
    fold_groups: int = 1
    """Running sums a linear strategy adds uploads into (client ``c`` into sum ``c % fold_groups``); the global state
    depends on this number, never on the number of processes; a multiple of the number of processes lets each stream its
    own groups (docs/explanations/round.md, "Streaming")."""
    seed: int | None = None
    """Seed of client sampling and client training; default: the run's ``seed_everything``."""
    accelerator: str = "auto"
    """Fabric accelerator (``cpu``, ``gpu``, ``auto``)."""
    devices: int | str = 1
    """Processes/devices the clients are spread over (``2`` on CPU uses gloo); with several nodes, per node."""
    num_nodes: int = 1
    """Machines the processes span (``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK`` set on each, or a cluster's
    launcher); see docs/deploy.md."""
    fabric_strategy: str = "auto"
    """Fabric's launch strategy (``auto`` picks DDP for several devices; no gradients are synchronised, processes only
    exchange uploads)."""
    precision: str | None = None
    """Fabric precision (``32-true``, ``bf16-mixed``, ``16-mixed``, ...); ``null``: 32-bit."""
    threads: int | None = None
    """CPU threads per process for torch while the trainer runs; ``null``: those chosen already are kept (the CLI's
    top-level ``threads`` key, ``lightning_fl.set_threads``, ``torch.set_num_threads``, ``OMP_NUM_THREADS``), else the
    CLI's default: one fewer than the cores (at least 1), shared among a node's processes. In a config, set the
    top-level ``threads`` key instead, which also covers what is built before the trainer runs."""
    default_root_dir: str = "runs"
    """Runs go to ``<default_root_dir>/<name>/<version>/``; ``validate`` and ``test`` write a new ``validate_N`` or
    ``test_N`` folder beside them."""
    name: str = "federated"
    """Experiment name (folder under ``default_root_dir``)."""
    version: int | str | None = None
    """Run folder name or number of a fit; ``null`` picks the next ``version_N``."""
    logger: bool = True
    """Write TensorBoard logs."""
    resume: bool | Literal["auto"] = False
    """``auto`` continues the newest run of ``name`` that has a checkpoint (``--ckpt_path`` wins)."""
    val_every_n_rounds: int = 1
    """Evaluate the global model every this many rounds (and after the last one)."""
    limit_val_batches: int | None = None
    """Evaluate on at most this many validation batches (0: no evaluation)."""
    test_after_fit: bool = False
    """Evaluate on the test split twice: the starting model before the first round and the final global model after
    the last (``test/*``, printed in the summary). The test split then chooses nothing; ``val/*`` does."""
    gradient_clip_val: float | None = None
    """Clip client gradient norms; ``null`` uses the module's ``grad_clip``, if any."""
    check_identity: bool = True
    """Log the averaging identity error (modules with ``averaging_identity_error``, linear strategies only)."""
    unprotected_statistics: bool = False
    """In a private run (``privacy`` or ``dp_sgd``) also log what the server computes from the clients' updates, or
    the clients log, outside the mechanism (``train/*``, ``fed/update_norm_median``, ``fed/update_norm_max_ratio``,
    ``fed/identity_error``, ``fed/dropped_clients``, ``comm/rejected_bytes``), renamed ``unprotected/<key>``: not
    covered by the privacy guarantee. ``false``: they are kept out of the metrics, TensorBoard, the checkpoints'
    history and every file the run writes. A run without privacy logs them under their own names."""
    enable_progress_bar: bool = True
    """Progress bars on a terminal (over rounds, and over a round's clients); ``false``: no bars. Wherever there is no
    bar (output to a file or a CI log, or the bars off) a plain line reports every tenth of the run."""
    save_every_n_rounds: int = 0
    """Also keep ``round_NNNN.ckpt`` every this many rounds (``last.ckpt`` is always kept)."""
    client_batching: Literal["sequential", "vmap", "lockstep"] = "sequential"
    """``sequential``, ``vmap`` (``cohort_size`` clients at a time as one vectorised computation, for latent methods)
    or ``lockstep`` (``cohort_size`` FLITE clients with stored factors step together, sharing the mapping's matrix
    products, each client's network run alone); both equal up to float32 rounding; in process only;
    docs/cross_device.md."""
    cohort_size: int = 32
    """Clients per cohort with ``client_batching: vmap`` or ``lockstep``."""
    client_state_memory_mb: float | None = None
    """Memory (MiB) for the codec's per-client state; the rest goes to files in the run folder (one process only;
    docs/cross_device.md). ``null``: all in memory."""
    callbacks: list[Callback] | None = None
    """Your own :class:`~lightning_fl.federated.callbacks.Callback` objects, called after the trainer's own at the start
    of the rounds, at the end of every round and after the last."""
    transport: Transport | None = None
    """How rounds reach clients: ``null`` in process (the simulation; ``client_batching`` picks how); a Flower ServerApp
    passes its own (:class:`~lightning_fl.flower.transport.FlowerTransport`)."""

    def __post_init__(self) -> None:
        if problems := trainer_problems(vars(self)):
            raise ConfigError("; ".join(problems))

    @property
    def norm_gate_ratio(self) -> float | None:
        """``max_update_norm_ratio`` as the gate applies it (``auto`` resolved; ``None``: off)."""
        return norm_gate_ratio(vars(self))

    @property
    def norm_gate_note(self) -> str | None:
        """The summary's line when ``max_update_norm_ratio: auto`` turned the gate off (``None``: it did not)."""
        return norm_gate_note(vars(self))


#: What ``trainer.max_update_norm_ratio: auto`` is when no mechanism clips every upload.
DEFAULT_NORM_RATIO = 10.0
#: Why the summary says the default gate is off.
NOTE_TAIL = "the clip bound bounds every upload instead"


def clipping_mechanism(a: dict[str, Any]) -> str | None:
    """The key whose mechanism clips every upload to a public bound (``trainer.privacy`` CentralDP or DistributedDP,
    ``trainer.secure_aggregation``), which turns ``max_update_norm_ratio: auto`` off; ``None``: there is none."""
    if isinstance(a["privacy"], Privacy) and a["privacy"].central:
        return f"trainer.privacy {type(a['privacy']).__name__}"
    if a["secure_aggregation"] is not None:
        return "trainer.secure_aggregation"
    return None


def norm_gate_ratio(a: dict[str, Any]) -> float | None:
    """The relative bound the gate applies for the trainer's arguments ``a``: ``max_update_norm_ratio``, with ``auto``
    :data:`DEFAULT_NORM_RATIO`, or ``None`` (off) under a :func:`clipping_mechanism`."""
    value = a["max_update_norm_ratio"]
    if value != "auto":
        return value
    return None if clipping_mechanism(a) is not None else DEFAULT_NORM_RATIO


def norm_gate_note(a: dict[str, Any]) -> str | None:
    """The summary's line when ``max_update_norm_ratio: auto`` is off (``None``: it is not)."""
    if a["max_update_norm_ratio"] != "auto" or (mechanism := clipping_mechanism(a)) is None:
        return None
    return f"relative norm gate off (trainer.max_update_norm_ratio auto under {mechanism}): {NOTE_TAIL}"


def _devices_problems(devices: Any, accelerator: str, num_nodes: int) -> list[str]:
    d = str(devices).replace(" ", "")
    gpu_list = "," in d and d.strip(",") != "" and all(i.isdigit() for i in d.split(",") if i)
    if not (d in ("auto", "-1") or (d.isdigit() and int(d) >= 1) or gpu_list):
        return [f"trainer.devices must be a number of processes >= 1, -1 (all GPUs), 'auto' or GPU indices such as "
                f"'0,1', got {devices!r}"]  # fmt: skip
    if accelerator == "cpu" and (d == "-1" or gpu_list):
        return [f"trainer.devices {devices!r} selects GPUs but trainer.accelerator is cpu: give a number of processes"]
    if num_nodes > 1 and d in ("auto", "-1"):
        return [f"trainer.devices must be a number of processes per node when trainer.num_nodes > 1 (every node must "
                f"start the same number), got {devices!r}"]  # fmt: skip
    return []


def trainer_problems(a: dict[str, Any]) -> list[str]:
    """What is wrong with the trainer's arguments ``a`` (the fields of :class:`TrainerArguments` by name)."""
    ranges = {  # key: (holds, what it must be)
        "rounds": (a["rounds"] >= 1, ">= 1"),
        "clients_per_round": (a["clients_per_round"] is None or a["clients_per_round"] >= 1, ">= 1 or null"),
        "local_epochs": (a["local_epochs"] >= 1, ">= 1"),
        "local_steps": (a["local_steps"] is None or a["local_steps"] >= 1, ">= 1 or null"),
        "upload_policy": (a["upload_policy"] in ("drop", "raise"), "'drop' or 'raise'"),
        "dropout": (0 <= a["dropout"] < 1, "in [0, 1)"),
        "num_nodes": (a["num_nodes"] >= 1, ">= 1"),
        "resume": (a["resume"] in (True, False, "auto"), "true, false or 'auto'"),
        "val_every_n_rounds": (a["val_every_n_rounds"] >= 1, ">= 1"),
        "save_every_n_rounds": (a["save_every_n_rounds"] >= 0, ">= 0"),
        "client_batching": (a["client_batching"] in ("sequential", "vmap", "lockstep"),
                            "'sequential', 'vmap' or 'lockstep'"),
        "cohort_size": (a["cohort_size"] >= 1, ">= 1"),
        "client_state_memory_mb": (a["client_state_memory_mb"] is None or (
            math.isfinite(a["client_state_memory_mb"]) and a["client_state_memory_mb"] >= 0), ">= 0 or null"),
        "sampling": (a["sampling"] in ("fixed", "poisson"), "'fixed' or 'poisson'"),
        "fold_groups": (isinstance(a["fold_groups"], int) and a["fold_groups"] >= 1, "a whole number >= 1"),
        "threads": (a["threads"] is None or (isinstance(a["threads"], int) and not isinstance(a["threads"], bool)
                                             and a["threads"] >= 1), "a whole number >= 1 or null"),
    }  # fmt: skip
    for key in ("max_update_norm", "max_update_norm_ratio", "max_client_weight"):
        value, auto = a[key], key == "max_update_norm_ratio"
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        ok = value is None or number or (auto and value == "auto")
        ranges[key] = (ok, "a positive number, 'auto' or null" if auto else "a positive number or null")
    kinds = {  # key: (class, its names in the message)
        "strategy": (Strategy, "a Strategy"),
        "privacy": (Privacy, "CentralDP, DistributedDP, LocalDP or null"),
        "privacy_audit": (PrivacyAudit, "PrivacyAudit or null"),
        "dp_sgd": (DPSGD, "DPSGD or null"),
        "secure_aggregation": (SecureAggregation, "SecureAggregation or null"),
        "transport": (Transport, "a Transport or null"),
        "clock": (Clock, "Clock or null"),
        "buffered": (FedBuff, "FedBuff or null"),
    }
    quoted = {"upload_policy", "resume", "client_batching", "sampling", "fold_groups", "threads"}
    shown = {key: repr(a[key]) if key in quoted else str(a[key]) for key in ranges}
    problems = [f"trainer.{key} must be {what}, got {shown[key]}" for key, (ok, what) in ranges.items() if not ok]
    problems += [f"trainer.{key} must be {names}, got {type(a[key]).__name__}" for key, (kind, names) in kinds.items()
                 if not isinstance(a[key], kind) and (key == "strategy" or a[key] is not None)]  # fmt: skip
    fraction, per_round = a["client_fraction"], a["clients_per_round"]
    if not (0 < fraction <= 1 if fraction is not None else per_round is not None):
        problems.insert(0, f"trainer.client_fraction must be in (0, 1] (or null with trainer.clients_per_round set), "
                           f"got {fraction}")  # fmt: skip
    problems += _devices_problems(a["devices"], a["accelerator"], a["num_nodes"])
    if isinstance(a["privacy"], Privacy) and a["privacy"].central and a["upload_policy"] == "raise":
        problems.append(f"trainer.upload_policy 'raise' with trainer.privacy {type(a['privacy']).__name__}: one "
                        "client's upload (its data) would decide whether the whole run stops, which the guarantee "
                        "does not cover; use trainer.upload_policy drop")  # fmt: skip
    if a["unprotected_statistics"] is True and a["privacy"] is None and a["dp_sgd"] is None:
        problems.append(
            "trainer.unprotected_statistics labels the statistics a private run keeps out of its logs, and this run "
            "has no trainer.privacy or trainer.dp_sgd (it logs them as they are): remove the key"
        )
    problems += ledger_problems(a)
    if a["unprotected_statistics"] not in (True, False):
        problems.append(f"trainer.unprotected_statistics must be true or false, got {a['unprotected_statistics']!r}")
    if a["privacy_audit"] is not None and a["privacy"] is None and a["dp_sgd"] is None:
        problems.append("trainer.privacy_audit audits trainer.privacy or trainer.dp_sgd: set one, or remove "
                        "trainer.privacy_audit")  # fmt: skip
    if a["privacy_audit"] is not None and a["privacy"] is None and a["client_batching"] != "sequential":
        problems.append("trainer.privacy_audit of DP-SGD scores each step of one client trained alone: set "
                        "trainer.client_batching sequential")  # fmt: skip
    private = a["dp_sgd"] is not None or (isinstance(a["privacy"], Privacy) and a["privacy"].client_stage)
    if private and getattr(a["strategy"], "weighted", False):
        problems.append("trainer.strategy weighted: true weighs uploads by their clients' sample counts, which a "
                        "client under local DP, distributed DP or DP-SGD does not send (they are its data); set "
                        "weighted: false")  # fmt: skip
    if a["dp_sgd"] is not None and a["gradient_clip_val"] is not None:
        problems.append("trainer.gradient_clip_val clips a batch's gradient, which DP-SGD replaces by clipping each "
                        "record's (trainer.dp_sgd.max_grad_norm): remove trainer.gradient_clip_val")  # fmt: skip
    if a["dp_sgd"] is not None and a["precision"] not in (None, "32-true", "32", 32):
        problems.append(f"trainer.dp_sgd trains in 32-bit; trainer.precision is {a['precision']!r}: set it to "
                        "32-true or null")  # fmt: skip
    if isinstance(secure := a["secure_aggregation"], SecureAggregation):
        problems += secure.problems(a["strategy"], a["privacy"], a["codec"], norm_gate_ratio(a), a["attack"])
    problems += downlink_problems(a["compressed_downloads"], a["codec"], secure) + clock_problems(a)
    return problems + (buffered_problems(a) if isinstance(a["buffered"], FedBuff) else [])


def clock_problems(a: dict[str, Any]) -> list[str]:
    """What makes ``trainer.clock`` impossible with the other settings (one line each)."""
    clock = a["clock"]
    if not isinstance(clock, Clock):
        return []
    if a["transport"] is not None and a["buffered"] is None:  # (FedBuff's own line says it)
        return ["trainer.clock simulates the time of rounds run in process; a Flower run's rounds take real time "
                "(time/round_s): remove trainer.clock"]  # fmt: skip
    if clock.over_selection > 0 and a["privacy"] is not None:
        return [f"trainer.clock.over_selection {clock.over_selection} samples more clients than trainer.privacy's "
                "accountant and fixed denominator assume (clients_per_round): set over_selection 0 (a deadline alone "
                "is covered: a late client adds zero)"]  # fmt: skip
    return []


def downlink_problems(compressed_downloads: object, codec: object, secure_aggregation: object) -> list[str]:
    """What makes ``trainer.compressed_downloads`` impossible with the other settings (one line each)."""
    if compressed_downloads is False:
        return []
    if compressed_downloads is not True:
        return [f"trainer.compressed_downloads must be true or false, got {compressed_downloads!r}"]
    if secure_aggregation is not None:
        return ["trainer.compressed_downloads compresses the broadcast with the codec's compressor, but "
                "trainer.secure_aggregation uploads with none (codec FP32): remove one of the two keys"]  # fmt: skip
    if not isinstance(codec, UpdateCompressor):
        return [f"trainer.compressed_downloads compresses the broadcast with the codec's compressor and error "
                f"feedback, and trainer.codec {configured_name(codec)} is not a compressor: set trainer.codec TopK "
                "or PowerSGD, or remove the key"]  # fmt: skip
    return []

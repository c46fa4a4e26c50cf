"""The arguments of :class:`~lightning_fl.federated.FederatedTrainer` (the CLI's ``trainer.*`` keys) as a typed
dataclass, checked when it is made (:mod:`lightning_fl.federated.trainer.argument_checks`): every impossible value or
combination, one line each naming the key and what to write instead, raised together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_fl.compress.base import FP32, Codec
from lightning_fl.errors import ConfigError
from lightning_fl.federated.arrivals.clock import Clock
from lightning_fl.federated.arrivals.fedbuff import FedBuff
from lightning_fl.federated.clients.transport import Transport
from lightning_fl.federated.server.attacks import Attack
from lightning_fl.federated.server.strategies import FedAvg, Strategy
from lightning_fl.federated.trainer.argument_checks import norm_gate_note, norm_gate_ratio, trainer_problems
from lightning_fl.federated.trainer.callbacks import Callback
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
    """Your own :class:`~lightning_fl.federated.trainer.callbacks.Callback` objects, called after the trainer's own at
    the start of the rounds, at the end of every round and after the last."""
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

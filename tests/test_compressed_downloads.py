"""Compressed downloads (``trainer.compressed_downloads``): the server broadcasts its step compressed by the codec's
compressor with its own error feedback, every client holds the server's state bit for bit, the ledger charges the
broadcasts' payload bytes, a resumed run equals an uninterrupted one, and the option is off by default."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import make_dm, make_model, make_trainer
from lightning_fl.checkpoint import content_digest
from lightning_fl.compress import Downlink, PayloadError, PowerSGD, Quantize, TopK, apply_broadcast, wire
from lightning_fl.compress.downlink import SERVER
from lightning_fl.errors import CheckpointError, ConfigError
from lightning_fl.federated import FederatedTrainer, Median
from lightning_fl.federated.clients.transport import InProcess, Transport
from lightning_fl.methods import Classifier, Recipe
from lightning_fl.models import SmallCNN
from lightning_fl.privacy import CentralDP
from lightning_fl.privacy.secure import SecureAggregation


def make_classifier():
    """Full-weight FedAvg of a tiny CNN: matrix-shaped tensors, so PowerSGD compresses them."""
    torch.manual_seed(0)
    backbone = SmallCNN(image_size=8, channels=[8, 16], norm_groups=4)
    return Classifier(backbone, 10, recipe=Recipe(lr=0.05, warmup_epochs=0, schedule="constant"))


#: label: (codec, model, extra trainer arguments); the latent is 24 floats (top-k keeps 5), the CNN 9,592 weights
CASES = {
    "topk-latent": (lambda: TopK(density=0.2), make_model, dict),
    "powersgd-weights": (lambda: PowerSGD(rank=1), make_classifier, dict),
    "topk-weights-median": (lambda: TopK(density=0.05), make_classifier, lambda: {"strategy": Median()}),
    "topk-latent-central-dp": (
        lambda: TopK(density=0.2),
        make_model,
        # seeded: with OS cohorts a draw in which no client misses two broadcasts would fail the test by chance
        lambda: {
            "privacy": CentralDP(clip_norm=1.0, noise_multiplier=0.5, noise_seed=0),
            "max_update_norm_ratio": None,
        },
    ),
}


class Clients(InProcess):
    """In-process clients that also rebuild, each on its own, the state the server sends them: a client receives
    the full state the first time it is sampled, and later applies (from their wire bytes) the broadcasts it
    missed since. Each time it must hold exactly the state the server hands the round."""

    def __init__(self, trainer: FederatedTrainer, codec) -> None:
        super().__init__()
        self.trainer, self.codec = trainer, codec  # (a codec of its own: decoding needs its settings only)
        self.broadcasts: list[bytes | None] = []  # per finished round: the broadcast's wire bytes (None: none)
        self.sizes: list[int] = []  # per finished round: its payload bytes
        self.held: dict[int, tuple[int, dict]] = {}  # client -> (the round whose state it holds, that state)
        self.expected_down: dict[int, int] = {}  # client -> bytes it needed, by this test's own count
        self.caught_up = 0  # times a client applied more than one broadcast at once

    def catch_up(self, client: int, upto: int) -> dict:
        since, state = self.held[client]
        missed = [data for data in self.broadcasts[since:upto] if data is not None]
        self.caught_up += len(missed) > 1
        for data in missed:
            state = apply_broadcast(self.codec, state, wire.loads(data))
        return state

    def replies(self, job, clients):
        state, round = job.state, job.round
        full = 4 * sum(t.numel() for t in state.values())
        for c in clients:
            if c in self.held:
                mine = self.catch_up(c, round)
                need = min(full, sum(self.sizes[self.held[c][0] : round]))
            else:
                mine, need = {n: t.detach().cpu().clone() for n, t in state.items()}, full
            for n, t in state.items():
                assert torch.equal(mine[n], t.cpu()), f"client {c}, round {round + 1}: {n} differs from the server's"
            self.held[c] = (round, mine)
            self.expected_down[c] = self.expected_down.get(c, 0) + need
        yield from super().replies(job, clients)

    def finished_round(self, round, metrics) -> None:
        last = self.trainer.downlink.last
        self.broadcasts.append(None if last is None else wire.dumps(last))
        self.sizes.append(0 if last is None else last.nbytes)
        assert metrics["comm/broadcast_bytes"] == self.sizes[-1]


@pytest.mark.parametrize("case", CASES)
def test_every_client_holds_the_servers_state_bit_for_bit_and_downloads_the_broadcast_bytes(tmp_path, case):
    codec, model, extra = CASES[case]
    trainer = make_trainer(
        tmp_path, rounds=4, codec=codec(), clients_per_round=2, compressed_downloads=True, logger=False, **extra()
    )
    clients = trainer.transport = Clients(trainer, codec())
    trainer.fit(model(), datamodule=make_dm())
    full = 4 * sum(t.numel() for t in trainer.global_state.values())
    assert all(0 < size < full for size in clients.sizes)  # every round broadcast, compressed
    assert clients.caught_up  # (the sampling has a client miss broadcasts and apply several)
    for c in clients.held:  # after the last broadcast too
        final = clients.catch_up(c, len(clients.broadcasts))
        assert all(torch.equal(final[n], t.cpu()) for n, t in trainer.global_state.items())
    want = torch.tensor([clients.expected_down.get(c, 0) for c in range(4)])
    assert torch.equal(trainer.ledger.down, want)
    assert [h["comm/broadcast_bytes"] for h in trainer.history[1:]] == clients.sizes
    # the same codec and layout as an upload: a broadcast has exactly an upload's bytes
    assert clients.sizes == [h["comm/client_up_bytes"] for h in trainer.history[1:]]


def test_the_server_keeps_what_compression_left_out_and_sends_it_later():
    """``e_{t+1} = (step + e_t) - D(b_t)`` with ``e_0 = 0``: the broadcasts plus the memory add up to the steps; the
    memory is the downlink's own (the upload codec's clients are untouched); a copy restored from the state dict
    continues identically."""
    g = torch.Generator().manual_seed(0)
    state = {"fc.weight": torch.randn(6, 5, generator=g), "fc.bias": torch.randn(6, generator=g)}
    codec = PowerSGD(rank=1)
    downlink = Downlink(codec)
    downlink.start(num_clients=3)
    steps = [{n: 0.1 * torch.randn(t.shape, generator=g) for n, t in state.items()} for _ in range(3)]
    sent = {n: torch.zeros_like(t) for n, t in state.items()}
    start, copy = state, None
    for i, step in enumerate(steps):
        if i == 1:  # a resumed server from here on
            copy = Downlink(codec)
            copy.start(num_clients=3)
            copy.load_state_dict(downlink.state_dict(), rounds_done=1)
            twin_state = state
        state, payload = downlink.broadcast(step, state)
        if copy is not None:
            twin_state, twin = copy.broadcast(step, twin_state)
            assert wire.dumps(twin) == wire.dumps(payload)
            assert all(torch.equal(twin_state[n], state[n]) for n in state)
        sent = {n: sent[n] + codec.decompress(payload, state, SERVER)[n] for n in state}
    memory = downlink.codec.residuals[SERVER]
    assert any(float(m.abs().max()) > 1e-4 for m in memory.values())  # rank 1 left something out
    for n in state:
        total = sum(step[n] for step in steps)
        torch.testing.assert_close(sent[n] + memory[n], total, atol=1e-6, rtol=0)
        torch.testing.assert_close(state[n] - start[n], sent[n], atol=1e-6, rtol=0)
    assert len(codec.residuals) == 0 and len(codec.queries) == 0
    assert downlink.sizes == [payload.nbytes] * 3 and payload.nbytes == 4 * (6 + 5 + 6)  # p, q and the bias


def test_a_client_refuses_a_broadcast_that_does_not_fit_its_state():
    downlink = Downlink(TopK(density=0.5))
    downlink.start(num_clients=1)
    state = {"w": torch.zeros(4)}
    _, payload = downlink.broadcast({"w": torch.tensor([1.0, -2.0, 0.5, 0.0])}, state)
    with pytest.raises(PayloadError, match="broadcast refused"):
        apply_broadcast(TopK(density=0.5), {"w": torch.zeros(5)}, payload)


def test_a_client_refuses_a_broadcast_with_a_non_finite_value():
    downlink = Downlink(TopK(density=0.5))
    downlink.start(num_clients=1)
    _, payload = downlink.broadcast({"w": torch.tensor([1.0, -2.0, 0.5, 0.0])}, {"w": torch.zeros(4)})
    next(t for e in payload.tensors.values() for t in e.parts.values() if t.is_floating_point())[0] = float("nan")
    with pytest.raises(PayloadError, match="broadcast refused: .*1 non-finite values"):
        apply_broadcast(TopK(density=0.5), {"w": torch.zeros(4)}, payload)


def test_downloads_are_charged_by_the_broadcasts_a_client_missed_or_the_full_state():
    downlink = Downlink(TopK(density=0.5))
    downlink.start(num_clients=3)
    assert downlink.download(0, 0, full=100) == 100  # never held a state
    downlink.broadcast({"w": torch.ones(4)}, {"w": torch.zeros(4)})  # 2 entries: 16 bytes
    assert downlink.download(0, 1, full=100) == 16
    for _ in range(6):
        downlink.skip()  # refused aggregates: nothing sent
    downlink.broadcast({"w": torch.ones(4)}, {"w": torch.zeros(4)})
    assert downlink.sizes == [16, 0, 0, 0, 0, 0, 0, 16]
    assert downlink.download(0, 8, full=100) == 16  # it held round 1's state: six empty broadcasts and one of 16
    assert downlink.download(1, 8, full=100) == 100
    held = Downlink(TopK(density=0.5))
    held.start(num_clients=3)
    held.load_state_dict(downlink.state_dict(), rounds_done=8)
    for _ in range(7):
        held.broadcast({"w": torch.ones(4)}, {"w": torch.zeros(4)})
    assert held.download(0, 15, full=100) == 100  # seven broadcasts (112 bytes) cost more than the state
    with pytest.raises(ValueError, match="one broadcast per round"):
        held.load_state_dict(downlink.state_dict(), rounds_done=7)


def test_a_round_whose_aggregate_is_refused_broadcasts_nothing(tmp_path):
    # every upload exceeds max_update_norm: no round has an aggregate
    trainer = make_trainer(
        tmp_path, rounds=2, codec=TopK(density=0.2), compressed_downloads=True, logger=False, max_update_norm=1e-12
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(make_model(), datamodule=make_dm())
    assert [h["comm/broadcast_bytes"] for h in trainer.history[1:]] == [0.0, 0.0]
    assert trainer.ledger.down.tolist() == [4 * 24] * 4  # the state once; then nothing changed
    assert trainer.downlink.last is None


@pytest.mark.parametrize("case", ["topk-latent", "powersgd-weights"])
def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, case):
    codec, model, extra = CASES[case]

    def trainer(folder, rounds, **kwargs):
        return make_trainer(
            tmp_path / folder,
            rounds=rounds,
            codec=codec(),
            clients_per_round=2,
            logger=False,
            compressed_downloads=True,
            **extra(),
            **kwargs,
        )

    full = trainer("a", 4)
    full.fit(model(), datamodule=make_dm())
    first = trainer("b", 2, name="split")
    first.fit(model(), datamodule=make_dm())
    resumed = trainer("b", 4, name="split")
    resumed.fit(model(), datamodule=make_dm(), ckpt_path=str(first.log_dir / "checkpoints" / "last.ckpt"))
    assert all(torch.equal(full.global_state[n], t) for n, t in resumed.global_state.items())
    assert content_digest(full.downlink.state_dict()) == content_digest(resumed.downlink.state_dict())
    assert torch.equal(full.ledger.down, resumed.ledger.down) and torch.equal(full.ledger.up, resumed.ledger.up)
    assert [h["comm/broadcast_bytes"] for h in full.history[1:]] == [
        h["comm/broadcast_bytes"] for h in resumed.history[1:]
    ]
    saved = torch.load(first.log_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert any(float(t.abs().max()) > 0 for t in saved["downlink"]["codec"]["residuals"][str(SERVER)].values())


def test_off_by_default_downloads_full_states_and_saves_nothing_new(tmp_path, monkeypatch):
    """The default never touches the downlink: the same rounds, ledger and checkpoint as before the option existed
    (checked bit for bit against the commit before it, 8fd803c, on top-k and PowerSGD runs)."""

    def untouched(*args, **kwargs):
        raise AssertionError("the downlink ran with compressed downloads off")

    for name in ("start", "download", "broadcast", "skip"):
        monkeypatch.setattr(Downlink, name, untouched)
    trainer = make_trainer(tmp_path, rounds=3, codec=TopK(density=0.2), clients_per_round=2)
    assert trainer.compressed_downloads is False and trainer.downlink is None
    trainer.fit(make_model(), datamodule=make_dm())
    sampled = [trainer.strategy.sample(r, 4, 2, 0) for r in range(3)]
    want = torch.tensor([4 * 24 * sum(c in s for s in sampled) for c in range(4)])
    assert torch.equal(trainer.ledger.down, want)
    assert not any("comm/broadcast_bytes" in h for h in trainer.history)
    saved = torch.load(trainer.log_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert "downlink" not in saved


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "trainer.codec FP32 is not a compressor: set trainer.codec TopK or PowerSGD"),
        ({"codec": Quantize(8, target="update")}, "trainer.codec Quantize is not a compressor"),
        (
            {"secure_aggregation": SecureAggregation(), "max_update_norm_ratio": None},
            "trainer.secure_aggregation uploads with none",
        ),
        ({"codec": TopK(), "compressed_downloads": "yes"}, "must be true or false, got 'yes'"),
    ],
)
def test_settings_it_cannot_serve_are_refused_in_one_line(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message) as err:
        make_trainer(tmp_path, **{"compressed_downloads": True, **kwargs})
    assert "\n" not in str(err.value)


class Remote(Transport):
    """A transport whose clients are not in this process (as on Flower)."""

    spreads_over_processes = False


def test_a_transport_to_other_machines_is_refused_before_any_round(tmp_path):
    trainer = make_trainer(tmp_path, codec=TopK(), compressed_downloads=True, logger=False)
    trainer.transport = Remote()
    with pytest.raises(ConfigError, match="simulated in process: on Flower"):
        trainer.fit(make_model(), datamodule=make_dm())


def test_resuming_across_the_option_is_refused(tmp_path):
    def run(folder, on, rounds, ckpt=None):
        trainer = make_trainer(
            tmp_path / folder, rounds=rounds, codec=TopK(density=0.2), compressed_downloads=on, logger=False
        )
        trainer.fit(make_model(), datamodule=make_dm(), ckpt_path=ckpt)
        return str(trainer.log_dir / "checkpoints" / "last.ckpt")

    on, off = run("on", True, 1), run("off", False, 1)
    with pytest.raises(CheckpointError, match="written with trainer.compressed_downloads"):
        run("x", False, 2, on)
    with pytest.raises(CheckpointError, match="written without trainer.compressed_downloads"):
        run("y", True, 2, off)

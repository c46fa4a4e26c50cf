"""Secure aggregation's arithmetic (lightning_fl.privacy.secure) against Flower's own SecAgg+ code: our seeded
quantisation survives Flower's quantisation unchanged, and the server's dequantisation of the modular sum gives
our exact sum back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fl.errors import ConfigError
from lightning_fl.privacy.secure import SecureSum


def updates(n, size, scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g, dtype=torch.float64) * scale for _ in range(n)]


def test_flowers_quantisation_maps_our_grid_values_back_to_our_integers_exactly():
    from flwr.common.secure_aggregation.quantization import quantize

    secure = SecureSum(clipping_range=0.25, quantization_range=2**22)
    for k, x in enumerate(updates(5, 10_000, 0.2)):  # some coordinates beyond c: clipped
        y = secure.quantize(x, torch.Generator().manual_seed(k))
        assert int(y.min()) >= 0 and int(y.max()) <= secure.T and (x.abs() > 0.25).any()
        for state in (0, 1):  # whatever Flower's unseeded rounding draws, it has nothing left to round
            np.random.seed(state)
            (theirs,) = quantize([secure.on_grid(y).numpy()], secure.c, secure.T)
            assert np.array_equal(theirs.astype(np.int64), y.numpy())


def test_the_servers_dequantisation_of_the_modular_sum_gives_our_exact_sum():
    from flwr.common.secure_aggregation.quantization import dequantize

    secure, n = SecureSum(clipping_range=0.5, quantization_range=2**20, modulus_range=2**32), 7
    ys = [secure.quantize(x, torch.Generator().manual_seed(k)) for k, x in enumerate(updates(n, 5_000, 0.3))]
    total = secure.modular_sum(ys)
    ours = secure.recover(total, n)
    torch.testing.assert_close(ours, sum(secure.dequantize(y) for y in ys), rtol=0, atol=1e-12)
    # Flower's server (SecAggPlusWorkflow's unmask stage), each client weighted 1 (its factor T): a mean
    (mean,) = dequantize([total.numpy()], secure.c, secure.T)
    mean = (mean + -(n - 1) * secure.c) * (secure.T / (n * secure.T))
    exact = total - n * (secure.T // 2)
    assert np.array_equal(np.rint(mean * n / secure.step).astype(np.int64), exact.numpy())
    np.testing.assert_allclose(mean * n, ours.numpy(), rtol=0, atol=1e-9)


def test_the_rounding_is_unbiased_seeded_and_clips_to_the_range():
    secure = SecureSum(clipping_range=1.0, quantization_range=2**4)  # a coarse step (1/8): rounding is visible
    x = torch.tensor([0.3, -0.77, 2.0, -5.0, 0.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([secure.dequantize(secure.quantize(x, g)) for _ in range(20_000)])
    torch.testing.assert_close(draws.mean(0), x.clamp(-1, 1), rtol=0, atol=4e-3)
    assert set(torch.unique(draws[:, 0]).tolist()) == {0.25, 0.375}  # the two grid points around 0.3
    assert torch.equal(secure.quantize(x, torch.Generator().manual_seed(3)),
                       secure.quantize(x, torch.Generator().manual_seed(3)))  # fmt: skip


def test_secure_rounding_draws_from_the_os_unless_a_seed_is_given():
    """``noise_seed: null`` promises the operating system's randomness everywhere: secure aggregation's rounding too,
    by default (two uploads of one update round apart); an integer ``rounding_seed`` rounds reproducibly."""
    from lightning_fl.privacy.secure import SecureAggregation

    start = {"w": torch.zeros(4096)}
    state = {"w": torch.full((4096,), 0.3)}  # between two grid points: every coordinate is rounded at random
    assert SecureAggregation().rounding_seed is None

    def upload(secure):
        return secure.encode(state, start, client=1, round=2, seed=0).tensors["secure"].parts["q"]

    default = SecureAggregation(clipping_range=1.0, quantization_range=2**4)
    assert not torch.equal(upload(default), upload(default))
    seeded = SecureAggregation(clipping_range=1.0, quantization_range=2**4, rounding_seed=7)
    assert torch.equal(upload(seeded), upload(seeded))


def test_a_sum_that_would_wrap_is_refused_and_settings_must_be_powers_of_two():
    secure = SecureSum(clipping_range=1.0, quantization_range=2**8, modulus_range=2**10)
    assert secure.max_clients == 3
    ys = [torch.full((4,), 200, dtype=torch.int64)] * 4  # 800 > 2^10: wraps
    assert int(secure.modular_sum(ys)[0]) == 800 % 1024
    with pytest.raises(ConfigError, match="4 clients would wrap the sum modulo modulus_range=1024"):
        secure.recover(secure.modular_sum(ys), 4)
    with pytest.raises(ConfigError, match="clipping_range must be a power of two"):
        SecureSum(clipping_range=0.3)
    with pytest.raises(ConfigError, match="modulus_range must be a power of two above quantization_range"):
        SecureSum(quantization_range=2**20, modulus_range=2**20)


# ------------------------------------------------------------------------------------------ secure rounds
def secure_fit(tmp_path, name, secure=None, rounds=2, **kwargs):
    import warnings

    from conftest import make_dm, make_model, make_trainer

    trainer = make_trainer(tmp_path, rounds=rounds, name=name, max_update_norm_ratio=None, check_identity=False,
                           secure_aggregation=secure, **kwargs)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(make_model(), datamodule=make_dm(num_clients=kwargs.pop("num_clients", 4)))
    return trainer


def test_a_secure_round_steps_by_the_exact_mean_of_the_clients_quantised_updates(tmp_path):
    from conftest import make_dm, make_model
    from lightning_fl.compress import FP32
    from lightning_fl.federated.client import LocalTraining, run_client
    from lightning_fl.privacy.secure import SecureAggregation

    secure = SecureAggregation(clipping_range=1.0, quantization_range=2**12, rounding_seed=0)  # a coarse step
    run = secure_fit(tmp_path, "secure", secure, rounds=1)
    model, dm = make_model(), make_dm(num_clients=4)
    dm.prepare_data()
    dm.setup("fit")
    start = model.federated_state()
    vectors = []
    for c in range(4):  # each client alone, then its secure upload as the server reads it
        result = run_client(model, dm, start, c, 0, 0, codec=FP32(), local=LocalTraining(secure=secure))
        vector, problem = secure.read(result.payload, start["mapping.latent"].numel())
        assert problem is None and result.payload.nbytes == 8 * start["mapping.latent"].numel()
        vectors.append(vector)
    mean = secure.recover(secure.modular_sum(vectors), 4) / 4
    want = (start["mapping.latent"].double() + mean).float()
    assert torch.equal(run.global_state["mapping.latent"].cpu(), want)
    plain = secure_fit(tmp_path, "plain", None, rounds=1)
    gap = (run.global_state["mapping.latent"] - plain.global_state["mapping.latent"]).abs().max()
    assert 0 < float(gap) <= secure.step  # the mean of 4 roundings, each under one step
    assert run.history[-1]["comm/client_up_bytes"] == 2 * plain.history[-1]["comm/client_up_bytes"]  # int64


def test_distributed_dp_under_secure_aggregation_spends_what_it_spends_in_the_clear(tmp_path):
    """The secure sum carries the same shares: the same clients account the same rounds."""
    from lightning_fl.privacy import DistributedDP
    from lightning_fl.privacy.secure import SecureAggregation

    secure = secure_fit(tmp_path, "sd", SecureAggregation(clipping_range=1.0), clients_per_round=4,
                        privacy=DistributedDP(clip_norm=0.05, noise_multiplier=1.0))  # fmt: skip
    clear = secure_fit(tmp_path, "c", None, clients_per_round=4,
                       privacy=DistributedDP(clip_norm=0.05, noise_multiplier=1.0))  # fmt: skip
    assert [h["privacy/epsilon"] for h in secure.history[1:]] == [h["privacy/epsilon"] for h in clear.history[1:]]
    assert secure.privacy.precision == clear.privacy.precision and secure.history[-1]["privacy/epsilon"] > 0
    assert torch.isfinite(secure.global_state["mapping.latent"]).all()


def test_what_a_secure_round_cannot_do_is_refused_in_one_line(tmp_path):
    from conftest import make_trainer
    from lightning_fl.compress import Quantize
    from lightning_fl.federated import FedAvg, Median, SignFlip
    from lightning_fl.privacy import CentralDP
    from lightning_fl.privacy.secure import SecureAggregation

    cases = [
        ({"strategy": Median()}, "Median needs single updates"),
        ({"strategy": FedAvg(weighted=True)}, "set trainer.strategy.weighted false"),
        ({"privacy": CentralDP(noise_multiplier=1.0)}, "use DistributedDP"),
        ({"max_update_norm_ratio": 100.0}, "set trainer.max_update_norm_ratio null"),
        ({"attack": SignFlip(clients=[0])}, "remove trainer.attack"),
        ({"codec": Quantize(bits=8)}, "trainer.codec Quantize"),
    ]
    for kwargs, message in cases:
        kwargs.setdefault("max_update_norm_ratio", None)
        with pytest.raises(ConfigError, match=f"trainer.secure_aggregation: .*{message}"):
            make_trainer(tmp_path, secure_aggregation=SecureAggregation(), **kwargs)


def test_a_malformed_secure_upload_is_named_and_a_dropped_client_leaves_a_correct_sum(tmp_path):
    from lightning_fl.compress.base import Encoded, Payload
    from lightning_fl.privacy.secure import SecureAggregation

    secure = SecureAggregation()
    good = Payload({"secure": Encoded({"q": torch.zeros(6, dtype=torch.int64)}, (6,), torch.int64)})
    assert secure.read(good, 6)[1] is None
    for bad in (Payload({"secure": Encoded({"q": torch.zeros(6)}, (6,), torch.int64)}),  # floats
                Payload({"secure": Encoded({"q": torch.zeros(5, dtype=torch.int64)}, (5,), torch.int64)}),
                Payload({}), "not a payload"):  # fmt: skip
        vector, problem = secure.read(bad, 6)
        assert vector is None and problem.startswith("malformed secure upload")
    dropped = secure_fit(tmp_path, "drop", SecureAggregation(clipping_range=1.0), dropout=0.4)
    plain = secure_fit(tmp_path, "plain", None, dropout=0.4)
    gap = (dropped.global_state["mapping.latent"] - plain.global_state["mapping.latent"]).abs().max()
    assert [h["fed/unavailable_clients"] for h in dropped.history[1:]] == [h["fed/unavailable_clients"]
                                                                           for h in plain.history[1:]]  # fmt: skip
    assert sum(h["fed/unavailable_clients"] for h in dropped.history[1:]) > 0
    assert float(gap) <= 2 * SecureAggregation(clipping_range=1.0).step


def test_one_client_shifting_its_masked_vector_cannot_move_the_model_it_loses_the_round(tmp_path, monkeypatch):
    """A hostile client adds M/2 to its quantised vector: the modular sum leaves [0, n T] (an honest one never
    does), so the round has no aggregate and says why; without the range check the shift reaches the model."""
    from lightning_fl.federated.transport import InProcess
    from lightning_fl.privacy.secure import SecureAggregation

    secure = SecureAggregation(clipping_range=1.0)
    inner = InProcess.replies

    def hostile(self, *args, **kwargs):
        for reply in inner(self, *args, **kwargs):
            if reply.client == 2 and reply.payload is not None:
                q = reply.payload.tensors["secure"].parts["q"]
                reply.payload.tensors["secure"].parts["q"] = torch.remainder(q + secure.M // 2, secure.M)
            yield reply

    monkeypatch.setattr(InProcess, "replies", hostile)
    from conftest import make_dm, make_model, make_trainer

    attacked = make_trainer(tmp_path, rounds=1, max_update_norm_ratio=None, check_identity=False,
                            secure_aggregation=secure)  # fmt: skip
    with pytest.warns(UserWarning, match=r"round 1: secure aggregation failed: the secure sum lies outside \[0, n T\]"):
        attacked.fit(make_model(), datamodule=make_dm(num_clients=4))
    assert attacked.history[-1]["fed/round_skipped"] == 1  # the global state stays where it was


def test_the_client_in_every_invalid_sum_is_named_and_left_out_so_the_honest_clients_keep_training(
    tmp_path, monkeypatch
):
    """Client 2 shifts its masked vector by M/2 whenever it is sampled (8 clients, 4 a round): its rounds lose their
    sum; the server, which sees only sums and who was in them, names the one client in every invalid sum and in no
    valid one, leaves it out, and the later rounds aggregate again."""
    from conftest import make_dm, make_model, make_trainer
    from lightning_fl.federated.suspects import Suspects
    from lightning_fl.federated.transport import InProcess
    from lightning_fl.privacy.secure import SecureAggregation

    secure = SecureAggregation(clipping_range=1.0)
    inner = InProcess.replies

    def hostile(self, *args, **kwargs):
        for reply in inner(self, *args, **kwargs):
            if reply.client == 2 and reply.payload is not None:
                q = reply.payload.tensors["secure"].parts["q"]
                reply.payload.tensors["secure"].parts["q"] = torch.remainder(q + secure.M // 2, secure.M)
            yield reply

    monkeypatch.setattr(InProcess, "replies", hostile)
    trainer = make_trainer(tmp_path, rounds=12, max_update_norm_ratio=None, check_identity=False, logger=False,
                           secure_aggregation=secure, clients_per_round=4)  # fmt: skip
    with pytest.warns(UserWarning, match="secure aggregation failed") as caught:
        trainer.fit(make_model(), datamodule=make_dm(num_clients=8))
    said = [str(w.message) for w in caught if "secure aggregation failed" in str(w.message)]
    left = [s for s in said if "client 2 alone was in all" in s and "left out of the secure rounds that follow" in s]
    assert len(left) == 1 and trainer.round_runner.collection.suspects.left_out == {2}
    out = said.index(left[0])
    assert all("candidates" in s for s in said[:out])  # named as one of the candidates before that
    when = int(left[0].split(":")[0].removeprefix("round "))
    after = [h for h in trainer.history[1:] if h["round"] > when]
    assert sum(h["fed/round_skipped"] for h in trainer.history[1:]) == len(said) == out + 1
    assert len(after) >= 3 and all(h["fed/round_skipped"] == 0 for h in after)  # the honest clients train on
    # the record alone: two culprits leave no one in every invalid sum, and nothing is concluded from one sum
    record = Suspects()
    assert record.record([0, 1, 2], valid=False).startswith(
        "candidates (in every invalid secure sum so far, a hostile client among them): [0, 1, 2]; no one"
    )
    assert record.record([0, 3], valid=True) is None
    assert record.record([3, 4], valid=False).startswith("no client was in every invalid secure sum")
    assert not record.left_out


def test_a_valid_sum_clears_no_one_so_a_hostile_client_cannot_frame_an_honest_one():
    """Issue 72, item 6: client 7 spoils only the sums that include client 4. Its own valid sums (without 4) once
    cleared it, leaving 4 alone as the suspect, left out after two invalid sums; now both stay candidates and no one
    is left out, while a client alone in every invalid sum still is."""
    from lightning_fl.federated.suspects import Suspects

    record = Suspects()
    assert record.record([1, 4, 5, 7], valid=False).endswith(
        "[1, 4, 5, 7]; no one is left out while more than one client is in every invalid sum"
    )
    assert record.record([0, 2, 3, 7], valid=True) is None  # the attacker's round without its victim
    said = record.record([2, 4, 6, 7], valid=False)
    assert "[4, 7]" in said and "no one is left out" in said and record.left_out == set()
    assert record.candidates == [4, 7]
    plain = Suspects()  # a client that spoils every sum it is in is alone in the intersection: left out
    plain.record([1, 4, 5, 7], valid=False)
    assert plain.record([0, 2, 3, 7], valid=False).startswith("client 7 alone was in all 2 invalid secure sums")
    assert plain.left_out == {7}


def test_a_client_that_spoils_only_the_rounds_of_a_chosen_client_gets_no_one_left_out(tmp_path, monkeypatch):
    """Issue 72, item 6, the exact attack: client 7 shifts its masked vector by M/2 only in rounds whose cohort (which
    a node learns when SecAgg+ shares keys) includes client 4. With the run's seed 0 and 4 of 8 clients a round, the
    old rule (clear every client of a valid sum) left client 4 alone as the suspect after round 4 and left it out;
    now 4 and 7 are named as candidates, no one is left out, and only the rounds with both lose their sum (the
    denial of service SecAgg+ without proofs cannot prevent)."""
    from conftest import make_dm, make_model, make_trainer
    from lightning_fl.federated.transport import InProcess
    from lightning_fl.privacy.secure import SecureAggregation

    secure, attacker, victim = SecureAggregation(clipping_range=1.0), 7, 4
    inner, cohorts = InProcess.replies, []

    def framing(self, model, datamodule, state, clients, *args, **kwargs):
        cohorts.append(list(clients))
        for reply in inner(self, model, datamodule, state, clients, *args, **kwargs):
            if reply.client == attacker and victim in clients and reply.payload is not None:
                q = reply.payload.tensors["secure"].parts["q"]
                reply.payload.tensors["secure"].parts["q"] = torch.remainder(q + secure.M // 2, secure.M)
            yield reply

    monkeypatch.setattr(InProcess, "replies", framing)
    trainer = make_trainer(tmp_path, rounds=5, max_update_norm_ratio=None, check_identity=False, logger=False,
                           secure_aggregation=secure, clients_per_round=4)  # fmt: skip
    with pytest.warns(UserWarning, match="secure aggregation failed") as caught:
        trainer.fit(make_model(), datamodule=make_dm(num_clients=8))
    said = [str(w.message) for w in caught if "secure aggregation failed" in str(w.message)]
    both = [i for i, c in enumerate(cohorts) if attacker in c and victim in c]
    assert len(both) >= 2 and any(attacker in c and victim not in c for c in cohorts[: both[1]])  # the old trap
    assert trainer.round_runner.collection.suspects.left_out == set()  # the victim is not framed
    assert len(said) == len(both) and "[4, 7]" in said[-1] and "no one is left out" in said[-1]
    skipped = [h["round"] - 1 for h in trainer.history[1:] if h["fed/round_skipped"]]
    assert skipped == both  # every other round aggregates, the victim's rounds without the attacker included

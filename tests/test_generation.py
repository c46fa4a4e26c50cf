"""Generation and scoring by it: ``transformers``' ``generate`` (key-value cache, stop tokens, left padding) against a
plain greedy loop that recomputes every position; exact match after normalisation; the response-only metrics; and a
federated instruction run that scores the base and the final model on the test split once each."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_fl import FederatedTrainer, LatentLanguageModel
from lightning_fl.data import Dirichlet, FederatedInstructionDataModule, InstructionTasks
from lightning_fl.methods import LoRALanguageModel
from lightning_fl.metrics import IGNORE_INDEX, ExactMatch, NextTokenMetrics, normalize_answer
from lightning_fl.models import HFCausalLM
from lightning_fl.models.gpt import generate
from lightning_fl.models.hf import hf_generate

pytest.importorskip("transformers")  # the llm extra


def greedy_without_cache(network, prompt: torch.Tensor, max_new_tokens: int, stops: list[int]) -> list[int]:
    """The reference: argmax of a full forward pass over the whole sequence at every step, until a stop token."""
    out = generate(network, prompt[None], max_new_tokens, context=10**6, temperature=0.0)[0, len(prompt) :].tolist()
    end = next((i for i, t in enumerate(out) if t in stops), len(out))
    return out[:end]


@pytest.fixture
def net(tiny_chat_llama):
    torch.manual_seed(0)
    network = HFCausalLM(str(tiny_chat_llama), context=64)
    with torch.no_grad():  # sharper logits than the random init's: no near-ties for float rounding to flip
        network.hf.lm_head.weight.mul_(20)
    return network.eval()


def test_cached_generation_equals_a_greedy_loop_over_full_forward_passes(net):
    tokenizer = net.tokenizer
    prompts = ["<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n", "How many", "Which number"]
    stops = [tokenizer.eos_token_id]
    for text in prompts:
        ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False))
        with torch.no_grad():
            ours = hf_generate(net, ids[None], torch.ones_like(ids)[None], 12)[0]
        assert ours == greedy_without_cache(net, ids, 12, stops), text
        assert len(ours) <= 12 and tokenizer.eos_token_id not in ours


def test_generation_stops_at_any_stop_token_of_the_tokenizer_or_the_generation_config(net):
    ids = torch.tensor([5, 6, 7])
    free = greedy_without_cache(net, ids, 6, stops=[])
    assert len(free) == 6
    net.hf.generation_config.eos_token_id = free[2]  # a stop token the model's generation config adds
    with torch.no_grad():
        stopped = hf_generate(net, ids[None], torch.ones_like(ids)[None], 6)[0]
    assert stopped == free[: free.index(free[2])]


def test_a_left_padded_batch_generates_what_each_prompt_does_alone(net):
    from lightning_fl.data.chat import pad_left

    tokenizer = net.tokenizer
    texts = ["What is 2 + 2?", "How many minutes are in 3 hours? Answer with the number only.", "Which"]
    rows = [torch.tensor(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    ids, mask = pad_left(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        together = hf_generate(net, ids, mask, 8)
        alone = [hf_generate(net, r[None], torch.ones_like(r)[None], 8)[0] for r in rows]
    assert together == alone


def test_exact_match_normalises_and_breaks_down_by_label():
    assert normalize_answer('  **"The  Tempest."** ') == "the tempest"
    assert normalize_answer("-5") == "-5" and normalize_answer("2019-04-06.") == "2019-04-06"
    metric = ExactMatch("val/", labels=["a", "b"])
    metric.update(["5.", "Hamlet", "7", " six"], ["5", "hamlet", "8", "6"], ["a", "b", "a", "b"])
    out = metric.compute()
    assert out == {
        "val/exact_match": pytest.approx(0.5),
        "val/exact_match/a": pytest.approx(0.5),
        "val/exact_match/b": pytest.approx(0.5),
        "val/contains_answer": pytest.approx(0.5),
    }
    # an answer that holds the reference as a whole counts in contains_answer only; part of a number does not
    metric = ExactMatch("test/")
    metric.update(
        ["4 x 72 = 288.", "2880", "It is -11", "The Tempest, by Shakespeare"], ["288", "288", "-11", "tempest"]
    )
    out = metric.compute()
    assert out["test/exact_match"] == 0.0 and out["test/contains_answer"] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="Expected as many predictions"):
        metric.update(["x"], ["x", "y"])


def test_next_token_metrics_leave_the_ignored_targets_out():
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX], [IGNORE_INDEX, 1, 2, 6, 0]])
    metric = NextTokenMetrics("val/")
    metric.update(logits, targets)
    out = metric.compute()
    kept = targets != IGNORE_INDEX
    loss = torch.nn.functional.cross_entropy(logits[kept], targets[kept])
    assert out["val/loss"].item() == pytest.approx(loss.item(), rel=1e-6)
    assert out["val/ppl"].item() == pytest.approx(math.exp(loss.item()), rel=1e-5)
    acc = (logits[kept].argmax(-1) == targets[kept]).float().mean()
    assert out["val/acc"].item() == pytest.approx(acc.item())
    from lightning_fl.methods.recipe import TrainingRecipe

    assert TrainingRecipe.train_accuracy(logits, targets).item() == pytest.approx(acc.item())


@pytest.mark.parametrize("method", ["flite", "lora"])
def test_response_metrics_from_the_kept_positions_equal_those_of_every_position(method, tiny_chat_llama):
    network = HFCausalLM(str(tiny_chat_llama), context=64)
    if method == "flite":
        model = LatentLanguageModel(network, latent_dim=16, rank=16, factors="two_sided", sample_tokens=0)
    else:
        model = LoRALanguageModel(network, rank=2, sample_tokens=0)
    with torch.no_grad():
        for p in model.trainable_parameters().values():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.3)
    data = instruction_data(tiny_chat_llama, eval_batch_size=8)
    data.setup()
    batch = next(iter(data.val_dataloader()))
    kept, targets = model.eval()._response_logits(batch["input_ids"], batch["targets"])
    assert kept.shape[1] < batch["input_ids"].shape[1]  # the prompts' positions are left out
    every, full = NextTokenMetrics(), NextTokenMetrics()
    with torch.no_grad():
        every.update(model(batch["input_ids"]), batch["targets"])
    full.update(kept, targets)
    for key, value in every.compute().items():
        assert full.compute()[key].item() == pytest.approx(value.item(), rel=1e-5), key


def test_chat_generation_of_text_uses_the_template_and_returns_the_answer_alone(net):
    from lightning_fl.methods import LanguageModel

    model = LanguageModel(net, sample_tokens=0)
    prompt = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    ids = torch.tensor(net.tokenizer.encode(prompt, add_special_tokens=False))
    expected = net.tokenizer.decode(greedy_without_cache(net, ids, 6, [net.tokenizer.eos_token_id]))
    assert model.generate_text("What is 2 + 3?", 6, chat=True) == expected
    sampled = model.generate_text("What is", 6, top_k=5, seed=3)
    assert sampled == model.generate_text("What is", 6, top_k=5, seed=3)  # seeded


# ------------------------------------------------------------------------------------------------ a federated run
def instruction_data(folder, **kwargs) -> FederatedInstructionDataModule:
    source = InstructionTasks(
        tasks=["arithmetic", "units"], train_per_task=24, val_per_task=6, test_per_task=8, public_per_task=0
    )
    args = {"num_clients": 4, "partition": Dirichlet(alpha=0.5), "context": 64, "max_new_tokens": 6}
    return FederatedInstructionDataModule(source, tokenizer=str(folder), **args | kwargs)


@pytest.mark.parametrize("method", ["flite", "lora"])
def test_a_run_scores_answers_on_val_each_evaluation_and_on_test_before_and_after(
    method, tiny_chat_llama, tmp_path, capsys
):
    network = HFCausalLM(str(tiny_chat_llama), context=64)
    if method == "flite":
        model = LatentLanguageModel(network, latent_dim=16, rank=16, factors="two_sided", sample_tokens=0)
    else:
        model = LoRALanguageModel(network, rank=2, sample_tokens=0)
    trainer = FederatedTrainer(
        rounds=2,
        clients_per_round=2,
        local_steps=2,
        accelerator="cpu",
        logger=False,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        test_after_fit=True,
        val_every_n_rounds=2,
    )
    data = instruction_data(tiny_chat_llama)
    trainer.fit(model, datamodule=data)
    first, last = trainer.history[0], trainer.history[-1]
    for key in (
        "val/exact_match",
        "val/exact_match/arithmetic",
        "val/exact_match/units",
        "val/ppl",
        "test/exact_match",
        "test/exact_match/units",
        "test/ppl",
    ):
        assert key in first and key in last, key
    assert "test/exact_match" not in trainer.history[1]  # read twice: the starting model and the final one
    saved = torch.load(trainer.log_dir / "checkpoints" / "last.ckpt", weights_only=True)["history"][-1]
    assert saved["test/exact_match"] == pytest.approx(last["test/exact_match"])  # what a sweep collects
    out = capsys.readouterr().out
    assert "test/exact_match: " in out and "before the first round" in out and "after the last" in out
    assert "instruction data: train: 48 records" in out
    # the scores are those of generation with the run's model: score the test split again by hand
    batch = next(iter(data.test_dataloader()))
    answers = [network.tokenizer.decode(a) for a in model.generate_ids(batch["prompt_ids"], batch["prompt_mask"], 6)]
    again = ExactMatch("test/")
    again.update(answers, batch["references"])
    assert len(data._splits["test"]) == len(batch["references"])  # one batch: the whole split
    assert again.compute()["test/exact_match"].item() == pytest.approx(last["test/exact_match"])

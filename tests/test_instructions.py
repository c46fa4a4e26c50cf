"""Instruction and chat data: JSONL records in both formats, the built-in task's exact answers, the chat template
with the loss on the response only, truncation that is counted, and who holds what (a client field, a Dirichlet
partition over labels). A tiny Llama with ChatML's tokenizer (conftest's ``tiny_chat_llama``) stands in for SmolLM2."""

from __future__ import annotations

import datetime
import json
import re

import numpy as np
import pytest
import torch

from lightning_fl.data import (
    IID,
    Dirichlet,
    FederatedInstructionDataModule,
    InstructionFiles,
    InstructionRecord,
    InstructionTasks,
)
from lightning_fl.data.chat import PLAIN_TEMPLATE, ChatFormat
from lightning_fl.data.instructions import parse_record, read_jsonl
from lightning_fl.errors import ConfigError, DatasetNotFoundError
from lightning_fl.metrics import IGNORE_INDEX

pytest.importorskip("transformers")  # the llm extra

SYNTHETIC = ["arithmetic", "units", "dates", "compare"]


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def small_tasks(**kwargs) -> InstructionTasks:
    args = {"tasks": SYNTHETIC, "train_per_task": 30, "val_per_task": 5, "test_per_task": 5, "public_per_task": 0}
    return InstructionTasks(**args | kwargs)


def tokenizer_of(folder):
    from lightning_fl.data import pretrained

    return pretrained.load_tokenizer(pretrained.model_files(str(folder)))


# ------------------------------------------------------------------------------------------------ records
def test_alpaca_and_chat_records_become_the_same_conversation():
    alpaca = parse_record({"instruction": "Add.", "input": "2 and 3", "output": "5", "client": 7, "label": "sum"})
    chat = parse_record(
        {
            "messages": [{"role": "user", "content": "Add.\n\n2 and 3"}, {"role": "assistant", "content": "5"}],
            "client": "7",
            "label": "sum",
        }
    )
    assert alpaca == chat
    assert alpaca.prompt == [{"role": "user", "content": "Add.\n\n2 and 3"}]
    assert (alpaca.response, alpaca.reference, alpaca.client, alpaca.label) == ("5", "5", "7", "sum")
    with_answer = parse_record({"instruction": "Add.", "output": "It is 5.", "answer": "5", "system": "Be brief."})
    assert with_answer.messages[0] == {"role": "system", "content": "Be brief."}
    assert (with_answer.response, with_answer.reference) == ("It is 5.", "5")


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('{"instruction": "x"}', "'output' missing"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "last message must be the assistant's"),
        ('{"messages": [{"role": "bot", "content": "hi"}]}', "message 0 must be an object with role one of"),
        ('{"instruction": "x", "output": "  "}', "the response (the last message) is empty"),
        ('{"instruction": "x", "output": "y", "client": [1]}', "'client' must be a string or an integer"),
        ("[1, 2]", "expected a JSON object"),
        ('{"instruction": "x", "output": "y",}', "not JSON"),
    ],
)
def test_a_bad_line_is_one_error_naming_the_file_the_line_and_the_fix(tmp_path, line, says):
    path = write_jsonl(tmp_path / "data.jsonl", [{"instruction": "fine", "output": "ok"}, "", line])
    with pytest.raises(ConfigError) as err:
        read_jsonl(path, key="data.source.train")
    message = str(err.value)
    assert message.startswith(f"data.source.train: line 3 of {path}: ") and says in message
    assert message.endswith("fix that line") and "\n" not in message


def test_a_missing_or_empty_file_is_named(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="data.source.val: no JSONL file at .*nope.jsonl"):
        InstructionFiles(
            train=write_jsonl(tmp_path / "t.jsonl", [{"instruction": "a", "output": "b"}]),
            val=str(tmp_path / "nope.jsonl"),
        ).splits()
    with pytest.raises(ConfigError, match="holds no record"):
        read_jsonl(write_jsonl(tmp_path / "empty.jsonl", [""]))


# ------------------------------------------------------------------------------------------------ the built-in task
def test_the_built_in_task_is_deterministic_disjoint_and_every_answer_is_right():
    source = small_tasks()
    splits = source.splits()
    assert splits == small_tasks().splits()  # the same questions every time
    assert splits != small_tasks(seed=1).splits()
    assert {k: len(v) for k, v in splits.items()} == {"train": 120, "val": 20, "test": 20}
    questions = {name: {r.prompt[0]["content"] for r in records} for name, records in splits.items()}
    assert not questions["train"] & questions["val"] and not questions["train"] & questions["test"]
    assert not questions["val"] & questions["test"]
    checked = 0
    for record in (r for records in splits.values() for r in records):
        question, answer = record.prompt[0]["content"], record.reference
        assert record.response == answer and record.label in SYNTHETIC
        if m := re.fullmatch(r"What is (\d+) ([-+x]) (\d+)\? Answer with the number only\.", question):
            a, op, b = int(m[1]), m[2], int(m[3])
            expected = {"+": a + b, "-": a - b, "x": a * b}[op]
        elif m := re.fullmatch(r"How many (\w+) are in (\d+) (\w+)\? Answer with the number only\.", question):
            per = {
                "metres": {"kilometres": 1000},
                "centimetres": {"metres": 100},
                "grams": {"kilograms": 1000},
                "millilitres": {"litres": 1000},
                "minutes": {"hours": 60},
                "seconds": {"minutes": 60},
                "hours": {"days": 24},
                "days": {"weeks": 7},
                "inches": {"feet": 12},
            }[m[1]][m[3]]
            expected = int(m[2]) * per
        elif m := re.fullmatch(r"What date is (\d+) days after ([\d-]+)\? Answer in the form YYYY-MM-DD\.", question):
            expected = (datetime.date.fromisoformat(m[2]) + datetime.timedelta(days=int(m[1]))).isoformat()
        elif m := re.fullmatch(r"Which number is larger, (\d+) or (\d+)\? Answer with the number only\.", question):
            assert m[1] != m[2]
            expected = max(int(m[1]), int(m[2]))
        else:
            raise AssertionError(f"a question of no known family: {question!r}")
        assert answer == str(expected), question
        checked += 1
    assert checked == 160


def test_the_play_task_asks_about_held_out_lines_with_four_titles(tmp_path):
    from conftest import PLAYS, play_text, write_corpus
    from lightning_fl.data.instruction_tasks import TITLES

    names = {"hamlet": "HAMLET", "macbeth": "MACBETH", "tempest": "TEMPEST", "othello": "OTHELLO"}
    corpus = write_corpus(tmp_path / "texts", {n: play_text(t, PLAYS["alpha"]) for n, t in names.items()})
    source = InstructionTasks(
        tasks=["play"],
        train_per_task=20,
        val_per_task=4,
        test_per_task=4,
        public_per_task=0,
        root=str(corpus),
        download=False,
    )
    splits = source.splits()
    lines = {name: {r.prompt[0]["content"].split("\n")[1] for r in records} for name, records in splits.items()}
    assert not lines["train"] & lines["test"] and not lines["train"] & lines["val"]
    for record in splits["train"]:
        options = record.prompt[0]["content"].split("Choose one: ")[1].removesuffix(". Answer with the title only.")
        assert len(options.split("; ")) == 4 and record.reference in options.split("; ")
        assert record.reference in {TITLES[n] for n in names}


def test_a_task_list_or_a_size_that_cannot_be_is_refused():
    with pytest.raises(ConfigError, match="data.source.tasks must be distinct names of"):
        InstructionTasks(tasks=["arithmetic", "poetry"])
    with pytest.raises(ConfigError, match="train_per_task must be >= 1"):
        InstructionTasks(train_per_task=0)


# ------------------------------------------------------------------------------------------------ chat template
def test_the_loss_covers_the_response_and_its_end_of_turn_only(tiny_chat_llama):
    tokenizer = tokenizer_of(tiny_chat_llama)
    chat = ChatFormat(tokenizer, context=64)
    record = InstructionRecord(({"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}))
    (example,), stats = chat.examples([record])
    prompt = tokenizer.apply_chat_template(record.prompt, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(example.prompt) == prompt
    trained = example.y[example.y != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "5<|im_end|>"  # the response and the stop, not the newline after it
    ids = torch.cat([example.x, example.y[-1:]])  # x and y are one sequence shifted by one
    assert torch.equal(ids[1:][example.y != IGNORE_INDEX], trained)
    assert (example.y == IGNORE_INDEX).sum() == len(example.prompt) - 1
    assert (stats.records, stats.truncated, stats.dropped) == (1, 0, 0)


def test_a_tokenizer_without_a_template_gets_alpacas_layout_and_ends_with_eos(tiny_chat_llama, tmp_path):
    from conftest import save_tiny_chat_model, task_text

    plain = save_tiny_chat_model(tmp_path / "plain", task_text(), chat_template=False)
    chat = ChatFormat(tokenizer_of(plain), context=64)
    assert chat.plain and chat.template == PLAIN_TEMPLATE
    record = InstructionRecord(({"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}))
    assert chat.split_texts(record) == ("### Instruction:\nSay hi.\n\n### Response:\n", "hi<|im_end|>\n\n")
    (example,), _ = chat.examples([record])
    assert chat.tokenizer.decode(example.y[example.y != IGNORE_INDEX]) == "hi<|im_end|>"


def test_long_records_are_cut_or_left_out_and_counted(tiny_chat_llama):
    tokenizer = tokenizer_of(tiny_chat_llama)
    chat = ChatFormat(tokenizer, context=24)
    short = InstructionRecord(({"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "5"}))
    long_answer = InstructionRecord(
        ({"role": "user", "content": "Count."}, {"role": "assistant", "content": "1 " * 40})
    )
    long_prompt = InstructionRecord(({"role": "user", "content": "9 " * 40}, {"role": "assistant", "content": "5"}))
    examples, stats = chat.examples([short, long_answer, long_prompt])
    assert [e.record for e in examples] == [0, 1]  # the third's prompt alone fills the context
    assert all(len(e.x) <= 24 for e in examples) and len(examples[1].x) == 24
    assert (stats.records, stats.truncated, stats.dropped) == (3, 1, 1)
    line = stats.line("train")
    assert "1 with their response cut at the context" in line and "1 left out" in line


def test_batches_pad_training_on_the_right_and_prompts_on_the_left(tiny_chat_llama):
    chat = ChatFormat(tokenizer_of(tiny_chat_llama), context=64)
    records = [
        InstructionRecord(({"role": "user", "content": q}, {"role": "assistant", "content": a}))
        for q, a in (("1 + 1?", "2"), ("What is 12 + 30? Answer with the number only.", "42"))
    ]
    examples, _ = chat.examples(records)
    x, y = chat.train_batch(examples)
    n = len(examples[0].x)
    assert x.shape == y.shape == (2, len(examples[1].x)) and n < x.shape[1]
    assert (x[0, n:] == chat.pad_id).all() and (y[0, n:] == IGNORE_INDEX).all()
    batch = chat.eval_batch(examples)
    width = batch["prompt_ids"].shape[1]
    assert torch.equal(batch["prompt_ids"][0, width - len(examples[0].prompt) :], examples[0].prompt)
    assert batch["prompt_mask"][0].tolist() == [0] * (width - len(examples[0].prompt)) + [1] * len(examples[0].prompt)
    assert batch["references"] == ["2", "42"]


# ------------------------------------------------------------------------------------------------ the data module
def module(folder, source=None, **kwargs) -> FederatedInstructionDataModule:
    args = {"num_clients": 6, "partition": Dirichlet(alpha=0.5), "context": 64, "batch_size": 4}
    dm = FederatedInstructionDataModule(source or small_tasks(), tokenizer=str(folder), **args | kwargs)
    dm.setup()
    return dm


def test_a_dirichlet_partition_skews_clients_towards_some_task_types(tiny_chat_llama):
    dm = module(tiny_chat_llama, partition=Dirichlet(alpha=0.1), num_clients=6)
    assert dm.num_clients == 6 and dm.labels == sorted(SYNTHETIC)
    held = [dm.client_num_samples(k) for k in range(6)]
    assert sum(held) == 120
    shares = [max(np.unique([e.label for e in dm._client(k)], return_counts=True)[1]) / held[k] for k in range(6)]
    assert np.mean(shares) > 0.6  # mostly one type each (IID would give about 0.25-0.4)
    iid = module(tiny_chat_llama, partition=IID(), num_clients=6)
    iid_shares = [max(np.unique([e.label for e in iid._client(k)], return_counts=True)[1]) / 20 for k in range(6)]
    assert np.mean(iid_shares) < np.mean(shares)
    table = dm.partition_table()
    assert "| client | name | records | arithmetic | compare | dates | units |" in table


def test_clients_named_by_the_records_and_held_out_splits_cut_from_training(tiny_chat_llama, tmp_path):
    rows = [{"instruction": f"Say {i}.", "output": str(i), "client": f"user-{i % 5}"} for i in range(50)]
    source = InstructionFiles(train=write_jsonl(tmp_path / "train.jsonl", rows))
    dm = module(tiny_chat_llama, source, partition=None, num_clients=None, val_fraction=0.1, test_fraction=0.2)
    assert dm.client_names == [f"user-{i}" for i in range(5)]
    assert sum(dm.client_num_samples(k) for k in range(5)) == 35
    assert (len(dm._splits["val"]), len(dm._splits["test"])) == (5, 10)
    held_out = {e.reference for s in ("val", "test") for e in dm._splits[s]}
    trained = {e.reference for k in range(5) for e in dm._client(k)}
    assert not held_out & trained
    three = module(tiny_chat_llama, source, partition=None, num_clients=3)
    assert len(three.client_names) == 3 and set(three.client_names) < set(dm.client_names)
    x, y = next(iter(dm.client_dataloader(0, seed=0)))
    assert x.shape == y.shape and x.dtype == torch.long


def test_records_without_a_client_need_a_partitioner(tiny_chat_llama, tmp_path):
    source = InstructionFiles(train=write_jsonl(tmp_path / "t.jsonl", [{"instruction": "a", "output": "b"}] * 20))
    with pytest.raises(ConfigError, match="every training record must name its client"):
        module(tiny_chat_llama, source, partition=None, num_clients=None)
    with pytest.raises(ConfigError, match="data.partition deals records to data.num_clients clients"):
        FederatedInstructionDataModule(source, tokenizer=str(tiny_chat_llama), partition=IID())


def test_eval_subsets_are_seeded_and_the_summary_counts_what_was_cut(tiny_chat_llama, tmp_path):
    dm = module(tiny_chat_llama, max_eval_samples=7)
    again = module(tiny_chat_llama, max_eval_samples=7)
    assert len(dm._splits["val"]) == 7
    assert [e.reference for e in dm._splits["val"]] == [e.reference for e in again._splits["val"]]
    batch = next(iter(dm.val_dataloader()))
    assert set(batch) == {"input_ids", "targets", "prompt_ids", "prompt_mask", "references", "labels"}
    (line,) = dm.summary_lines()
    assert line.startswith("instruction data: train: 120 records") and "val: 20 records" in line
    rows = [{"instruction": "Say 5.", "output": "5", "client": str(i % 2)} for i in range(9)]
    rows.append({"instruction": "9 " * 80, "output": "5", "client": "0"})
    source = InstructionFiles(
        train=write_jsonl(tmp_path / "t.jsonl", rows), val=write_jsonl(tmp_path / "v.jsonl", rows)
    )
    tight = module(tiny_chat_llama, source, partition=None, num_clients=None, test_fraction=0.1)
    assert sum(tight.client_num_samples(k) for k in range(2)) == 8  # 9 for training, 1 of them too long
    assert "train: 9 records" in tight.summary_lines()[0]
    assert "1 left out: the prompt alone fills the context" in tight.summary_lines()[0]


def test_a_tokenizer_without_an_end_of_sequence_token_is_refused(tiny_llama):
    with pytest.raises(ConfigError, match="has no end-of-sequence token"):
        module(tiny_llama)

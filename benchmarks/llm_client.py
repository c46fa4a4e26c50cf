"""A federated client's round on a pretrained language model: ours against a plain ``transformers`` + PEFT loop.

Both sides do the same work on the same weights and batches: load the server's state into the model, take
``--steps`` Adam steps (gradient norms clipped at 1.0) on the same instruction batches (the built-in task through
SmolLM2's chat template, the loss on the responses), and produce the upload (a copy of what trained):

- ``ours_lora`` / ``ours_full``: :func:`~lightning_fl.federated.clients.client.run_client` with ``LoRALanguageModel``
  (PEFT's LoRA, rank ``--rank``, on all 210 projections) or ``LanguageModel`` (every weight), the FP32 codec, in
  process;
- ``plain_lora`` / ``plain_full``: the loop a ``transformers`` user writes: ``peft.get_peft_model`` (the same rank,
  targets and adapter values) or the bare model, ``torch.optim.Adam``/``AdamW``, ``model(input_ids=x).logits``,
  ``cross_entropy(..., ignore_index=-100)``, ``clip_grad_norm_``, ``step``, ``zero_grad(set_to_none=True)``.

The four take turns ``--repeats`` times (after one warm-up round each); per side the wall and CPU time of a round
(min and median), per repeat the ratio ours / plain (target: at most 1.10 at the median). ``--only lora`` or
``--only full`` times one pair. ``--copies`` then counts, with PyTorch's profiler, the elements one round of each
side copies, in multiples of the parameters it trains (an extra copy of a 538 MB state shows as 1 more).

    python benchmarks/llm_client.py --repeats 10 --copies --json docs/results/llm_client.json
    python benchmarks/llm_client.py --tiny --repeats 2            # a random 2-layer Llama: checks the script
"""

from __future__ import annotations

import argparse
import copy
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
from _harness import add_arguments, alternate, fmt, line, machine, ratio_line, ratios, report, summarise
from torch.nn import functional as F

from lightning_fl.compress import FP32
from lightning_fl.data import IID, FederatedInstructionDataModule, InstructionTasks
from lightning_fl.federated.clients.client import ClientJob, run_client
from lightning_fl.federated.clients.local import LocalTraining
from lightning_fl.methods import LanguageModel, LoRALanguageModel, Recipe
from lightning_fl.metrics import IGNORE_INDEX

LR = {"lora": 1e-3, "full": 1e-5}


class FixedBatches:
    """A client that holds exactly ``batches`` (the same every round, every side)."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches

    def client_dataloader(self, client: int, seed: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.batches

    def client_num_samples(self, client: int) -> int:
        return sum(len(x) for x, _ in self.batches)


def network(args: argparse.Namespace) -> Any:
    from lightning_fl.models import HFCausalLM, SmolLM2

    return HFCausalLM(args.tiny, context=args.context) if args.tiny else SmolLM2(context=args.context)


def batches(args: argparse.Namespace, tokenizer: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = FederatedInstructionDataModule(
        InstructionTasks(tasks=["arithmetic", "units", "dates", "compare"]),
        tokenizer=tokenizer,
        num_clients=4,
        partition=IID(),
        context=args.context,
        batch_size=args.batch,
    )
    data.prepare_data()
    data.setup()
    loader = iter(data.client_dataloader(0, seed=0))
    return [next(loader) for _ in range(args.steps)]


def ours(method: str, args: argparse.Namespace, client: FixedBatches):
    """Our client round and the model it trains (the plain side copies its starting weights)."""
    recipe = Recipe(
        optimizer="adam" if method == "lora" else "adamw",
        lr=LR[method],
        weight_decay=0.0,
        schedule="constant",
        warmup_epochs=0.0,
        grad_clip=1.0,
    )
    if method == "lora":
        module = LoRALanguageModel(network(args), rank=args.rank, recipe=recipe, sample_tokens=0)
    else:
        module = LanguageModel(network(args), recipe=recipe, sample_tokens=0)
    start = module.federated_state()
    local = LocalTraining(steps=args.steps)

    def round_() -> Any:
        return run_client(ClientJob(module, client, start, 0, 0, FP32(), local), 0)

    return round_, module


def plain(method: str, mine: Any, args: argparse.Namespace, client: FixedBatches):
    """The plain loop on a copy of the same weights (and, for LoRA, PEFT's own model with our adapter values)."""
    base = copy.deepcopy(mine.network.hf)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        from lightning_fl.methods.lora import plain_name

        base_state = {plain_name(k): v for k, v in base.state_dict().items() if ".lora_" not in k}
        fresh = copy.deepcopy(network(args).hf)
        fresh.load_state_dict(base_state)
        targets = [t.removeprefix("hf.") for t in mine.adapted]
        config = LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=targets, lora_dropout=0.0)
        model = get_peft_model(fresh, config)
        with torch.no_grad():
            theirs = dict(model.named_parameters())
            for name, p in mine.trainable_parameters().items():
                theirs[f"base_model.model.{name.removeprefix('network.hf.')}"].copy_(p)
    else:
        model = base.requires_grad_(True)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    start = {n: p.detach().clone() for n, p in params.items()}
    optimizer_class = torch.optim.Adam if method == "lora" else torch.optim.AdamW

    def round_() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(start[n])
        optimizer = optimizer_class(list(params.values()), lr=LR[method], weight_decay=0.0)
        model.train()
        for x, y in client.batches:
            logits = model(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return {n: p.detach().clone() for n, p in params.items()}

    return round_


COPIES = ("aten::copy_", "aten::clone", "aten::_to_copy")


def copies(round_: Any, trained: int) -> dict[str, float]:
    """Elements one round copies (``copy_``, ``clone``, ``_to_copy``; from the profiler's input shapes), in multiples
    of the ``trained`` parameters: how many times a round copies the state it trains."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        round_()
    copied = dict.fromkeys(COPIES, 0)
    for event in prof.events():
        if event.name in copied and event.input_shapes and event.input_shapes[0]:
            copied[event.name] += math.prod(event.input_shapes[0])
    return {name.removeprefix("aten::"): round(n / trained, 2) for name, n in copied.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a random tiny chat Llama instead of SmolLM2")
    parser.add_argument("--steps", type=int, default=4, help="local steps per round")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rank", type=int, default=1, help="LoRA's rank")
    parser.add_argument("--only", choices=["lora", "full"], default=None)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--copies", action="store_true", help="also count what one round of each side copies")
    add_arguments(parser, repeats=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    before = machine()
    if args.tiny:  # a folder of its own, as a user's model would be
        from lightning_fl.models.tiny import save_tiny_chat_model, task_text

        args.tiny = str(save_tiny_chat_model(Path(tempfile.mkdtemp(prefix="tiny-chat-")), task_text()))
    client = FixedBatches(batches(args, args.tiny or "SmolLM2"))
    sides: dict[str, Any] = {}
    module_sizes: dict[str, int] = {}
    for method in [args.only] if args.only else ["lora", "full"]:
        sides[f"ours_{method}"], module = ours(method, args, client)
        module_sizes[method] = sum(p.numel() for p in module.trainable_parameters().values())
        sides[f"plain_{method}"] = plain(method, module, args, client)
    for side in sides.values():
        side()  # warm-up
    samples = alternate(sides, args.repeats)
    summary = summarise(samples)
    tokens = sum(int((y != IGNORE_INDEX).sum()) for _, y in client.batches)
    positions = sum(x.numel() for x, _ in client.batches)
    print(
        f"{'tiny model' if args.tiny else 'SmolLM2-135M'}: {args.steps} steps of {args.batch} records "
        f"({positions:,} positions, {tokens:,} response tokens), threads {torch.get_num_threads()}, "
        f"{args.repeats} repeats"
    )
    for name in sides:
        print(line(name, summary[name], " s", 1.0, 3))
    results: dict[str, Any] = {
        "steps": args.steps,
        "batch": args.batch,
        "context": args.context,
        "rank": args.rank,
        "repeats": args.repeats,
        "rounds": summary,
        "raw": samples,
    }
    if args.copies:  # after the timing: the profiler's overhead is not in it
        trained = {"lora": module_sizes.get("lora", 0), "full": module_sizes.get("full", 0)}
        results["copies"] = {name: copies(side, trained[name.split("_")[1]]) for name, side in sides.items()}
        for name, counted in results["copies"].items():
            print(
                f"  {name} copies per round, in trained states: " + ", ".join(f"{k} {v:g}x" for k, v in counted.items())
            )
    for method in [args.only] if args.only else ["lora", "full"]:
        ratio = ratios(samples, f"ours_{method}", f"plain_{method}")
        results[f"{method}_ours_over_plain"] = ratio
        print(ratio_line(f"{method}: ours / plain", ratio))
        print(f"  {method} CPU ratio: {fmt(ratio['cpu'], '', 1, 3)}")
    report("llm_client", before, results, args.json)


if __name__ == "__main__":
    main()

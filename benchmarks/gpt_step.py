"""One training step of TinyGPT on the CPU: time (forward + backward + Adam) and memory.

Builds the paper-size TinyGPT (6 layers, 384 wide, 6 heads) with all weights trained, or with
``--latent d`` FLITE's latent on its projections (``LatentLanguageModel``, ``layers: linear``, rank
``--rank``, factors ``--factors``): only the latent trains, and the step includes mapping it to the
weights; or with ``--lora r`` PEFT's LoRA adapters of rank r on the same projections
(``LoRALanguageModel``; ``--variant ffa`` trains only ``B``, FFA-LoRA). It runs ``--warmup`` steps
(the first allocates gradients and Adam's moments), then times ``--steps`` steps (``--repeats`` is
the same option) on one fixed random batch of ``--batch x --context`` tokens and prints the min and
median of the step's wall time and of its CPU time (user + system, all threads), with the torch
thread count and the load average before and after (``--json PATH`` also writes them, with the
memory, to a file).

Memory is the process's resident set (Linux ``/proc/self/status``; tracemalloc does not see torch's
allocator): the peak (``VmHWM``, reset through ``/proc/self/clear_refs`` once the model is built) over
the warm-up and timed steps, above the resident set of the built model. It holds the gradients and
Adam's moments (``3 x 4`` bytes per parameter, printed alongside) plus the activations and what the
allocator keeps cached. Where the reset is refused it falls back to the ``ru_maxrss`` delta.

    python benchmarks/gpt_step.py                                   # batch 8 x 128, vocab 65
    python benchmarks/gpt_step.py --latent 1024 --factors streamed  # the paper's latent, d = 1024
    python benchmarks/gpt_step.py --lora 1                          # LoRA r = 1 (--variant ffa: FFA-LoRA)
    python benchmarks/gpt_step.py --batch 16 --context 256 --threads 1
    python benchmarks/gpt_step.py --steps 10 --json gpt_step.json
"""

from __future__ import annotations

import argparse
import resource

import torch
from _harness import Sample, add_arguments, fmt, machine, measure, report, spread
from torch.nn import functional as F

from lightning_fl.methods import LatentLanguageModel, LoRALanguageModel
from lightning_fl.models import TinyGPT

MIB = 2**20


def status_bytes(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, in bytes."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1]) * 1024


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current resident set (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=128, help="the model's context and the batch's length")
    parser.add_argument("--vocab", type=int, default=65, help="65: tiny-shakespeare characters")
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--steps", "--repeats", dest="steps", type=int, default=5, help="timed steps (samples)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latent", type=int, default=0, help="d per projection; 0: train every weight")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--factors", default="stored", choices=["stored", "regenerate", "streamed"])
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank on the projections; 0: no adapters")
    parser.add_argument("--variant", default="lora", choices=["lora", "ffa"], help="with --lora: ffa trains only B")
    add_arguments(parser, repeats=None)  # --json; --steps is the number of samples
    args = parser.parse_args()
    if args.latent and args.lora:
        parser.error("--latent and --lora are two methods: give one")
    torch.set_num_threads(args.threads)
    before = machine()
    torch.manual_seed(args.seed)

    network = TinyGPT(args.vocab, args.n_layer, args.n_embd, args.n_head, context=args.context)
    weights = sum(p.numel() for p in network.parameters())  # the model's own, before LoRA adds its adapters
    model = network
    if args.latent:
        model = LatentLanguageModel(
            network, base="scratch", latent_dim=args.latent, rank=args.rank, factors=args.factors, sample_tokens=0
        )
    elif args.lora:
        model = LoRALanguageModel(network, base="scratch", variant=args.variant, rank=args.lora, sample_tokens=0)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(trained, lr=3e-4)
    x = torch.randint(args.vocab, (args.batch, args.context))
    y = torch.randint(args.vocab, (args.batch, args.context))
    params = sum(p.numel() for p in trained)

    def one() -> None:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step() -> Sample:
        return measure(one)[1]

    rss_built = status_bytes("VmRSS")
    maxrss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    reset = reset_peak()
    first = [step() for _ in range(args.warmup)]
    times = [step() for _ in range(args.steps)]
    if reset:
        extra = status_bytes("VmHWM") - rss_built
    else:
        extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - maxrss_built
    tokens = args.batch * args.context

    print(f"TinyGPT {args.n_layer}x{args.n_embd}, {args.n_head} heads, vocab {args.vocab}: {weights:,} weights")
    if args.latent:
        layers = len(model.mapping.layers)
        print(
            f"latent: d={args.latent} on {layers} projections, r={args.rank}, factors {args.factors}: {params:,} "
            f"trained values, {4 * params:,} bytes per float32 upload ({4 * weights / (4 * params):.0f}x fewer than "
            f"the {4 * weights:,} of full weights)"
        )
    elif args.lora:
        name = "FFA-LoRA" if args.variant == "ffa" else "LoRA"
        print(
            f"{name}: r={args.lora} on the projections: {params:,} trained values, {4 * params:,} bytes per float32 "
            f"upload ({4 * weights / (4 * params):.0f}x fewer than the {4 * weights:,} of full weights)"
        )
    print(f"batch {args.batch} x context {args.context} ({tokens} tokens), threads {torch.get_num_threads()}")
    print(f"warm-up steps: {', '.join(f'{t.wall * 1e3:.0f}' for t in first)} ms")
    wall, cpu = spread(t.wall for t in times), spread(t.cpu for t in times)
    print(
        f"step (fwd+bwd+Adam) over {args.steps}: {fmt(wall, ' ms', 1e3, 1)} ({tokens / wall['median']:,.0f} "
        f"tokens/s); CPU {fmt(cpu, ' ms', 1e3, 1)}"
    )
    print(
        f"memory: built model {rss_built / MIB:.0f} MiB RSS (libraries included); peak during training "
        f"+{extra / MIB:.0f} MiB ({'VmHWM' if reset else 'ru_maxrss'}), of which grads + Adam moments of the "
        f"trained values {3 * 4 * params / MIB:.0f} MiB (analytic)"
    )
    settings = {k: str(v) if k == "json" and v is not None else v for k, v in vars(args).items()}
    results = {**settings, "weights": weights, "trained_values": params, "tokens": tokens, "wall": wall, "cpu": cpu}
    results.update(warmup_steps=first, raw=times, rss_built_bytes=rss_built, peak_extra_bytes=extra)
    results["peak_source"] = "VmHWM" if reset else "ru_maxrss"
    report("gpt_step", before, results, args.json)


if __name__ == "__main__":
    main()

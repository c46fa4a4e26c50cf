"""What gradient checkpointing and a bf16 base cost and save: memory and step time of a client step on SmolLM2.

Each setting runs in a fresh process (peak memory is per process): it loads SmolLM2 (``HFCausalLM`` options
``gradient_checkpointing`` and ``dtype``), builds the method (LoRA r = 1 or FLITE's latent, two-sided factors, d = r
= 1444, on the 210 projections), takes one warm-up step, resets the process's peak resident memory
(``/proc/self/clear_refs``), then takes ``--steps`` Adam steps on instruction batches of the built-in task
(``--batch`` records, padded to their longest). It reports the resident memory after loading (the weights), the peak
above it during the steps (activations, gradients, the optimiser's state) and the median step time. Settings take
turns ``--repeats`` times; memory is the median over repeats, time the min and median.

    python benchmarks/llm_options.py --repeats 3 --json docs/results/llm_options.json
    python benchmarks/llm_options.py --tiny --steps 2 --repeats 1 --method lora   # a tiny model: checks the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {
    "float32": {"dtype": "float32", "gradient_checkpointing": False},
    "float32+checkpointing": {"dtype": "float32", "gradient_checkpointing": True},
    "bfloat16": {"dtype": "bfloat16", "gradient_checkpointing": False},
    "bfloat16+checkpointing": {"dtype": "bfloat16", "gradient_checkpointing": True},
}


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def one(args: argparse.Namespace) -> dict:
    """One setting in this process (the child's side)."""
    import torch

    from lightning_fl import LatentLanguageModel
    from lightning_fl.data import IID, FederatedInstructionDataModule, InstructionTasks
    from lightning_fl.methods import LoRALanguageModel
    from lightning_fl.models import HFCausalLM, SmolLM2

    torch.set_num_threads(args.threads)
    options = SETTINGS[args.setting]
    network = HFCausalLM(args.tiny, context=128, **options) if args.tiny else SmolLM2(context=128, **options)
    if args.method == "lora":
        model = LoRALanguageModel(network, rank=1, sample_tokens=0)
    else:
        d = 16 if args.tiny else 1444
        model = LatentLanguageModel(network, latent_dim=d, rank=d, factors="two_sided", sample_tokens=0)
    data = FederatedInstructionDataModule(
        InstructionTasks(tasks=["arithmetic", "units", "dates", "compare"]),
        tokenizer=args.tiny or "SmolLM2",
        num_clients=1,
        partition=IID(),
        context=128,
        batch_size=args.batch,
    )
    data.setup()
    batches = iter(data.client_dataloader(0, seed=0))
    trained = list(model.trainable_parameters().values())
    optimizer = torch.optim.Adam(trained, lr=1e-3)
    model.train()

    def step() -> None:
        x, y = next(batches)
        model.compute_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: lazy buffers, the optimiser's state
    loaded = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident memory starts again from here
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {
        "rss_loaded_mib": loaded / 1024,
        "peak_above_mib": (status_kib("VmHWM") - loaded) / 1024,
        "step_s": statistics.median(times),
        "trained_dtypes": sorted({str(p.dtype) for p in trained}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tiny",
        nargs="?",
        const="",
        default=None,
        help="a random tiny chat Llama instead of SmolLM2 (or the save_pretrained folder of one)",
    )
    parser.add_argument("--method", choices=["lora", "flite"], nargs="+", default=["lora", "flite"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--setting", choices=list(SETTINGS), default=None, help=argparse.SUPPRESS)  # (a child)
    args = parser.parse_args()
    if args.setting is not None:
        print(json.dumps(one(argparse.Namespace(**vars(args) | {"method": args.method[0]}))))
        return
    if args.tiny == "":  # one folder for every child, as a user's model would be
        from lightning_fl.models.tiny import save_tiny_chat_model, task_text

        args.tiny = str(save_tiny_chat_model(Path(tempfile.mkdtemp(prefix="tiny-chat-")), task_text()))
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for method in args.method:
            for setting in SETTINGS:
                cmd = [
                    sys.executable,
                    __file__,
                    "--setting",
                    setting,
                    "--method",
                    method,
                    "--steps",
                    str(args.steps),
                    "--batch",
                    str(args.batch),
                    "--threads",
                    str(args.threads),
                ]
                cmd += ["--tiny", args.tiny] if args.tiny else []
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                runs.setdefault(f"{method} {setting}", []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    results = {}
    for name, rows in runs.items():
        results[name] = {
            "rss_loaded_mib": statistics.median(r["rss_loaded_mib"] for r in rows),
            "peak_above_mib": statistics.median(r["peak_above_mib"] for r in rows),
            "step_s_min": min(r["step_s"] for r in rows),
            "step_s_median": statistics.median(r["step_s"] for r in rows),
            "trained_dtypes": rows[0]["trained_dtypes"],
        }
        r = results[name]
        print(
            f"{name}: {r['rss_loaded_mib']:.0f} MiB loaded, +{r['peak_above_mib']:.0f} MiB at peak in a step; "
            f"step {r['step_s_min']:.2f} s min, {r['step_s_median']:.2f} s median; trained {r['trained_dtypes']}"
        )
    out = {
        "model": "tiny" if args.tiny else "SmolLM2-135M",
        "batch": args.batch,
        "steps": args.steps,
        "repeats": args.repeats,
        "threads": args.threads,
        "settings": results,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

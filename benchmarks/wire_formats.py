"""The payload wire format (``lightning_fl.compress.wire``) against the same payloads in a safetensors file.

safetensors (Hugging Face's tensor file format) has the same layout as ours: a length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw little-endian bytes, with a ``__metadata__`` map of strings in
the header; its parser (Rust) is written for untrusted files. The candidate here keeps every part of a payload as
one safetensors tensor (named ``"<tensor index>.<part index>"``) and what safetensors has no place for (each
state tensor's name, shape, dtype, codec info and part names) as one JSON string in ``__metadata__``; it parses
with ``safetensors.torch.load``, reads the metadata from the header that parse has just checked, and then checks
the metadata as strictly as our parser checks its header (the same functions).

Measured for each codec's payload of a model's state (the quickstart's CNN backbone and Shakespeare's TinyGPT):

- bytes each format adds to the payload's own (header and framing);
- ``dumps`` and ``loads`` time per payload (the sides alternate; min and median of ``--repeats`` runs of ``--calls``
  calls each);
- robustness on the same damaged bytes: ``--corruptions`` copies of each honest encoding with 1-4 random bytes
  changed and a random cut, plus as many random byte strings; every one must parse or be refused with the format's
  own error (a ``PayloadFormatError`` here). Counted: parsed, refused, and anything else (a crash).

    python benchmarks/wire_formats.py
    python benchmarks/wire_formats.py --repeats 5 --json docs/results/wire_formats.json
"""

from __future__ import annotations

import argparse
import json
import random
import struct

import torch
from _harness import add_arguments, alternate, fmt, machine, report, summarise

from lightning_fl.compress import FP32, PowerSGD, Quantize, TopK, wire
from lightning_fl.compress.base import Encoded, Payload

KEY = "lightning_fl"  # the __metadata__ entry that holds the payload's own description


def st_dumps(payload: Payload) -> bytes:
    from safetensors.torch import save

    tensors, entries = {}, []
    for i, (name, enc) in enumerate(payload.tensors.items()):
        for j, t in enumerate(enc.parts.values()):
            tensors[f"{i}.{j}"] = t.detach().contiguous().cpu()
        entries.append(
            {
                "name": name,
                "shape": list(enc.shape),
                "dtype": wire._NAMES[enc.dtype],
                "info": enc.info,
                "parts": list(enc.parts),
            }
        )
    meta = json.dumps({"tensors": entries}, separators=(",", ":"), allow_nan=False)
    return save(tensors, metadata={KEY: meta})


def st_loads(data: bytes) -> Payload:
    from safetensors import SafetensorError
    from safetensors.torch import load

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise wire.PayloadFormatError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    try:
        loaded = load(data)
    except SafetensorError as err:
        raise wire.PayloadFormatError(f"not a safetensors payload ({err})") from None
    (length,) = struct.unpack_from("<Q", data)  # safetensors has checked the header that follows
    meta = json.loads(data[8 : 8 + length]).get("__metadata__") or {}
    if KEY not in meta:
        raise wire.PayloadFormatError(f"the safetensors header has no {KEY!r} metadata")
    try:
        header = json.loads(meta[KEY], parse_constant=wire._no_constant)
    except ValueError as err:
        raise wire.PayloadFormatError(f"metadata is not valid JSON ({err})") from None
    except RecursionError:
        raise wire.PayloadFormatError("metadata nests JSON too deeply") from None
    tensors: dict[str, Encoded] = {}
    used = set()
    for i, entry in enumerate(wire._field(header, "tensors", list, "metadata")):
        name, dtype, shape, where = wire._described(entry, f"tensor {i}", "tensor", tensors)
        info = wire._info(wire._field(entry, "info", dict, where), where)
        parts = {}
        for j, part in enumerate(wire._field(entry, "parts", list, where)):
            if not isinstance(part, str) or part in parts:
                raise wire.PayloadFormatError(f"{where}: part names must be distinct strings")
            key = f"{i}.{j}"
            if key not in loaded:
                raise wire.PayloadFormatError(f"{where}: part {part!r} ({key}) is missing")
            t = loaded[key]
            if t.dtype not in wire._NAMES or t.dim() > wire.MAX_NDIM:
                raise wire.PayloadFormatError(f"{where}: part {part!r} has dtype {t.dtype} or {t.dim()} dimensions")
            parts[wire._name(part, where)] = t
            used.add(key)
        tensors[name] = Encoded(parts, tuple(shape), dtype, info)
    if extra := sorted(set(loaded) - used):
        raise wire.PayloadFormatError(f"{len(extra)} tensors ({extra[0]}, ...) belong to no part")
    return Payload(tensors)


FORMATS = {"ours": (wire.dumps, wire.loads), "safetensors": (st_dumps, st_loads)}


def models() -> dict[str, dict[str, torch.Tensor]]:
    from lightning_fl.models import SmallCNN, TinyGPT

    torch.manual_seed(0)
    return {
        "quickstart CNN": SmallCNN(in_channels=1, image_size=8).state_dict(),
        "TinyGPT": TinyGPT(vocab_size=80, n_layer=4, n_embd=128, n_head=4, context=80).state_dict(),
    }


def payloads() -> dict[str, Payload]:
    out = {}
    for model, state in models().items():
        state = {k: v.float() for k, v in state.items() if v.is_floating_point()}
        trained = {k: v + 0.01 * torch.randn_like(v) for k, v in state.items()}
        for codec in (FP32(), Quantize(8), Quantize(4), TopK(0.01), PowerSGD(2)):
            out[f"{model}, {codec!r}"] = codec.encode(trained, state, client=0)
    return out


def damaged(data: bytes, rng: random.Random) -> bytes:
    x = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        x[rng.randrange(len(x))] = rng.randrange(256)
    if rng.random() < 0.3:
        x = x[: rng.randrange(len(x) + 1)]
    return bytes(x)


def robustness(honest: dict[str, bytes], loads, count: int, seed: int) -> dict[str, int]:
    rng, tally = random.Random(seed), {"parsed": 0, "refused": 0, "other": 0}
    samples = [damaged(data, rng) for data in honest.values() for _ in range(count // len(honest))]
    samples += [rng.randbytes(rng.randrange(300)) for _ in range(count)]
    for data in samples:
        try:
            loads(data)
            tally["parsed"] += 1
        except wire.PayloadFormatError:
            tally["refused"] += 1
        except Exception:  # a crash is what is counted
            tally["other"] += 1
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, repeats=5)
    parser.add_argument("--calls", type=int, default=20, help="dumps/loads calls per timed sample (default 20)")
    parser.add_argument("--corruptions", type=int, default=2000, help="damaged copies per format (default 2000)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    before = machine()
    results: dict[str, dict] = {}
    made = payloads()
    for label, payload in made.items():
        row = {"payload_bytes": payload.nbytes}
        for fmt_name, (dumps, loads) in FORMATS.items():
            data = dumps(payload)
            back = loads(data)
            assert all(
                torch.equal(back.tensors[n].parts[p], t) for n, e in payload.tensors.items() for p, t in e.parts.items()
            )
            row[f"{fmt_name}_overhead_bytes"] = len(data) - payload.nbytes
        encoded = {name: dumps(payload) for name, (dumps, _) in FORMATS.items()}
        sides = {}
        for name, (dumps, loads) in FORMATS.items():
            sides[f"{name} dumps"] = lambda dumps=dumps, p=payload: [dumps(p) for _ in range(args.calls)]
            sides[f"{name} loads"] = lambda loads=loads, d=encoded[name]: [loads(d) for _ in range(args.calls)]
        row["seconds_per_call"] = summarise(alternate(sides, args.repeats), per=args.calls)
        results[label] = row
        times = row["seconds_per_call"]
        print(
            f"{label}: {payload.nbytes} B; overhead ours {row['ours_overhead_bytes']} B, safetensors "
            f"{row['safetensors_overhead_bytes']} B; "
            + "; ".join(f"{side} {fmt(times[side]['cpu'], 'ms', 1e3)}" for side in sides)
        )
    for name, (dumps, loads) in FORMATS.items():
        encoded = {label: dumps(p) for label, p in made.items()}
        results[f"robustness {name}"] = robustness(encoded, loads, args.corruptions, seed=0)
        print(f"robustness {name}: {results[f'robustness {name}']}")
    report("wire_formats", before, {"settings": vars(args) | {"json": str(args.json)}, **results}, args.json)


if __name__ == "__main__":
    main()

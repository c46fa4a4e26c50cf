"""Upload codecs and compressors: what clients send (and, compressed, what the server broadcasts), counted in bytes
from the encoded payload."""

from lightning_fl.compress.base import FP32, Codec, Encoded, Layout, Payload, PayloadDecodeError, PayloadError
from lightning_fl.compress.downlink import Downlink, apply_broadcast
from lightning_fl.compress.error_feedback import UpdateCompressor
from lightning_fl.compress.powersgd import PowerSGD
from lightning_fl.compress.quantize import Quantize, pack_bits, unpack_bits
from lightning_fl.compress.topk import TopK

__all__ = [
    "FP32",
    "Codec",
    "Downlink",
    "Encoded",
    "Layout",
    "Payload",
    "PayloadDecodeError",
    "PayloadError",
    "PowerSGD",
    "Quantize",
    "TopK",
    "UpdateCompressor",
    "apply_broadcast",
    "pack_bits",
    "unpack_bits",
]

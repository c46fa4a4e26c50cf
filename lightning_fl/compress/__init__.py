"""Upload codecs and compressors: what clients send, counted in bytes from the encoded payload."""

from lightning_fl.compress.base import FP32, Codec, Encoded, Layout, Payload, PayloadDecodeError, PayloadError
from lightning_fl.compress.error_feedback import UpdateCompressor
from lightning_fl.compress.powersgd import PowerSGD
from lightning_fl.compress.quantize import Quantize, pack_bits, unpack_bits
from lightning_fl.compress.topk import TopK

__all__ = [
    "FP32",
    "Codec",
    "Encoded",
    "Layout",
    "Payload",
    "PayloadDecodeError",
    "PayloadError",
    "PowerSGD",
    "Quantize",
    "TopK",
    "UpdateCompressor",
    "pack_bits",
    "unpack_bits",
]

"""Upload codecs and compressors: what clients send, counted in bytes from the encoded payload."""

from lightning_fl.compress.base import FP32, Codec, Encoded, Payload
from lightning_fl.compress.quantize import Quantize, pack_bits, unpack_bits

__all__ = ["FP32", "Codec", "Encoded", "Payload", "Quantize", "pack_bits", "unpack_bits"]

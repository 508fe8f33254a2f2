"""The wire contract: message models, strict decoding and schema export. No I/O."""

from orbit.protocol.decode import DecodeError, decode_json, decode_model

__all__ = ["DecodeError", "decode_json", "decode_model"]

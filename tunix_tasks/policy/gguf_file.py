"""A GGUF file as the importer reads it: metadata and a tensor directory, nothing dequantized.

This module owns opening a llama.cpp `.gguf` file with the `gguf` package (numpy only; a
memory map), the architectures and tensor types the import supports, and its one error,
`GGUFImportError`, whose message is one line naming the file and the reason:

    g = open_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # refuses other architectures
    g.need("llama.block_count"); g.hf_shape("token_embd.weight"); g.dequantize(name)

`gguf_import.py` turns it into a checkpoint directory, `gguf_tokenizer.py` its tokenizer.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ARCHS", "SUPPORTED_TYPES", "GGUFImportError", "GgufFile", "open_gguf"]


class GGUFImportError(ValueError):
    """The GGUF file cannot be imported; the message is one line naming file and reason."""


#: Tensor types dequantized (by `gguf.quants.dequantize`); others are refused.
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

# GGUF general.architecture -> the HF family, and whether llama.cpp permuted q/k rows
# (its convert_hf_to_gguf does so only for Llama-style models).
ARCHS: dict[str, tuple[str, bool]] = {
    "llama": ("llama", True),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
}


class GgufFile:
    """A GGUF file's metadata and tensor directory (memory-mapped; nothing dequantized)."""

    def __init__(self, path: Path) -> None:
        import gguf  # here, so importing this module (e.g. the CLI's) stays light

        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
        except FileNotFoundError:
            raise GGUFImportError(f"{path}: no such file") from None
        except IsADirectoryError:
            raise GGUFImportError(f"{path}: is a directory, not a .gguf file") from None
        except (ValueError, struct.error, IndexError, OSError) as err:
            raise GGUFImportError(f"{path}: not a readable GGUF file ({err})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFImportError(f"{self.path}: metadata key {key} is missing")
        return value

    def hf_shape(self, name: str) -> tuple[int, ...]:
        # GGUF lists dimensions fastest-first (ggml's ne); numpy/HF order is the reverse.
        return tuple(int(n) for n in reversed(self.tensors[name].shape.tolist()))

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def dequantize(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        t = self.tensors[name]
        out = dequantize(t.data, t.tensor_type)
        return np.ascontiguousarray(out, dtype=np.float32).reshape(self.hf_shape(name))


def open_gguf(src: str | os.PathLike[str]) -> GgufFile:
    """The GGUF file `src`, refused in one line unless its architecture is in `ARCHS`."""
    g = GgufFile(Path(src))
    if g.arch not in ARCHS:
        raise GGUFImportError(
            f"{g.path}: architecture {g.arch!r} is not supported (supported: {', '.join(ARCHS)})"
        )
    return g

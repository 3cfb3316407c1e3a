"""An F32 copy of a quantized GGUF file: every tensor dequantized, the metadata kept.

llama.cpp run on this copy computes with exactly the values mini_vllm's fp32 engine loads from
the quantized file (``mini_vllm.model_executor.model_loader.gguf_loader`` dequantizes the same way,
with the ``gguf`` package), so the two are compared on the same numbers and differ only in how they
read them.

    python benchmarks/gguf_f32.py SRC.gguf DST.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def write_f32_copy(src: str | Path, dst: str | Path) -> Path:
    """Write ``dst``: ``src`` with every quantized tensor stored as float32 (F32 and F16 tensors
    become F32 too); key-value metadata copied unchanged. Returns ``dst``."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        # GGUFWriter writes the architecture and the GGUF.* header fields itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/gguf_f32.py SRC.gguf DST.gguf")
    print(write_f32_copy(sys.argv[1], sys.argv[2]))

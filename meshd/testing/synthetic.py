"""A synthetic Llama of any size as a Q4_0 GGUF: random blocks, SmolLM2's tokenizer.

The weights mean nothing; they exist to measure memory and speed at sizes the bundled model does
not reach (about 1 B parameters by default) without downloading anything. Block bytes are drawn
at random with one small float16 scale per block, so activations stay finite through every layer;
the file is written tensor by tensor, never held whole in memory.
Usage: python -m meshd.testing.synthetic OUT.gguf [--layers 16] [--hidden 2048] [--ffn 8192]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from meshd.shard.artifact import open_artifact

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.chat_template")


def q4_0_blocks(rng: np.random.Generator, rows: int, cols: int, scale: float) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[QT.Q4_0]
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    d = rng.uniform(0.5 * scale, 1.5 * scale, (len(data), 1)).astype(np.float16)
    data[:, :2] = d.view(np.uint8)
    return data.reshape(rows, -1)


def write_synthetic(path: str | Path, n_layers: int = 16, hidden: int = 2048, ffn: int = 8192, heads: int = 32,
                    kv_heads: int = 8, seed: int = 0) -> Path:
    """Write the model; returns its path. Tokenizer (and so vocabulary) from the bundled SmolLM2."""
    src = open_artifact("smollm2")
    md = src.metadata
    vocab = len(md["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("synthetic-llama")
    w.add_block_count(n_layers)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model(md["tokenizer.ggml.model"])
    w.add_token_list(list(md["tokenizer.ggml.tokens"]))
    w.add_token_types([int(t) for t in md["tokenizer.ggml.token_type"]])
    w.add_token_merges(list(md["tokenizer.ggml.merges"]))
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("unknown_token_id", w.add_unk_token_id), ("padding_token_id", w.add_pad_token_id)):
        if f"tokenizer.ggml.{key}" in md:
            add(int(md[f"tokenizer.ggml.{key}"]))
    if "tokenizer.chat_template" in md:
        w.add_chat_template(md["tokenizer.chat_template"])
    hd = hidden // heads
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * hd, hidden), "attn_v": (kv_heads * hd, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
              "ffn_down": (hidden, ffn)}
    tensors = [("token_embd.weight", (vocab, hidden), 0.004), ("output_norm.weight", (hidden,), 0),
               ("output.weight", (vocab, hidden), 0.0005)]
    for i in range(n_layers):
        tensors += [(f"blk.{i}.attn_norm.weight", (hidden,), 0), (f"blk.{i}.ffn_norm.weight", (hidden,), 0)]
        tensors += [(f"blk.{i}.{k}.weight", s, 0.5 / np.sqrt(s[1]) / 4) for k, s in shapes.items()]
    # the writer keeps every tensor it is given until the file is written: hand it lazy ones
    for name, shape, scale in tensors:
        if len(shape) == 1:
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4, raw_dtype=QT.F32)
        else:
            nbytes = shape[0] * shape[1] // 32 * 18
            w.add_tensor_info(name, (shape[0], nbytes // shape[0]), np.dtype(np.uint8), nbytes, raw_dtype=QT.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, scale in tensors:
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, np.float32))
        else:
            w.write_tensor_data(q4_0_blocks(rng, *shape, scale))
    w.close()
    return Path(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    args = ap.parse_args()
    path = write_synthetic(args.out, args.layers, args.hidden, args.ffn)
    print(f"{path}: {path.stat().st_size / 1e6:.0f} MB")


if __name__ == "__main__":
    main()

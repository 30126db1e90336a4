"""The native lane's repacking: every supported GGUF type multiplies like its dequantized reference."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf.quants import dequantize

from meshd.shard import quant
from meshd.shard.linear import native_weight

LOSSLESS = [QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q8_0]


def random_blocks(qt: QT, rows: int, cols: int, seed: int = 0) -> quant.RawTensor:
    """Random block bytes with sane float16 scales (all code bits random)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qt]
    n = rows * cols // block
    data = rng.integers(0, 256, (n, size), dtype=np.uint8)
    f16 = lambda k: rng.uniform(-0.05, 0.05, (n, k)).astype(np.float16).view(np.uint8)  # noqa: E731
    if qt in (QT.Q4_K, QT.Q5_K):
        data[:, 0:4] = f16(2)
    elif qt == QT.Q6_K:
        data[:, -2:] = f16(1)
    else:
        data[:, 0:2] = f16(1)
        if qt in (QT.Q4_1, QT.Q5_1):
            data[:, 2:4] = f16(1)
    return quant.RawTensor("t", qt, (rows, cols), data.reshape(rows, -1))


@pytest.mark.parametrize("qt", LOSSLESS, ids=lambda q: q.name)
def test_lossless_types_decode_exactly_and_multiply_within_float_rounding(qt):
    rows, cols = 2048 + 48, 512  # more than one packing chunk, and a last chunk of a 16-row tile
    raw = random_blocks(qt, rows, cols)
    ref = torch.from_numpy(dequantize(raw.data, qt).reshape(rows, cols))
    codes = quant.decode(raw)
    w = np.repeat(codes.a, 32, 1) * codes.u + np.repeat(codes.b, 32, 1)
    assert np.array_equal(w, ref.numpy())
    x = torch.randn(3, cols)
    y = quant.pack(raw, torch.float32).mm(x)  # float32 activations and scales: float rounding only
    expected = x @ ref.T
    assert y.shape == (3, rows)
    assert float((y - expected).abs().max()) <= 2e-6 * float(expected.abs().max()) * cols ** 0.5
    yb = quant.pack(raw, torch.bfloat16).mm(x.bfloat16()).float()  # the lane's dtype: bfloat16 rounding
    assert float((yb - expected).abs().max()) <= 2e-2 * float(expected.abs().max())


def test_q6_k_is_requantized_to_8_bits_per_32_with_half_a_step_of_loss():
    rows, cols = 64, 512
    raw = random_blocks(QT.Q6_K, rows, cols)
    ref = dequantize(raw.data, QT.Q6_K).reshape(rows, cols)
    codes = quant.decode(raw)
    w = np.repeat(codes.a, 32, 1) * codes.u + np.repeat(codes.b, 32, 1)
    step = np.repeat(codes.a, 32, 1)  # an 8-bit step of each 32-wide group
    assert np.all(np.abs(w - ref) <= 0.501 * step)
    x = torch.randn(2, cols)
    err = (quant.pack(raw, torch.float32).mm(x) - x @ torch.from_numpy(ref).T).abs().max()
    assert float(err) < 0.01 * float((x @ torch.from_numpy(ref).T).abs().max())


@pytest.mark.parametrize("qt", [QT.Q2_K, QT.Q3_K, QT.IQ4_NL, QT.TQ1_0], ids=lambda q: q.name)
def test_an_unsupported_type_fails_with_its_name(qt):
    block, size = GGML_QUANT_SIZES[qt]
    raw = quant.RawTensor("blk.0.ffn_up.weight", qt, (16, block), np.zeros((16, size), np.uint8))
    with pytest.raises(quant.UnsupportedQuantization, match=qt.name):
        quant.pack(raw, torch.bfloat16)


def test_rows_that_are_not_whole_tiles_are_padded_and_cut():
    raw = random_blocks(QT.Q4_0, 40, 64, seed=2)
    ref = torch.from_numpy(dequantize(raw.data, QT.Q4_0).reshape(40, 64))
    x = torch.randn(1, 64)
    y = quant.pack(raw, torch.float32).mm(x)
    assert y.shape == (1, 40) and torch.allclose(y, x @ ref.T, atol=1e-4)


def test_parts_of_mixed_types_run_as_one_weight():
    q, v = random_blocks(QT.Q4_K, 32, 256, 3), random_blocks(QT.Q8_0, 16, 256, 4)
    w = native_weight([q, v], torch.float32)
    ref = torch.from_numpy(np.concatenate([dequantize(q.data, QT.Q4_K).reshape(32, 256),
                                           dequantize(v.data, QT.Q8_0).reshape(16, 256)]))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0))
    assert w.shape == (48, 256)
    # one weight: exactly its parts' products side by side
    alone = torch.cat([native_weight([p], torch.float32).mm(x) for p in (q, v)], dim=-1)
    assert torch.equal(w.mm(x), alone)
    # and near the float product: the kernel quantizes activations to 8 bits per block (per 256 for Q4_K),
    # a few percent of the range at most (CI once saw 1.2% on unseeded activations)
    expected = x @ ref.T
    assert float((w.mm(x) - expected).abs().max()) <= 3e-2 * float(expected.abs().max())


def test_quantized_embedding_rows_are_dequantized_on_lookup():
    raw = random_blocks(QT.Q8_0, 100, 64, seed=5)
    table = quant.QuantRows(raw)
    ids = torch.tensor([[3, 99, 3]])
    out = table.lookup(ids)
    ref = dequantize(raw.data, QT.Q8_0).reshape(100, 64)
    assert out.shape == (1, 3, 64) and out.dtype == torch.float32
    assert np.array_equal(out[0].numpy(), ref[[3, 99, 3]])


@pytest.mark.parametrize("qt", [QT.Q4_0, QT.Q8_0, QT.Q5_K], ids=lambda q: q.name)
def test_native_bytes_is_what_packing_holds(qt):
    raw = random_blocks(qt, 2048 + 48, 512)
    w = quant.pack(raw, torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in w.tensors())
    assert quant.native_bytes(qt, raw.shape) == held
    stored = raw.data.nbytes
    bound = {QT.Q4_0: 1.12, QT.Q8_0: 1.2, QT.Q5_K: 1.85}[qt]  # 5, 10 and 10 bits for 4.5, 8.5 and 5.5
    assert held <= bound * stored, (held, stored)

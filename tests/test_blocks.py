"""The GGUF block kernel (meshd/shard/_blocks.c): sums exactly as its rule says, whatever the batch,
the threads or the CPU path; checked against gguf's own dequantized blocks."""

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from meshd.shard import blocks

pytestmark = pytest.mark.skipif(blocks.KERNEL is None, reason="the C extension did not build here")
TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]
K_HALVES = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}  # where a super-block keeps its f16 scales


def k_blocks(qt: QT, rows: int, cols: int, rng) -> np.ndarray:
    """K-type rows (gguf cannot quantize to them): random codes, sub-block scales and mins, and
    f16 super-block scales of a plausible size."""
    elems, size = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, (rows, cols // elems, size), dtype=np.uint8)
    for at in K_HALVES[qt]:
        raw[:, :, at:at + 2] = (rng.uniform(0.5, 2.0, (rows, cols // elems, 1)) * 1e-2).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def weight(qt: QT, rows: int, cols: int, seed: int = 0, tiles: bool | None = None
           ) -> tuple[blocks.BlockWeight, np.ndarray]:
    rng = np.random.default_rng(seed)
    raw = k_blocks(qt, rows, cols, rng) if qt in K_HALVES else quantize(
        rng.standard_normal((rows, cols)).astype(np.float32), qt)
    w = blocks.BlockWeight.from_raw(qt, raw, cols, tiles=tiles)
    return w, dequantize(raw, qt).reshape(rows, cols).astype(np.float64)


def quantized_activations(x: np.ndarray, qt: QT = QT.Q8_0) -> np.ndarray:
    """The kernel's activations as numbers: per row and block, d = max|x| / 127, q = round(x / d);
    a block is 32 wide, or a super-block's 256 for a K-type weight."""
    g = x.astype(np.float32).reshape(x.shape[0], -1, 256 if qt in K_HALVES else 32)
    d = np.abs(g).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d)).astype(np.float32)
    q = np.clip(np.rint(g * inv), -127, 127)
    return (q * d.astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("qt", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3, 4, 9, 128])
def test_products_equal_the_dequantized_blocks_times_the_quantized_activations(qt, m):
    w, ref = weight(qt, 70, 512)  # 70 rows: a last strip of two, and unequal thread shares
    x = torch.randn(m, 512) * 3
    y = w.mm(x).double().numpy()
    expected = quantized_activations(x.numpy(), qt) @ ref.T
    # only float32 rounding is left once the activations are quantized as the rule says
    assert np.abs(y - expected).max() <= 1e-5 * np.abs(expected).max(), np.abs(y - expected).max()
    # and the quantization itself costs about half a step of 8 bits
    exact = x.double().numpy() @ ref.T
    assert np.abs(y - exact).max() <= 2e-2 * np.abs(exact).max()


@pytest.mark.parametrize("qt", TYPES, ids=lambda q: q.name)
def test_every_row_gets_its_bits_alone_whatever_the_batch_and_threads(qt):
    cols = 768 if qt in K_HALVES else 576  # K types: three super-blocks
    w, _ = weight(qt, 1000, cols, seed=1)
    x = torch.randn(37, cols)
    alone = torch.cat([w.mm(x[i:i + 1]) for i in range(37)])
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a daemon runs (blocks.divide_threads): beside a torch pool the kernel takes one
    try:
        for threads in (1, 2, 3, 5, 7):  # 3, 5 and 7 cut parts at four rows past an eight-row strip
            blocks.set_threads(threads)
            assert blocks._pool_threads() == threads  # the parts really go to that many threads
            assert torch.equal(w.mm(x), alone), threads
            assert torch.equal(w.mm(x[5:9]), alone[5:9]), threads
            assert torch.equal(torch.cat([w.mm(x[i:i + 1]) for i in range(3)]), alone[:3]), threads
    finally:
        blocks.set_threads(2)
        torch.set_num_threads(torch_threads)


@pytest.mark.parametrize("qt", TYPES, ids=lambda q: q.name)
def test_the_portable_path_gives_the_bits_of_the_vector_path(qt):
    if blocks.isa() == "portable":
        pytest.skip("this CPU runs the portable path only")
    w, _ = weight(qt, 67, 512, seed=2)  # 67: a last strip of three
    portable = dataclasses.replace(w, portable=True)
    for m in (1, 5, 128):
        x = torch.randn(m, 512)
        assert torch.equal(portable.mm(x), w.mm(x))
    residual = torch.randn(5, 67)
    a, b = residual.clone(), residual.clone()
    x = torch.randn(5, 512)
    assert torch.equal(portable.mm(x, add_to=a), w.mm(x, add_to=b))


@pytest.mark.parametrize("qt", TYPES, ids=lambda q: q.name)
def test_the_avx2_path_gives_the_bits_of_the_avx512_path(qt):
    """Two weight rows a 512-bit register, VNNI's integer sums, the scales of eight rows converted
    at once: the numbers of AVX2's one row a register, for every strip shape and thread share."""
    if blocks.isa() != "avx512":
        pytest.skip("this CPU has no AVX-512 VNNI")
    cols = 768 if qt in K_HALVES else 576
    for rows in (67, 70, 8, 3):  # strips of eight, then four, then fewer; 67 and 70 split unevenly
        w, _ = weight(qt, rows, cols, seed=rows)
        avx2 = dataclasses.replace(w, at_most="avx2")
        for m in (1, 2, 3, 4, 5, 9, 33):
            x = torch.randn(m, cols) * 4
            x[0, :40] = 0.0  # a block of zeros: d = 0
            assert torch.equal(avx2.mm(x), w.mm(x)), (rows, m)
            residual = torch.randn(m, rows)
            assert torch.equal(avx2.mm(x, add_to=residual.clone()), w.mm(x, add_to=residual.clone()))
    # codes at their extremes: Q8_0's -128 (0x80) and -1 (0xff), every 4- and 5-bit code at 15 or 31
    elems, size = GGML_QUANT_SIZES[qt]
    for fill in (0x80, 0xFF, 0x00):
        raw = np.full((16, cols // elems * size), fill, np.uint8)
        for at in K_HALVES.get(qt, (0, 2) if qt in (QT.Q4_1, QT.Q5_1) else (0,)):  # finite scales, mins
            raw.reshape(16, -1, size)[:, :, at:at + 2] = np.array([0.5], np.float16).view(np.uint8)
        w = blocks.BlockWeight.from_raw(qt, raw, cols)
        x = torch.where(torch.arange(cols) % 3 == 0, -50.0, 50.0).repeat(5, 1)
        for m in (1, 5):
            assert torch.equal(dataclasses.replace(w, at_most="avx2").mm(x[:m]), w.mm(x[:m])), fill


@pytest.mark.parametrize("qt", [QT.Q4_1, QT.Q8_0, QT.Q4_K, QT.Q6_K], ids=lambda q: q.name)
def test_both_paths_quantize_ties_tiny_and_non_finite_activations_alike(qt):
    """The AVX2 quantizer against the portable one where rounding and conversion have corners:
    halves (to even), a block of subnormals (1 / d overflows), zeros, infinities and NaN."""
    if blocks.isa() == "portable":
        pytest.skip("this CPU runs the portable path only")
    w, _ = weight(qt, 9, 512, seed=4)
    x = torch.zeros(6, 512)
    x[0] = torch.arange(512) % 16 - 7.5  # max 8.5 (127 / 8.5 scales them), halves everywhere
    x[0, ::32] = 127.0
    x[1] = (torch.arange(512) - 256.0) / 2  # with a max of 127.5 in a block, q = round(x * 127 / 127.5)
    x[2] = torch.randn(512) * 1e-43  # subnormal: d = max / 127 rounds far down, 1 / d to infinity
    x[3, 7], x[3, 300] = float("inf"), float("-inf")
    x[4, 9], x[4, 400] = float("nan"), 3.0
    x[5] = torch.randn(512)  # and a plain row among them
    portable = dataclasses.replace(w, portable=True)
    assert torch.equal(portable.mm(x).view(torch.int32), w.mm(x).view(torch.int32))


@pytest.mark.parametrize("qt", [QT.Q5_0, QT.Q4_K, QT.Q6_K], ids=lambda q: q.name)
def test_extreme_codes_and_scales_stay_exact(qt):
    """All-ones and all-zeros bytes: every code at its top or bottom (Q6_K's -32 and 31, Q5's 31),
    and activations at the quantizer's +-127, so no integer partial sum may overflow."""
    elems, size = GGML_QUANT_SIZES[qt]
    for fill in (0xFF, 0x00):
        raw = np.full((6, 512 // elems * size), fill, np.uint8)
        for at in K_HALVES.get(qt, (0,)):  # a half of 1.0 wherever a scale lives
            raw.reshape(6, -1, size)[:, :, at:at + 2] = np.array([1.0], np.float16).view(np.uint8)
        w = blocks.BlockWeight.from_raw(qt, raw, 512)
        ref = dequantize(raw, qt).reshape(6, 512).astype(np.float64)
        x = torch.where(torch.arange(512) % 3 == 0, -50.0, 50.0).repeat(3, 1)
        expected = quantized_activations(x.numpy(), qt) @ ref.T
        y = w.mm(x).double().numpy()
        assert np.abs(y - expected).max() <= 1e-5 * max(np.abs(expected).max(), 1.0)
        assert torch.equal(dataclasses.replace(w, portable=True).mm(x), w.mm(x))


TILE_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q8_0]


@pytest.mark.parametrize("qt", TILE_TYPES, ids=lambda q: q.name)
def test_tiles_give_the_bits_of_rows_on_every_path_batch_and_thread_count(qt):
    """Eight rows a tile, a register's lanes the rows: the sums of the row layout, bit for bit."""
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for n, k in ((8, 32), (24, 64), (72, 576)):
            rows, _ = weight(qt, n, k, seed=n, tiles=False)
            tiles, _ = weight(qt, n, k, seed=n, tiles=True)
            assert tiles.tiled and not rows.tiled and tiles.data.shape == rows.data.shape
            for m in (1, 2, 3, 4, 9, 33):
                x = torch.randn(m, k) * 4
                x[0, :40] = 0.0  # a block of zeros: d = 0
                want = rows.mm(x)
                residual = torch.randn(m, n)
                added = rows.mm(x, add_to=residual.clone())
                for path in ({"portable": True}, {"at_most": "avx2"}, {"at_most": "avx512"}):
                    w = dataclasses.replace(tiles, **path)
                    for threads in (1, 2, 3):  # 3: shares of whole tiles, one of them empty for n = 8
                        blocks.set_threads(threads)
                        assert torch.equal(w.mm(x), want), (n, k, m, path, threads)
                        assert torch.equal(w.mm(x, add_to=residual.clone()), added), (n, k, m, path, threads)
    finally:
        blocks.set_threads(2)
        torch.set_num_threads(torch_threads)
    # codes at their extremes: Q8_0's -128 (0x80) and -1 (0xff), every 4-bit code at 15
    elems, size = GGML_QUANT_SIZES[qt]
    for fill in (0x80, 0xFF, 0x00):
        raw = np.full((16, 256 // elems * size), fill, np.uint8)
        for at in (0, 2) if qt == QT.Q4_1 else (0,):
            raw.reshape(16, -1, size)[:, :, at:at + 2] = np.array([0.5], np.float16).view(np.uint8)
        x = torch.where(torch.arange(256) % 3 == 0, -50.0, 50.0).repeat(5, 1)
        want = blocks.BlockWeight.from_raw(qt, raw, 256, tiles=False).mm(x)
        assert torch.equal(blocks.BlockWeight.from_raw(qt, raw, 256, tiles=True).mm(x), want), fill


def tile_in_numpy(qtype: QT, rows: np.ndarray) -> np.ndarray:
    """`blocks.tile` as array operations: the reference for the kernel's repacking."""
    n, row_bytes = rows.shape
    _, size = GGML_QUANT_SIZES[qtype]
    nb, head, t = row_bytes // size, (4 if qtype == QT.Q4_1 else 2), n // blocks.TILE
    b = rows.reshape(t, blocks.TILE, nb, size)
    halves = b[..., :head].reshape(t, blocks.TILE, nb, head // 2, 2).transpose(0, 2, 3, 1, 4).reshape(t, nb, -1)
    codes = b[..., head:].reshape(t, blocks.TILE, nb, (size - head) // 4, 4).transpose(0, 2, 3, 1, 4).reshape(t, nb, -1)
    return np.concatenate([halves, codes], axis=2).reshape(n, row_bytes)


def test_a_tile_holds_its_rows_bytes_where_the_kernel_reads_them():
    """Per tile of eight rows and per block: the eight d halves, Q4_1's eight m halves, then each
    group of four code bytes, row after row (_blocks_tiles.c)."""
    rng = np.random.default_rng(7)
    for qt, head in ((QT.Q4_0, 2), (QT.Q4_1, 4), (QT.Q8_0, 2)):
        _, size = GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, (16, 3 * size), dtype=np.uint8)
        tiled = blocks.tile(qt, raw)
        assert tiled.shape == raw.shape and sorted(tiled.ravel()) == sorted(raw.ravel())
        assert np.array_equal(tile_in_numpy(qt, raw), tiled)  # the kernel's repacking and numpy's
        blocks_of = raw.reshape(2, 8, 3, size)  # [tile, row, block, byte]
        for t in range(2):
            for b in range(3):
                tb = tiled.reshape(2, 3, 8 * size)[t, b]  # a tile's blocks follow one another
                for r in range(8):
                    block = blocks_of[t, r, b]
                    assert bytes(tb[2 * r:2 * r + 2]) == bytes(block[:2])  # d
                    if qt == QT.Q4_1:
                        assert bytes(tb[16 + 2 * r:18 + 2 * r]) == bytes(block[2:4])  # m
                    codes = block[head:]
                    for g in range(len(codes) // 4):
                        at = 8 * head + 32 * g + 4 * r
                        assert bytes(tb[at:at + 4]) == bytes(codes[4 * g:4 * g + 4])
    with pytest.raises(ValueError, match="cannot be tiled"):
        blocks.tile(QT.Q4_0, np.zeros((12, 18), np.uint8))  # not whole tiles
    with pytest.raises(ValueError, match="cannot be tiled"):
        blocks.tile(QT.Q5_0, np.zeros((8, 22), np.uint8))


@pytest.mark.parametrize("qt", TILE_TYPES, ids=lambda q: q.name)
def test_a_tied_table_in_tiles_looks_up_the_rows_of_the_file(qt):
    """A tied LM head's table in tiles: the embedding reads each row back exactly as the file has it."""
    from gguf.quants import quantize as q

    from meshd.shard.linear import lookup
    from meshd.shard.quant import QuantRows, RawTensor

    rng = np.random.default_rng(3)
    raw = q(rng.standard_normal((40, 96)).astype(np.float32), qt)
    ids = rng.integers(0, 40, 25)
    assert np.array_equal(blocks.untile_rows(qt, blocks.tile(qt, raw), ids), raw[ids])
    table = QuantRows(RawTensor("token_embd.weight", qt, (40, 96), raw))
    before = lookup(table, torch.from_numpy(ids).reshape(5, 5))
    table.retile()
    assert table.tiled and not np.array_equal(table.data.numpy(), raw)
    assert torch.equal(lookup(table, torch.from_numpy(ids).reshape(5, 5)), before)


def test_weights_are_tiled_only_where_the_type_rows_and_layout_allow(monkeypatch):
    monkeypatch.setattr(blocks, "isa", lambda: "avx2")  # where tiles pay
    assert weight(QT.Q4_0, 16, 64)[0].tiled
    assert not weight(QT.Q4_0, 12, 64)[0].tiled  # not whole tiles
    assert not weight(QT.Q5_0, 16, 64)[0].tiled and not weight(QT.Q6_K, 16, 256)[0].tiled
    blocks.set_layout("rows")
    try:
        assert not weight(QT.Q4_1, 16, 64)[0].tiled
    finally:
        blocks.set_layout("auto")
    with pytest.raises(ValueError, match="unknown weight layout"):
        blocks.set_layout("columns")
    monkeypatch.setattr(blocks, "isa", lambda: "avx2")
    assert weight(QT.Q4_0, 16, 64)[0].tiled
    assert not weight(QT.Q8_0, 16, 64)[0].tiled  # on AVX2 its rows were faster for one x row
    monkeypatch.setattr(blocks, "isa", lambda: "avx512")
    assert weight(QT.Q4_0, 16, 64)[0].tiled and weight(QT.Q8_0, 16, 64)[0].tiled
    monkeypatch.setattr(blocks, "isa", lambda: "portable")
    assert not weight(QT.Q4_0, 16, 64)[0].tiled
    blocks.set_layout("tiles")
    try:
        assert weight(QT.Q8_0, 16, 64)[0].tiled and weight(QT.Q4_0, 16, 64)[0].tiled
        assert not weight(QT.Q4_0, 12, 64)[0].tiled and not weight(QT.Q5_0, 16, 64)[0].tiled
    finally:
        blocks.set_layout("auto")
    # the kernel refuses a tile flag it cannot honour
    w, _ = weight(QT.Q4_0, 12, 64, tiles=False)
    with pytest.raises(ValueError, match="unsupported block type"):
        blocks.KERNEL.matmul(int(QT.Q4_0) | blocks.TILED, w.data.data_ptr(), 36, 12, 64, 0, 0, 0, 1, 0, 0)
    w, _ = weight(QT.Q5_0, 8, 64)
    with pytest.raises(ValueError, match="unsupported block type"):
        blocks.KERNEL.matmul(int(QT.Q5_0) | blocks.TILED, w.data.data_ptr(), 44, 8, 64, 0, 0, 0, 1, 0, 0)


def test_k_types_need_whole_super_blocks():
    with pytest.raises(ValueError, match="do not hold rows"):
        blocks.BlockWeight.from_raw(QT.Q4_K, np.zeros((2, 144), np.uint8), 128)
    w, _ = weight(QT.Q6_K, 4, 256)
    with pytest.raises(ValueError, match="unsupported block type"):
        blocks.KERNEL.matmul(int(QT.Q6_K), w.data.data_ptr(), 105, 4, 128, 0, 0, 0, 1, 0, 0)


def test_the_layout_names_every_type_the_kernel_runs():
    assert all(t.name in blocks.LAYOUT for t in TYPES) and set(TYPES) == blocks.TYPES


def test_the_native_fingerprint_covers_the_kernel_recipe():
    """v3 quantized K types' activations per 256; v4 sums a 32-wide block as one integer and one fused
    multiply-add: peers with an earlier kernel compute other bits and must not share a route."""
    from meshd.shard import recipe

    assert "q8-g256" in blocks.LAYOUT and blocks.LAYOUT.endswith("v4")
    assert blocks.LAYOUT in recipe.NATIVE.layout
    for old in ("v2", "v3"):
        earlier = dataclasses.replace(recipe.NATIVE, layout=recipe.NATIVE.layout.replace(blocks.LAYOUT, old))
        assert earlier.fingerprint("m", "a", "t") != recipe.NATIVE.fingerprint("m", "a", "t")


def recipe_in_numpy(qt: QT, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Recipe v4 for Q4_0, Q4_1 and Q8_0 written out: activations quantized per 32 as the kernel does;
    per block the exact integer t of codes times x's codes (Q4_0's offset of 8 taken off as 8 times
    x's sum); acc = fma(a * xd, t, acc) in K order (in 64-bit-mantissa floats, exact, then rounded
    once to float32); Q4_1's offsets apart, off = fma(m, xs, off); the output acc + off."""
    g = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = (np.abs(g).max(axis=-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d)).astype(np.float32)
    q = np.clip(np.rint(g * inv[..., None]), -127, 127).astype(np.int64)
    xs = (d * q.sum(axis=-1).astype(np.float32)).astype(np.float32)
    _, size = GGML_QUANT_SIZES[qt]
    blk = raw.reshape(raw.shape[0], -1, size)
    a = blk[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qt == QT.Q8_0:
        u = blk[..., 2:].view(np.int8).astype(np.int64)
    else:
        nib = blk[..., 4 if qt == QT.Q4_1 else 2:].astype(np.int64)
        u = np.concatenate([nib & 15, nib >> 4], axis=-1) - (8 if qt == QT.Q4_0 else 0)
    m = blk[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if qt == QT.Q4_1 else None
    t = np.einsum("nbe,rbe->rnb", u, q)  # [x rows, weight rows, blocks], exact
    f = np.longdouble
    acc = np.zeros(t.shape[:2], np.float32)
    off = np.zeros(t.shape[:2], np.float32)
    for b in range(t.shape[2]):
        scale = (a[None, :, b] * d[:, None, b]).astype(np.float32)
        acc = (scale.astype(f) * t[..., b].astype(f) + acc.astype(f)).astype(np.float32)
        if m is not None:
            off = (m[None, :, b].astype(f) * xs[:, None, b].astype(f) + off.astype(f)).astype(np.float32)
    return acc + off


@pytest.mark.parametrize("qt", [QT.Q4_0, QT.Q4_1, QT.Q8_0], ids=lambda q: q.name)
def test_a_32_wide_block_is_one_integer_sum_and_one_fused_multiply_add(qt):
    """The kernel's bits are recipe v4's as written out in numpy, in both layouts and on every path."""
    rng = np.random.default_rng(7)
    raw = quantize(rng.standard_normal((16, 256)).astype(np.float32), qt)
    x = rng.standard_normal((5, 256)).astype(np.float32) * 3
    x[1, :32] = 0.0  # a block of zeros: d = 0
    want = torch.from_numpy(recipe_in_numpy(qt, raw, x))
    for tiles in (False, True):
        w = blocks.BlockWeight.from_raw(qt, raw, 256, tiles=tiles)
        for path in ({"portable": True}, {"at_most": "avx2"}, {}):
            got = dataclasses.replace(w, **path).mm(torch.from_numpy(x))
            assert torch.equal(got, want), (tiles, path, (got - want).abs().max())


def test_zero_rows_and_subnormal_scales_are_exact():
    w, ref = weight(QT.Q4_1, 8, 64, seed=3, tiles=False)
    data = w.data.numpy().copy()
    data[:, 0:2] = np.array([1], np.uint16).view(np.uint8)  # the smallest subnormal half as every row's first d
    w = blocks.BlockWeight(QT.Q4_1, torch.from_numpy(data), 8, 64)
    ref = dequantize(data, QT.Q4_1).reshape(8, 64).astype(np.float64)
    x = torch.zeros(2, 64)
    x[1] = torch.randn(64)
    y = w.mm(x).double().numpy()
    assert np.all(y[0] == 0)
    expected = quantized_activations(x.numpy()) @ ref.T
    assert np.abs(y - expected).max() <= 1e-5 * np.abs(expected).max()
    assert blocks.BlockWeight(QT.Q4_0, torch.zeros(4, 18, dtype=torch.uint8), 4, 32).mm(torch.randn(0, 32)).shape == (0, 4)


def test_inconsistent_sizes_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="do not hold rows"):
        blocks.BlockWeight.from_raw(QT.Q4_1, np.zeros((4, 19), np.uint8), 32)
    w, _ = weight(QT.Q8_0, 4, 64)
    with pytest.raises(ValueError, match="matmul of"):
        w.mm(torch.randn(1, 32))
    with pytest.raises(ValueError, match="unsupported block type"):
        blocks.KERNEL.matmul(11, w.data.data_ptr(), 68, 4, 64, 0, 0, 0, 1, 0, 0)  # Q3_K: not run here


def test_rms_norm_follows_torch_and_is_the_same_per_row_and_path():
    w = torch.randn(200)
    x = torch.randn(3, 7, 200) * 4
    norm = blocks.Norm(w)
    y = norm.apply(x, 1e-5)
    ref = torch.nn.functional.rms_norm(x.double(), (200,), w.double(), 1e-5)
    assert y.dtype == torch.float32 and float((y - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert torch.equal(norm.apply(x[1:2, 3:4], 1e-5), y[1:2, 3:4])
    if blocks.isa() != "portable":
        assert torch.equal(blocks.Norm(w, portable=True).apply(x, 1e-5), y)
    assert norm.apply(x.bfloat16(), 1e-5).dtype == torch.bfloat16


def kv(kv_heads: int, length: int, hd: int, capacity: int):
    """Keys and values as a session's cache holds them: bfloat16 views into a longer buffer."""
    k = torch.randn(1, kv_heads, capacity, hd).bfloat16()
    v = torch.randn(1, kv_heads, capacity, hd).bfloat16()
    return k[:, :, :length], v[:, :, :length]


@pytest.mark.parametrize("heads,kv_heads,pos,n", [(4, 4, 5, 7), (9, 3, 5, 7), (9, 3, 37, 4)])
def test_attention_follows_sdpa_and_each_row_equals_its_decode_step(heads, kv_heads, pos, n):
    """(9, 3, 37, 4): rows over 38-41 keys, five blocks of eight and every tail after them."""
    hd = 64
    keys, values = kv(kv_heads, pos + n, hd, 64)
    q = torch.randn(1, n, heads, hd).transpose(1, 2)  # the strided view a layer hands over
    out = blocks.attention(q, keys, values, pos)
    assert out.shape == (1, heads, n, hd)
    kf, vf = (t.double().repeat_interleave(heads // kv_heads, dim=1) for t in (keys, values))
    mask = torch.arange(pos + n)[None, :] <= torch.arange(pos, pos + n)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), kf, vf, attn_mask=mask)
    assert float((out - ref).abs().max()) < 1e-5
    for r in range(n):  # a row of a many-position pass is bit for bit the one-position step
        step = blocks.attention(q[:, :, r:r + 1], keys[:, :, :pos + r + 1], values[:, :, :pos + r + 1], pos + r)
        assert torch.equal(step, out[:, :, r:r + 1])
    if blocks.isa() != "portable":
        assert torch.equal(blocks.attention(q, keys, values, pos, portable=True), out)


def test_attention_refuses_what_it_cannot_compute():
    keys, values = kv(3, 4, 64, 8)
    with pytest.raises(ValueError, match="over 4 cached"):
        blocks.attention(torch.randn(1, 9, 2, 64), keys, values, 3)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        blocks.attention(torch.randn(1, 8, 1, 64), keys, values, 3)


def test_a_product_added_into_the_residual_rounds_as_x_plus_the_product():
    w, _ = weight(QT.Q4_1, 48, 128, seed=4)
    x, residual = torch.randn(3, 128), torch.randn(3, 48)
    into = residual.clone()
    assert w.mm(x, add_to=into) is into
    assert torch.equal(into, residual + w.mm(x))
    with pytest.raises(ValueError, match="cannot add"):
        w.mm(x, add_to=torch.zeros(3, 47))


def test_rope_into_the_cache_rotates_like_the_rotary_tables():
    from meshd.shard.config import ModelConfig  # noqa: F401 (the tables come from Rotary below)
    from meshd.shard.llama import Rotary

    class Cfg:
        head_dim, rope_theta = 64, 10000.0

    rot = Rotary(Cfg, 32)
    heads, kv_heads, hd, pos, n = 6, 2, 64, 3, 5
    qkv = torch.randn(n, (heads + 2 * kv_heads) * hd)
    keys = torch.zeros(1, kv_heads, 16, hd, dtype=torch.bfloat16)
    values = torch.zeros_like(keys)
    q = blocks.rope_kv(qkv, pos, rot.cos, rot.signed_sin, heads, kv_heads, keys, values)
    split = qkv.view(n, heads + 2 * kv_heads, hd).transpose(0, 1)[None]  # [1, heads, n, hd]
    ref = rot.apply(split[:, :heads + kv_heads], pos)
    assert float((q - ref[:, :heads]).abs().max()) < 1e-6
    assert torch.equal(keys[:, :, pos:pos + n], ref[:, heads:].to(torch.bfloat16))  # round to nearest even
    assert torch.equal(values[:, :, pos:pos + n], split[:, heads + kv_heads:].to(torch.bfloat16))
    assert keys[:, :, :pos].abs().sum() == 0 and keys[:, :, pos + n:].abs().sum() == 0  # nothing else written
    with pytest.raises(ValueError, match="do not fit"):
        blocks.rope_kv(qkv, 12, rot.cos, rot.signed_sin, heads, kv_heads, keys, values)


def test_silu_mul_follows_torch_and_both_paths_agree():
    x = torch.randn(5, 2 * 100) * 10
    x[0, :3] = torch.tensor([-200.0, 200.0, 0.0])  # past exp's range both ways
    y = blocks.silu_mul(x)
    ref = torch.nn.functional.silu(x[:, :100].double()) * x[:, 100:].double()
    assert float((y - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    if blocks.isa() != "portable":
        assert torch.equal(blocks.silu_mul(x, portable=True), y)


def test_a_whole_layer_in_one_call_gives_the_bits_of_its_steps():
    from types import SimpleNamespace

    from meshd.shard.llama import Rotary

    hidden, heads, kv_heads, hd, ffn = 128, 4, 2, 32, 96
    rng = np.random.default_rng(5)

    raws = {}

    def w(rows, cols, qt=QT.Q4_1):
        raws[rows, cols, qt] = raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32), qt)
        return blocks.BlockWeight.from_raw(qt, raw, cols)

    p = SimpleNamespace(attn_norm=blocks.Norm(torch.rand(hidden) + 0.5), ffn_norm=blocks.Norm(torch.rand(hidden) + 0.5),
                        wqkv=w((heads + 2 * kv_heads) * hd, hidden), wo=w(hidden, heads * hd, QT.Q8_0),
                        w_gate_up=w(2 * ffn, hidden, QT.Q4_0), w_down=w(hidden, ffn))
    # the same layer with every weight in the other layout (tiles where the default is rows, or rows)
    other = SimpleNamespace(**{name: blocks.BlockWeight.from_raw(v.qtype, raws[v.out_features, v.in_features, v.qtype],
                                                                  v.in_features, tiles=not v.tiled)
                               if isinstance(v, blocks.BlockWeight) else v for name, v in vars(p).items()})
    rot = Rotary(SimpleNamespace(head_dim=hd, rope_theta=10000.0), 64)
    caches = [[torch.zeros(1, kv_heads, 16, hd, dtype=torch.bfloat16) for _ in range(2)] for _ in range(4)]
    # two sessions in one batch: 3 rows at positions 0.. and 1 row at position 5 (its earlier keys random)
    caches[1][0][:, :, :5], caches[1][1][:, :, :5] = torch.randn(1, kv_heads, 5, hd), torch.randn(1, kv_heads, 5, hd)
    for a, b in zip(caches[3], caches[1]):
        a.copy_(b)
    x = torch.randn(4, hidden)
    fused = blocks.layer(x.clone(), blocks.layer_args(p), 1e-5, rot.cos, rot.signed_sin, heads, kv_heads, hd,
                         [(0, 3, 0, *caches[0]), (3, 1, 5, *caches[1])])
    y = x.clone()  # the same layer, step by step
    qkv = p.wqkv.mm(p.attn_norm.apply(y, 1e-5))
    att = torch.empty(4, heads * hd)
    for row, n, pos, (keys, values) in ((0, 3, 0, caches[2]), (3, 1, 5, caches[3])):
        q = blocks.rope_kv(qkv[row:row + n], pos, rot.cos, rot.signed_sin, heads, kv_heads, keys, values)
        blocks.attention(q, keys[:, :, :pos + n], values[:, :, :pos + n], pos, out=att[row:row + n])
    p.wo.mm(att, add_to=y)
    p.w_down.mm(blocks.silu_mul(p.w_gate_up.mm(p.ffn_norm.apply(y, 1e-5))), add_to=y)
    assert torch.equal(fused, y)
    assert all(torch.equal(a, b) for a, b in zip(caches[0] + caches[1], caches[2] + caches[3]))
    if blocks.isa() != "portable":
        again = blocks.layer(x.clone(), blocks.layer_args(p), 1e-5, rot.cos, rot.signed_sin, heads, kv_heads, hd,
                             [(0, 3, 0, *caches[0]), (3, 1, 5, *caches[1])], portable=True)
        assert torch.equal(again, fused)
    again = blocks.layer(x.clone(), blocks.layer_args(other), 1e-5, rot.cos, rot.signed_sin, heads, kv_heads, hd,
                         [(0, 3, 0, *caches[0]), (3, 1, 5, *caches[1])])
    assert torch.equal(again, fused)
    with pytest.raises(ValueError, match="do not fit"):
        blocks.layer(x.clone(), blocks.layer_args(p), 1e-5, rot.cos, rot.signed_sin, heads, kv_heads, hd,
                     [(0, 4, 14, *caches[0])])


def test_layers_in_one_call_give_the_bits_of_one_call_a_layer():
    """`blocks.layers`: three layers (each its own weights and caches) and two sessions in one kernel
    call, against `blocks.layer` three times; and refusals before anything runs."""
    from types import SimpleNamespace

    from meshd.shard.llama import Rotary

    hidden, heads, kv_heads, hd, ffn = 64, 4, 2, 16, 96
    rng = np.random.default_rng(9)

    def w(rows, cols, qt):
        return blocks.BlockWeight.from_raw(qt, quantize(rng.standard_normal((rows, cols)).astype(np.float32), qt), cols)

    ps = [SimpleNamespace(attn_norm=blocks.Norm(torch.rand(hidden) + 0.5), ffn_norm=blocks.Norm(torch.rand(hidden) + 0.5),
                          wqkv=w((heads + 2 * kv_heads) * hd, hidden, QT.Q4_1), wo=w(hidden, heads * hd, QT.Q8_0),
                          w_gate_up=w(2 * ffn, hidden, QT.Q4_0), w_down=w(hidden, ffn, QT.Q5_0)) for _ in range(3)]
    rot = Rotary(SimpleNamespace(head_dim=hd, rope_theta=10000.0), 64)

    def caches():  # per layer, per session: keys and values; session 1 has 4 earlier positions
        c = [[[torch.zeros(1, kv_heads, 16, hd, dtype=torch.bfloat16) for _ in range(2)] for _ in range(2)] for _ in range(3)]
        for layer in c:
            layer[1][0][:, :, :4], layer[1][1][:, :, :4] = torch.randn(1, kv_heads, 4, hd), torch.randn(1, kv_heads, 4, hd)
        return c

    one, many = caches(), caches()
    for a, b in zip(one, many):
        for (ka, va), (kb, vb) in zip(a, b):
            kb.copy_(ka), vb.copy_(va)
    x = torch.randn(3, hidden)
    y = x.clone()
    for p, c in zip(ps, one):
        blocks.layer(y, blocks.layer_args(p), 1e-5, rot.cos, rot.signed_sin, heads, kv_heads, hd,
                     [(0, 2, 0, *c[0]), (2, 1, 4, *c[1])])
    z = blocks.layers(x.clone(), [blocks.layer_args(p) for p in ps], 1e-5, rot.cos, rot.signed_sin, heads, kv_heads,
                      hd, [[(0, 2, 0, *c[0]), (2, 1, 4, *c[1])] for c in many])
    assert torch.equal(z, y) and not torch.equal(z, x)
    assert all(torch.equal(a, b) for la, lb in zip(one, many) for sa, sb in zip(la, lb) for a, b in zip(sa, sb))
    args = [blocks.layer_args(p) for p in ps]
    with pytest.raises(ValueError, match="do not fit"):
        blocks.layers(x.clone(), args, 1e-5, rot.cos, rot.signed_sin, heads, kv_heads, hd,
                      [[(0, 3, 14, *c[0])] for c in many])
    with pytest.raises(ValueError, match="one weight tuple"):
        blocks.layers(x.clone(), args[:2], 1e-5, rot.cos, rot.signed_sin, heads, kv_heads, hd,
                      [[(0, 3, 0, *c[0])] for c in many])
    bad = list(args[2])
    bad[5] -= 8  # qkv's out features no longer make the heads
    untouched = x.clone()
    with pytest.raises(ValueError, match="unsupported block type|do not make a Llama layer"):
        blocks.layers(untouched, [args[0], args[1], tuple(bad)], 1e-5, rot.cos, rot.signed_sin, heads, kv_heads, hd,
                      [[(0, 3, 0, *c[0])] for c in many])
    assert torch.equal(untouched, x)  # refused before the first layer ran


def test_torch_matmuls_beside_the_pool_get_its_threads(monkeypatch):
    """Under divide_threads a float weight's F.linear (what the kernel does not run) gets the pool's
    threads while it runs, a small one stays on one, and torch is back on one after."""
    from meshd.shard import linear as lin
    from meshd.shard.recipe import EXACT, NATIVE

    seen, real = [], torch.nn.functional.linear
    monkeypatch.setattr(lin.F, "linear", lambda *a: (seen.append(torch.get_num_threads()), real(*a))[1])
    before = torch.get_num_threads()
    try:
        blocks.divide_threads(2, NATIVE)
        big, small = torch.randn(1024, 576), torch.randn(64, 64)
        lin.linear(torch.randn(3, 576), big)
        lin.linear(torch.randn(1, 64), small)
        lin.linear(torch.randn(1, 576), big.bfloat16())  # through _mm, the activations cast
        assert seen == [2, 1, 2] and torch.get_num_threads() == 1
        blocks.divide_threads(2, EXACT)  # torch holds the threads itself: nothing lent
        lin.linear(torch.randn(1, 576), big)
        assert seen[-1] == 2 and torch.get_num_threads() == 2
    finally:
        blocks.divide_threads(before, EXACT)
        blocks.set_threads(2)

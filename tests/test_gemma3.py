"""Gemma 3 (meshd/shard/gemma3.py) on tiny random models built by transformers' own classes: sliding layers
interleaved with global ones, a prompt longer than the window, from Hugging Face directories and from GGUF
written as llama.cpp's converter writes it (norms stored as 1 + w); and the refusals."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.shard import footprint, gemma3
from meshd.shard.artifact import open_artifact
from meshd.shard.config import ModelConfig, UnsupportedArchitecture
from meshd.shard.recipe import EXACT, NATIVE
from meshd.shard.runtime import Shard
from tests import tiny_models
from tests.test_shard_tiny import LOGIT_ATOL, reference_run, split_run

QT = tiny_models.gguf.GGMLQuantizationType
WINDOW = 16
PROMPT = [int(t) for t in np.random.default_rng(1).integers(3, tiny_models.VOCAB, 40)]  # 2.5 windows
STEPS = 16
CUTS = ((0, 4), (4, 8), (8, 12))  # layer 5 global in the middle shard, layer 11 in the last


def three_way(artifact, recipe=EXACT):
    return [Shard(artifact, a, b, recipe) for a, b in CUTS]


def _save(model, d, source):
    if source == "hf":
        model.save_pretrained(d / source)
    elif source == "q8.gguf":  # the reference holds exactly the weights the quantized file stores
        tiny_models.quantize_linear_weights(model, QT.Q8_0)
        tiny_models.write_gemma3_gguf(model, d / source, qtype=QT.Q8_0)
    else:
        tiny_models.write_gemma3_gguf(model, d / source)
    return open_artifact(d / source)


@pytest.mark.parametrize("source", ["hf", "tiny.gguf", "q8.gguf"])
def test_three_way_split_matches_transformers_past_the_window(tmp_path, source):
    model = tiny_models.tiny_gemma3(seed=41, window=WINDOW)
    artifact = _save(model, tmp_path, source)
    cfg = artifact.config
    assert cfg.family == "gemma3" and cfg.sliding_window == WINDOW and cfg.local_rope_theta == 10000.0
    assert cfg.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10) and cfg.rope_theta == 1e6
    ref_tokens, ref_logits = reference_run(model, PROMPT, STEPS)
    tokens, logits = split_run(three_way(artifact), PROMPT, STEPS)
    assert tokens == ref_tokens
    worst = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits))
    assert worst < LOGIT_ATOL, worst


def test_the_window_matters_at_these_positions():
    """The same weights attending over everything are far off: the parity above would catch a window ignored."""
    model = tiny_models.tiny_gemma3(seed=41, window=WINDOW)
    unbounded = tiny_models.tiny_gemma3(seed=41, window=256)
    unbounded.load_state_dict(model.state_dict())
    with torch.inference_mode():
        a, b = model(torch.tensor([PROMPT])).logits[0, -1], unbounded(torch.tensor([PROMPT])).logits[0, -1]
    assert float((a - b).abs().max()) > 1000 * LOGIT_ATOL


@pytest.mark.parametrize("source", ["hf", "tiny.gguf"])
def test_softcap_scalar_and_scaled_global_rope(tmp_path, source):
    """Final logit soft-capping, linear RoPE scaling on the global layers (Gemma 3 4B+) and, from a Hugging Face
    config, a query_pre_attn_scalar other than head_dim (llama.cpp derives it from the head in GGUF)."""
    model = tiny_models.tiny_gemma3(seed=42, window=WINDOW, softcap=3.0, scalar=24 if source == "hf" else 32,
                                    rope={"rope_type": "linear", "factor": 4.0})
    artifact = _save(model, tmp_path, source)
    cfg = artifact.config
    assert cfg.final_softcap == 3.0 and cfg.rope_scaling.kind == "linear"
    assert cfg.attn_scalar == (24.0 if source == "hf" else 32.0)
    ref_tokens, ref_logits = reference_run(model, PROMPT, 8)
    tokens, logits = split_run(three_way(artifact), PROMPT, 8)
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)) < LOGIT_ATOL
    assert float(ref_logits[0].abs().max()) < 3.0  # capped


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q8_0])
def test_native_split_equals_one_process_exactly(tmp_path, qtype):
    model = tiny_models.tiny_gemma3(seed=43, window=WINDOW)
    art = open_artifact(tiny_models.write_gemma3_gguf(model, tmp_path / "n.gguf", qtype=qtype))
    assert art.is_quantized
    one_tokens, one_logits = split_run([Shard(art, 0, 12, NATIVE)], PROMPT, STEPS)
    tokens, logits = split_run(three_way(art, NATIVE), PROMPT, STEPS)
    assert tokens == one_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, one_logits))
    if qtype == QT.Q8_0:  # close to transformers on the file's weights (bfloat16 KV, 8-bit activations)
        tiny_models.quantize_linear_weights(model, qtype)
        ref_tokens, ref_logits = reference_run(model, PROMPT, 4)
        assert float((logits[0] - ref_logits[0]).abs().max()) < 0.1


def test_kernel_window_attention_equals_masked_attention():
    """The native lane's windowed attention (rows from key 0 in one kernel call, later rows over their own
    window) against a masked softmax in float64 over the same bfloat16 keys; and a prefill's rows carry the
    bits of one-position steps. A query_pre_attn_scalar other than head_dim scales the queries."""
    if not gemma3.blocks.KERNEL:
        pytest.skip("the block kernel did not build here")
    torch.manual_seed(0)
    heads, kv_heads, hd, n = 4, 2, 32, 40
    q = torch.randn(1, heads, n, hd)
    keys, values = torch.randn(1, kv_heads, n, hd).bfloat16(), torch.randn(1, kv_heads, n, hd).bfloat16()
    for scalar in (32.0, 24.0):
        cfg = ModelConfig("gemma3", "gemma3", 1, 128, heads, kv_heads, hd, 1, 1, 1e-6, attn_scalar=scalar)
        for pos, window in ((0, 16), (10, 16), (0, 0), (24, 16)):
            rows = n - pos
            got = gemma3._kernel_attention(q[:, :, pos:], keys, values, pos, window, cfg)
            qpos, kpos = torch.arange(pos, n)[:, None], torch.arange(n)[None, :]
            mask = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
            k64, v64 = keys.double().repeat_interleave(2, 1), values.double().repeat_interleave(2, 1)
            scores = (q[:, :, pos:].double() @ k64.transpose(-1, -2)) * scalar ** -0.5
            want = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v64
            assert float((got.double() - want).abs().max()) < 1e-5, (scalar, pos, window)
            steps = [gemma3._kernel_attention(q[:, :, p:p + 1], keys[:, :, :p + 1], values[:, :, :p + 1], p, window, cfg)
                     for p in range(pos, n)]
            assert torch.equal(got, torch.cat(steps, dim=2)) and got.shape[2] == rows


def test_footprint_before_loading_equals_what_a_shard_holds(tmp_path):
    model = tiny_models.tiny_gemma3(seed=44, window=WINDOW)
    model.save_pretrained(tmp_path / "hf")
    for art in (open_artifact(tmp_path / "hf"),
                open_artifact(tiny_models.write_gemma3_gguf(model, tmp_path / "m.gguf", qtype=QT.Q4_0))):
        for recipe in (EXACT, NATIVE):
            for a, b in ((0, 4), (4, 8), (8, 12), (0, 12)):
                assert footprint.weight_bytes(art, recipe, a, b) == Shard(art, a, b, recipe).weight_bytes, (art.path, a, b)


def _hf_doc(tmp_path, **changes):
    tiny_models.tiny_gemma3(seed=45).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text()) | changes


@pytest.mark.parametrize("changes, match", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "activation"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, "sliding layers"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}}, "dynamic"),
    ({"layer_types": ["chunked_attention"] * 12}, "layer_types"),
])
def test_math_it_does_not_compute_is_refused_by_name(tmp_path, changes, match):
    with pytest.raises(UnsupportedArchitecture, match=match):
        ModelConfig.from_hf(_hf_doc(tmp_path, **changes))


def test_transformers_4_config_spelling(tmp_path):
    """rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern at the top level (transformers 4)."""
    doc = _hf_doc(tmp_path)
    for key in ("rope_parameters", "layer_types"):
        doc.pop(key)
    doc |= {"rope_theta": 1e6, "rope_local_base_freq": 5e3, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "sliding_window_pattern": 3}
    cfg = ModelConfig.from_hf(doc)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling.kind, cfg.rope_scaling.factor) == (1e6, 5e3, "linear", 8.0)
    assert cfg.sliding_layers == (0, 1, 3, 4, 6, 7, 9, 10)


def _gguf(path, **keys):
    w = tiny_models.gguf.GGUFWriter(str(path), "gemma3")
    for k, v in {"block_count": 2, "embedding_length": 64, "attention.head_count": 4, "feed_forward_length": 32,
                 "attention.sliding_window": 8, **keys}.items():
        if isinstance(v, str):
            w.add_string(f"gemma3.{k}", v)
        else:
            w.add_float32(f"gemma3.{k}", v) if isinstance(v, float) else w.add_uint32(f"gemma3.{k}", v)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    tiny_models._finish(w)
    return path


@pytest.mark.parametrize("keys, match", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64}, "yarn"),
    ({"attention.value_length": 8, "attention.key_length": 16}, "value width"),
])
def test_gguf_keys_it_does_not_compute_are_refused_by_name(tmp_path, keys, match):
    with pytest.raises(UnsupportedArchitecture, match=match):
        open_artifact(_gguf(tmp_path / "f.gguf", **keys))


def test_gguf_without_a_window_has_no_sliding_layers(tmp_path):
    """llama.cpp: a gemma3 file without gemma3.attention.sliding_window attends globally in every layer."""
    assert open_artifact(_gguf(tmp_path / "f.gguf", **{"attention.sliding_window": 0})).config.sliding_layers == ()
    assert open_artifact(_gguf(tmp_path / "g.gguf")).config.sliding_layers == (0, 1)


def test_rotary_tables_grow_with_the_same_bits():
    """Tables computed up to the positions asked for carry, position by position, a full table's bits."""
    cfg = ModelConfig("gemma3", "gemma3", 1, 64, 4, 2, 32, 1, 1, 1e-6, rope_theta=1e6, max_positions=8192)
    grown = gemma3.llama.Rotary(cfg, cfg.max_positions)
    full = gemma3.llama.Rotary(cfg, cfg.max_positions, first=cfg.max_positions)
    assert grown.cos.shape[0] == gemma3.llama.TABLE_START and full.cos.shape[0] == 8192
    x = torch.randn(1, 4, 3, 32)
    for start in (0, 300, 700, 5000, 8189):
        assert torch.equal(grown.apply(x, start), full.apply(x, start)), start
    assert grown.cos.shape[0] == 8192


def test_windowed_kv_stays_bounded_and_returns_the_window():
    """A session of 5000 positions one at a time: the windowed layers' caches never pass three windows (rounded
    to the growth step) while the global layer's grows with the session; every append returns, from first(li),
    exactly the positions written."""
    from meshd.shard.kv import GROW_STEP, KVStore

    w = 512
    store = KVStore(3, 1, 2, torch.float32, budget_bytes=1 << 30)
    kv = store.open("s", max_length=8192, n_layers=3, windows=(0, w, w))
    for pos in range(5000):
        kv.reserve(pos, 1)
        for li in range(3):
            value = torch.full((1, 1, 1, 2), float(pos))
            keys, _ = kv.append(li, value, value, pos)
            first = kv.first(li)
            assert first <= max(0, pos - w + 1)
            if pos % 997 == 0 or pos > 4990:
                assert torch.equal(keys[0, 0, :, 0], torch.arange(first, pos + 1, dtype=torch.float32))
        kv.commit(pos + 1)
        assert kv.sk.shape[3] <= 3 * w + GROW_STEP and store.used_bytes == kv.nbytes
    assert kv.capacity >= 5000 and kv.base >= 5000 - 3 * w - GROW_STEP
    with pytest.raises(ValueError, match="replay from position 0"):
        kv.reserve(kv.base, 1)  # a rollback further back than the windowed caches hold
    kv.commit(5000 - w)  # a rollback of one window is always served
    kv.reserve(5000 - w, 1)
    assert kv.first(1) <= 5000 - 2 * w + 1
    kv.reserve(0, 4)  # a replay from the start
    assert kv.base == 0 and store.release("s") and store.used_bytes == 0


@settings(max_examples=40, deadline=None)
@given(window=st.sampled_from([16, 64, 100, 512]), length=st.integers(1, 3000), seed=st.integers(0, 2**31),
       rows=st.sampled_from([1, 7, 128]))
def test_what_admission_promises_a_windowed_session_bounds_what_it_holds(window, length, seed, rows):
    """Fed in passes of up to `rows` positions (prefill chunks, decode steps, rollbacks of up to a window),
    a session never holds more KV than `bytes_for_session` promised it at open, and for windows much
    shorter than the session the promise is far below a full-attention one's."""
    import random

    from meshd.shard.kv import KVStore, window_positions

    windows = (0, window, window)
    store = KVStore(3, 1, 2, torch.float32, budget_bytes=1 << 30)
    promise = store.bytes_for_session(length, windows, rows)
    kv = store.open("s", max_length=length, n_layers=3, windows=windows)
    rng, pos, high = random.Random(seed), 0, 0
    while pos < length:
        n = min(length - pos, rng.randint(1, rows))
        kv.reserve(pos, n)
        kv.commit(pos + n)
        assert kv.nbytes <= promise
        pos += n
        high = max(high, pos)
        if rng.random() < 0.1 and pos > 1:  # rejected drafts roll back, at most a window from the furthest
            pos = max(pos - rng.randint(1, 16), high - window, 1)
            kv.commit(pos)
    # two of three layers hold a fraction of a long session (their bound rounds up to the grow step)
    if length > 10 * window_positions(window, 10 ** 9, rows):
        assert promise < store.bytes_for_session(length, (0, 0, 0)) * 0.45


@pytest.mark.parametrize("recipe", [EXACT, NATIVE])
def test_long_session_past_many_windows_with_rollback(tmp_path, recipe):
    """120 positions through windows of 16 (the windowed caches drop positions several times): the exact lane
    split three ways follows transformers, the native lane split equals one process; a rollback of a few
    positions recomputes the same tokens."""
    model = tiny_models.tiny_gemma3(seed=46, window=WINDOW)
    if recipe is EXACT:
        model.save_pretrained(tmp_path / "hf")
        art = open_artifact(tmp_path / "hf")
        ref_tokens, ref_logits = reference_run(model, PROMPT, 80)
    else:
        art = open_artifact(tiny_models.write_gemma3_gguf(model, tmp_path / "q.gguf", qtype=QT.Q4_0))
        ref_tokens, ref_logits = split_run([Shard(art, 0, 12, NATIVE)], PROMPT, 80)
    shards = three_way(art, recipe)
    tokens, logits = split_run(shards, PROMPT, 80, key="keep")
    assert tokens == ref_tokens
    if recipe is EXACT:
        assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)) < LOGIT_ATOL
    else:
        assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
    seq = PROMPT + tokens
    for s in shards:  # the same session again, step by step, then four positions rolled back and recomputed
        s.open_session("r")
    for pos, chunk in [(0, PROMPT)] + [(len(PROMPT) + i, [t]) for i, t in enumerate(tokens[:-1])]:
        x = torch.tensor([chunk])
        for s in shards:
            x = s.forward("r", x, pos)
    assert int(x.argmax()) == tokens[-1]
    for s in shards:
        s.trim("r", len(seq) - 5)
        assert s.kv.get("r").base > 0 or s.kv.get("r").n_sliding == 0
    x = torch.tensor([seq[-5:-1]])
    for s in shards:
        x = s.forward("r", x, len(seq) - 5)
    assert int(x.argmax()) == tokens[-1]


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q5_0])
def test_native_sessions_in_a_batch_equal_sessions_alone(tmp_path, qtype):
    """Prompts on both sides of the window, batched with one another's decode rows: bit for bit their solo runs
    (Q4_0 and Q5_0, both in the block kernel)."""
    from tests.test_batch import batched, solo

    model = tiny_models.tiny_gemma3(seed=47, window=8)
    art = open_artifact(tiny_models.write_gemma3_gguf(model, tmp_path / "b.gguf", qtype=qtype))
    shards = [Shard(art, a, b, NATIVE) for a, b in CUTS]
    prompts = [PROMPT[:5], PROMPT, PROMPT[:12], PROMPT[7:9]]
    alone = [solo(shards, p, ("solo", k)) for k, p in enumerate(prompts)]
    together = batched(shards, prompts, "batch")
    assert all(torch.equal(a, b) for x, y in zip(alone, together) for a, b in zip(x, y))

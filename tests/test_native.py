"""The native lane: GGUF weights at their stored width, on tiny models and on SmolLM2."""

import json
import subprocess
import sys

import pytest
import torch

from meshd.shard import blocks, footprint
from meshd.shard.artifact import open_artifact
from meshd.shard.recipe import COMPACT, EXACT, NATIVE, get_recipe
from meshd.shard.runtime import Shard
from meshd.shard.tokenizer import load_tokenizer
from tests import tiny_models
from tests.test_shard_tiny import PROMPT, split_run

QT = tiny_models.gguf.GGMLQuantizationType


def shards(artifact, recipe, cuts):
    bounds = [0, *cuts, artifact.config.n_layers]
    return [Shard(artifact, a, b, recipe) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0], ids=lambda q: q.name)
def test_tiny_quantized_gguf_native_follows_exact(tmp_path, qtype):
    """Same weights, two lanes: native (int4 kernel, bfloat16 activations) stays near exact (float32),
    which also checks that Q/K rows are un-permuted on quantized bytes as on floats."""
    model = tiny_models.tiny_llama(seed=4)
    tiny_models.quantize_linear_weights(model, qtype)
    art = open_artifact(tiny_models.write_llama_gguf(model, tmp_path / "m.gguf", qtype=qtype))
    assert art.is_quantized and get_recipe("auto", art) is NATIVE
    (e,), (n,) = split_run(shards(art, EXACT, (2, 4)), PROMPT, 1)[1], split_run(shards(art, NATIVE, (3,)), PROMPT, 1)[1]
    # bfloat16 activations drift by a few percent of the logit range on this random model (measured
    # 2-4%); a wrong row order or block decoding would be off by the whole range
    assert float((e - n).abs().max()) < 0.08 * float(e.abs().max()), float((e - n).abs().max())


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe"])
def test_native_split_equals_one_process_exactly(tmp_path, kind):
    if kind == "llama":
        art = open_artifact(tiny_models.write_llama_gguf(tiny_models.tiny_llama(seed=5), tmp_path / "m.gguf",
                                                         qtype=QT.Q4_0))
    else:
        art = open_artifact(tiny_models.write_qwen3_gguf(tiny_models.tiny_qwen3(moe=True, seed=5),
                                                         tmp_path / "m.gguf", qtype=QT.Q4_0))
        assert art.is_quantized and art.config.n_experts == 4
    one_tokens, one_logits = split_run(shards(art, NATIVE, ()), PROMPT, 24)
    tokens, logits = split_run(shards(art, NATIVE, (1, 4)), PROMPT, 24)
    assert tokens == one_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, one_logits))


def test_auto_recipe_is_exact_for_float_models_and_fingerprints_differ(tmp_path):
    model = tiny_models.tiny_llama()
    art = open_artifact(tiny_models.write_llama_gguf(model, tmp_path / "f.gguf"))
    assert not art.is_quantized and get_recipe("auto", art) is EXACT
    prints = {r.fingerprint("m", "llama", "t") for r in (EXACT, COMPACT, NATIVE)}
    assert len(prints) == 3
    with pytest.raises(ValueError, match="unknown recipe"):
        get_recipe("fast")


@pytest.mark.parametrize("recipe", [EXACT, COMPACT, NATIVE], ids=lambda r: r.name)
def test_footprint_before_loading_equals_what_a_shard_holds(tmp_path, recipe):
    model = tiny_models.tiny_llama(tie=True, seed=6)
    gguf_art = open_artifact(tiny_models.write_llama_gguf(model, tmp_path / "m.gguf", qtype=QT.Q8_0))
    model.save_pretrained(tmp_path / "hf")
    gpt2 = tiny_models.tiny_gpt2()
    gpt2.save_pretrained(tmp_path / "gpt2")
    moe = tiny_models.tiny_qwen3(moe=True)
    moe.save_pretrained(tmp_path / "moe")
    moe_gguf = tiny_models.write_qwen3_gguf(moe, tmp_path / "moe.gguf", qtype=QT.Q4_0)
    for art in (gguf_art, open_artifact(tmp_path / "hf"), open_artifact(tmp_path / "gpt2"),
                open_artifact(tmp_path / "moe"), open_artifact(moe_gguf)):
        for a, b in ((0, 2), (2, 4), (4, 6), (0, 6)):
            assert footprint.weight_bytes(art, recipe, a, b) == Shard(art, a, b, recipe).weight_bytes, (art.path, a, b)


def test_a_range_beyond_the_memory_limit_is_refused_by_name(tmp_path):
    art = open_artifact(tiny_models.write_llama_gguf(tiny_models.tiny_llama(), tmp_path / "m.gguf", qtype=QT.Q4_0))
    need = footprint.weight_bytes(art, NATIVE, 0, 6)
    assert footprint.check_fits(art, NATIVE, 0, 6, memory=need, limit=0) == need
    with pytest.raises(footprint.MemoryRefused, match="more than --memory"):
        footprint.check_fits(art, NATIVE, 0, 6, memory=need - 1, limit=0)
    with pytest.raises(footprint.MemoryRefused, match="memory limit"):
        footprint.check_fits(art, NATIVE, 0, 6, limit=need, used=1)


def test_cgroup_limit_is_read_from_v1_and_v2(tmp_path):
    (tmp_path / "memory" / "a").mkdir(parents=True)
    (tmp_path / "memory" / "a" / "memory.limit_in_bytes").write_text("123456789\n")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "memory.max").write_text("max\n")
    v1 = tmp_path / "v1"
    v1.write_text("4:memory:/a\n0::/b\n")
    assert footprint.cgroup_limit(str(v1), str(tmp_path)) == 123456789
    v2 = tmp_path / "v2"
    v2.write_text("0::/b\n")
    assert footprint.cgroup_limit(str(v2), str(tmp_path)) is None
    (tmp_path / "b" / "memory.max").write_text("5000\n")
    assert footprint.cgroup_limit(str(v2), str(tmp_path)) == 5000


# ---- SmolLM2 ----

@pytest.fixture(scope="module")
def smollm2():
    return open_artifact("smollm2")


@pytest.mark.slow
def test_smollm2_native_split_equals_one_native_process(smollm2):
    tok = load_tokenizer(smollm2)
    whole = [Shard(smollm2, 0, 30, NATIVE)]
    split = [Shard(smollm2, 0, 10, NATIVE), Shard(smollm2, 10, 20, NATIVE), Shard(smollm2, 20, 30, NATIVE)]
    for prompt in ["The capital of France is", "def fibonacci(n):", "Once upon a time"]:
        ids = tok(prompt).input_ids
        one, one_logits = split_run(whole, ids, 32)
        three, logits = split_run(split, ids, 32)
        assert three == one, prompt
        assert all(torch.equal(a, b) for a, b in zip(logits, one_logits))


@pytest.mark.slow
def test_smollm2_native_agrees_with_exact_teacher_forced(smollm2):
    """Top-1 agreement per position on the exact lane's own greedy continuation (the bench reports
    the same measure against llama.cpp)."""
    tok = load_tokenizer(smollm2)
    exact, native = Shard(smollm2, 0, 30, EXACT), Shard(smollm2, 0, 30, NATIVE)
    agree = total = 0
    for prompt in ["The capital of France is", "def fibonacci(n):", "Explain why the sky is blue."]:
        ids = tok(prompt).input_ids
        ref, _ = split_run([exact], ids, 48)
        native.open_session("f")
        got = [int(native.forward("f", torch.tensor([ids]), 0).argmax())]
        for p, t in enumerate(ref[:-1]):
            got.append(int(native.forward("f", torch.tensor([[t]]), len(ids) + p).argmax()))
        native.release("f")
        agree += sum(a == b for a, b in zip(got, ref))
        total += len(ref)
    assert agree / total >= 0.9, (agree, total)


RSS_SCRIPT = """
import gc, json, sys
from meshd.shard.artifact import open_artifact
from meshd.shard.footprint import rss_bytes
from meshd.shard.recipe import get_recipe
from meshd.shard.runtime import Shard
a = open_artifact(sys.argv[3]); gc.collect(); before = rss_bytes()
s = Shard(a, int(sys.argv[1]), int(sys.argv[2]), get_recipe("native")); gc.collect()
print(json.dumps({"rss": rss_bytes() - before, "weights": s.weight_bytes}))
"""


def rss_growth(start: int, end: int, model: str = "smollm2") -> int:
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(start), str(end), model], capture_output=True,
                         text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])["rss"]


@pytest.mark.slow
def test_smollm2_native_memory_follows_the_file(smollm2):
    """Resident memory (file pages included) grows by at most 1.3x the GGUF bytes a shard owns:
    per layer (10:20 against 10:11), and for the head's embedding and the tail's LM head."""
    one = rss_growth(10, 11)
    block = footprint.owned_artifact_bytes(smollm2, 10, 11)
    for a, b in ((10, 20), (0, 10), (20, 30)):
        grown = rss_growth(a, b) - one
        owned = footprint.owned_artifact_bytes(smollm2, a, b) - block
        assert grown <= 1.3 * owned, (a, b, grown, owned)


def test_moe_layer_bytes_count_every_expert_and_auto_takes_the_largest_layer(tmp_path):
    from meshd.dht.placement import largest_layer_bytes

    model = tiny_models.tiny_qwen3(moe=True)
    art = open_artifact(tiny_models.write_qwen3_gguf(model, tmp_path / "m.gguf", qtype=QT.Q4_0))
    moe = footprint.layer_bytes(art, NATIVE, 0)
    names = [n for n in art.tensor_names() if n.startswith("blk.0.")]
    assert any("exps" in n for n in names) and "blk.0.ffn_gate_inp.weight" in names
    q4 = sum(art.stored_bytes(n) for n in names if art.tensor_qtype(n) == QT.Q4_0)
    f32 = sum(art.stored_bytes(n) for n in names if art.tensor_qtype(n) == QT.F32)  # norms and the router
    if blocks.available(QT.Q4_0):
        assert moe == q4 + f32  # the kernel multiplies Q4_0 blocks as the file stores them
    else:
        assert moe == q4 * 20 // 18 + f32  # Q4_0's 18 bytes a block become 16 of codes, a scale and a zero
    held = Shard(art, 0, 1, NATIVE).weight_bytes - art.stored_bytes("token_embd.weight")  # the head holds the table
    assert held == moe  # all four experts are held
    assert largest_layer_bytes(art, NATIVE) == moe


def test_a_gguf_without_a_tokenizer_is_refused_clearly_at_the_head(tmp_path):
    from meshd.shard.artifact import ArtifactError

    art = open_artifact(tiny_models.write_qwen3_gguf(tiny_models.tiny_qwen3(), tmp_path / "m.gguf"))
    with pytest.raises(ArtifactError, match="carries no tokenizer"):
        load_tokenizer(art)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0], ids=lambda q: q.name)
def test_a_many_position_pass_equals_its_one_position_steps_bit_for_bit(tmp_path, qtype):
    """Where the block kernel runs the layers, a prefill (or a replay) of n positions in one pass gives
    the bits n decode steps give: the hidden states of every position and the logits of the last."""
    if not blocks.available(qtype):
        pytest.skip("the block kernel did not build here")
    model = tiny_models.tiny_llama(seed=7)
    tiny_models.quantize_linear_weights(model, qtype)
    art = open_artifact(tiny_models.write_llama_gguf(model, tmp_path / "m.gguf", qtype=qtype))
    body, tail = Shard(art, 0, 4, NATIVE), Shard(art, 4, art.config.n_layers, NATIVE)
    ids = torch.tensor([[5, 17, 3, 99, 42, 8, 61, 23, 7, 11]])
    n = ids.shape[1]
    for s in (body, tail):
        s.open_session("chunk")
        s.open_session("steps")
    hidden = body.forward("chunk", ids[:, :6], 0)  # two passes of several positions
    hidden = torch.cat([hidden, body.forward("chunk", ids[:, 6:], 6)], dim=1)
    steps = torch.cat([body.forward("steps", ids[:, i:i + 1], i) for i in range(n)], dim=1)
    assert torch.equal(hidden, steps)
    logits = tail.forward("chunk", hidden, 0)
    step_logits = [tail.forward("steps", steps[:, i:i + 1], i) for i in range(n)][-1]
    assert torch.equal(logits, step_logits)

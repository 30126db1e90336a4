"""Ragged batches in the shard runtime: a session's output in a batch is bit for bit its output alone."""

import pytest
import torch

from meshd.shard.artifact import open_artifact
from meshd.shard.kv import CacheMiss
from meshd.shard.linear import linear
from meshd.shard.recipe import EXACT, NATIVE
from meshd.shard.rows import Rows, row_invariant
from meshd.shard.runtime import Shard
from tests import tiny_models

QT = tiny_models.gguf.GGMLQuantizationType
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [1, 2, 3], [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210], [9]]
STEPS = 6


def chain(shards, jobs):
    """Run jobs [(key, x, position)] through the shards in order, batched; the last shard's outputs."""
    for s in shards:
        outs = s.forward_batch(jobs)
        for out in outs:
            assert not isinstance(out, Exception), out
        jobs = [(key, out, pos) for (key, _, pos), out in zip(jobs, outs)]
    return [x for _, x, _ in jobs]


def solo(shards, prompt, key):
    """Greedy logits of one session alone: its prefill, then STEPS decode steps."""
    for s in shards:
        s.open_session(key)
    logits = [chain(shards, [(key, torch.tensor([prompt]), 0)])[0]]
    for i in range(STEPS):
        logits.append(chain(shards, [(key, torch.tensor([[int(logits[-1].argmax())]]), len(prompt) + i)])[0])
    return logits


def batched(shards, prompts, tag):
    """The same sessions together: session k joins at step k (its prefill rows next to the others'
    decode rows), then every step carries one position of every running session."""
    keys = [(tag, k) for k in range(len(prompts))]
    for s in shards:
        for key in keys:
            s.open_session(key)
    logits: dict = {key: [] for key in keys}
    for step in range(STEPS + len(prompts)):
        jobs = []
        for k, key in enumerate(keys):
            done = len(logits[key])
            if k > step or done > STEPS:
                continue
            if done == 0:
                jobs.append((key, torch.tensor([prompts[k]]), 0))
            else:
                jobs.append((key, torch.tensor([[int(logits[key][-1].argmax())]]), len(prompts[k]) + done - 1))
        for (key, _, _), out in zip(jobs, chain(shards, jobs)):
            logits[key].append(out)
    return [logits[key] for key in keys]


def artifact_for(kind, tmp_path):
    if kind == "llama-q4_0":
        model = tiny_models.tiny_llama(seed=3)
        tiny_models.quantize_linear_weights(model, QT.Q4_0)
        return open_artifact(tiny_models.write_llama_gguf(model, tmp_path / "m.gguf", qtype=QT.Q4_0))
    if kind == "qwen3-moe-q8_0":
        model = tiny_models.tiny_qwen3(moe=True, seed=3)
        return open_artifact(tiny_models.write_qwen3_gguf(model, tmp_path / "m.gguf", qtype=QT.Q8_0))
    if kind == "gpt2":
        tiny_models.tiny_gpt2(seed=3).save_pretrained(tmp_path / "hf")
    else:
        tiny_models.tiny_llama(seed=3).save_pretrained(tmp_path / "hf")
    return open_artifact(tmp_path / "hf")


@pytest.mark.parametrize("kind,recipe", [("llama-q4_0", NATIVE), ("llama-q4_0", EXACT), ("llama-hf", EXACT),
                                         ("qwen3-moe-q8_0", NATIVE), ("gpt2", EXACT)],
                         ids=["llama-native", "llama-exact-gguf", "llama-exact-hf", "qwen3-moe-native", "gpt2-exact"])
def test_a_session_in_a_batch_gets_its_solo_bits(tmp_path, kind, recipe):
    art = artifact_for(kind, tmp_path)
    cut = art.config.n_layers // 2
    shards = [Shard(art, 0, cut, recipe), Shard(art, cut, art.config.n_layers, recipe)]
    alone = [solo(shards, p, ("solo", k)) for k, p in enumerate(PROMPTS)]
    together = batched(shards, PROMPTS, "batch")
    for k in range(len(PROMPTS)):
        assert len(together[k]) == len(alone[k]) == STEPS + 1
        for step, (a, b) in enumerate(zip(alone[k], together[k])):
            assert torch.equal(a, b), (k, step, float((a - b).abs().max()))


def test_native_quantized_layers_really_stack_rows(tmp_path):
    """The point of batching: the int4 matmuls of the native lane take all sessions' rows at once."""
    art = artifact_for("llama-q4_0", tmp_path)
    native, exact = Shard(art, 0, 2, NATIVE), Shard(art, 0, 2, EXACT)
    assert row_invariant(native.layers[0].wqkv) and row_invariant(native.layers[0].w_down)
    assert not row_invariant(exact.layers[0].wqkv)
    w = native.layers[0].w_gate_up
    x = torch.randn(1, 9, art.config.hidden, dtype=torch.bfloat16)
    together = linear(x, w)
    assert all(torch.equal(together[:, i:i + 1], linear(x[:, i:i + 1], w)) for i in range(9))


def test_a_bad_job_fails_alone(tmp_path):
    art = artifact_for("llama-q4_0", tmp_path)
    s = Shard(art, 0, art.config.n_layers, NATIVE)
    for key in ("a", "b"):
        s.open_session(key)
    good = s.forward_batch([("a", torch.tensor([[1, 2, 3]]), 0)])[0]
    s.release("a")
    s.open_session("a")
    outs = s.forward_batch([("nobody", torch.tensor([[1]]), 0), ("a", torch.tensor([[1, 2, 3]]), 0),
                            ("b", torch.tensor([[10 ** 6]]), 0), ("b", torch.tensor([[1]]), 0)])
    assert isinstance(outs[0], CacheMiss)
    assert torch.equal(outs[1], good)
    assert isinstance(outs[2], ValueError) and "token ids" in str(outs[2])
    assert isinstance(outs[3], ValueError) and "twice" in str(outs[3])
    assert s.session_length("b") == 0  # a refused job leaves its session as it was


def test_rows_split_and_last_rows():
    rows = Rows.stack([(None, 0, 3), (None, 5, 1), (None, 9, 2)])
    x = torch.arange(6).view(1, 6, 1)
    assert [p.flatten().tolist() for p in rows.split(x)] == [[0, 1, 2], [3], [4, 5]]
    assert rows.last_rows(x).flatten().tolist() == [2, 3, 5]
    assert [(s.position, s.row) for s in rows.segments] == [(0, 0), (5, 3), (9, 4)]
    assert rows.each(lambda seg, part: part * seg.position, x).flatten().tolist() == [0, 0, 0, 15, 36, 45]

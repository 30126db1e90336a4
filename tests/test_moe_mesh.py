"""Three daemons serve a tiny random Qwen3-MoE: what they generate equals the whole transformers model."""

import pytest
import torch

from meshd.cli.localmesh import Mesh, ctl
from meshd.shard.artifact import open_artifact
from meshd.shard.tokenizer import TextStream, load_tokenizer
from tests import tiny_models

pytestmark = pytest.mark.slow
TOKENS = 24


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """The tiny model with SmolLM2's tokenizer beside it (so its vocabulary is SmolLM2's)."""
    tok = load_tokenizer(open_artifact("smollm2"))
    model = tiny_models.tiny_qwen3(moe=True, seed=11, vocab=len(tok))
    d = tmp_path_factory.mktemp("moe") / "qwen3-moe"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return model, tok, d


def test_three_daemons_serving_a_qwen3_moe_generate_the_reference(moe_dir):
    model, tok, path = moe_dir
    prompt = "The capital of France is"
    seq = tok(prompt).input_ids
    stream, expected = TextStream(tok), ""
    with torch.inference_mode():
        for _ in range(TOKENS):
            token = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(token)
            expected += stream.push(token)
    assert expected.strip()
    m = Mesh()
    try:
        entry = m.start_chain([(0, 2), (2, 4), (4, 6)], extra=["--model", str(path)])[0]
        assert entry.status()["recipe"] == "exact"  # a float model: auto picks the parity lane
        out = ctl(entry.socket, ["generate", "--max-tokens", str(TOKENS), "--ignore-eos", prompt])
        assert out.returncode == 0, out.stderr
        assert out.stdout == expected + "\n"
    finally:
        m.close()

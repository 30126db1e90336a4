"""A third party's use of the layer-worker surface (docs/layer-worker.md): only `meshd.shard`'s
documented names, no mesh. Split a model in two, hand hidden states across, match the whole model."""

import pytest
import torch

import meshd.shard as lw
from tests import tiny_models

PROMPT = [5, 17, 99, 3, 250, 42, 7, 7, 128, 64]


def test_a_model_split_in_two_matches_the_whole(tmp_path):
    model = tiny_models.tiny_qwen3(moe=True, seed=9)
    model.save_pretrained(tmp_path / "m")
    artifact = lw.open_artifact(tmp_path / "m")
    n = artifact.config.n_layers
    front, back = lw.Shard(artifact, 0, 3, lw.EXACT), lw.Shard(artifact, 3, n, lw.EXACT)
    assert front.owns == lw.Owns(embedding=True, final_norm=False, lm_head=False)
    assert back.owns == lw.Owns(embedding=False, final_norm=True, lm_head=True)
    assert lw.weight_bytes(artifact, lw.EXACT, 0, 3) == front.weight_bytes

    front.open_session("s")
    back.open_session("s")
    ids, position, tokens = torch.tensor([PROMPT]), 0, []
    for _ in range(16):
        hidden = front.forward("s", ids, position)  # token ids in, hidden states [1, n, hidden] out
        logits = back.forward("s", hidden, position)  # hidden states in, last position's logits out
        tokens.append(int(logits.argmax()))
        position += ids.shape[1]
        ids = torch.tensor([[tokens[-1]]])
    assert front.session_length("s") == back.session_length("s") == position

    expected, seq = [], list(PROMPT)
    with torch.inference_mode():
        for _ in range(16):
            expected.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            seq.append(expected[-1])
    assert tokens == expected

    # roll back the last 4 positions on both halves and run them again: the same token comes out
    front.trim("s", position - 4)
    back.trim("s", position - 4)
    again = back.forward("s", front.forward("s", torch.tensor([tokens[-5:-1]]), position - 4), position - 4)
    assert int(again.argmax()) == tokens[-1]

    assert front.release("s") and back.release("s")
    with pytest.raises(lw.CacheMiss):  # a released session does not run
        front.forward("s", torch.tensor([[1]]), 0)

"""One daemon and three serve a tiny random Phi-3 with longrope (pretraining context 32 of 256): a prompt already past
the switch and a generation that grows past it (its entry opens the route again on the long table and computes
the sequence anew) give the text of transformers' `generate`, and the generation's stats say where it switched."""

import json

import pytest
import torch

from meshd.shard.artifact import open_artifact
from meshd.shard.tokenizer import TextStream, load_tokenizer
from meshd.cli.localmesh import Mesh, ctl
from tests import tiny_models

pytestmark = pytest.mark.slow
ORIGINAL = 32
CASES = [("The capital of France is a city that", 30),  # crosses the switch while generating
         ("Once upon a time, in a land far away, there lived a king who had three daughters. The youngest of them"
          " was the most beautiful, and she loved to play", 8)]  # a prompt already past it


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    """The tiny model with SmolLM2's tokenizer beside it (so its vocabulary is SmolLM2's)."""
    tok = load_tokenizer(open_artifact("smollm2"))
    model = tiny_models.tiny_phi3(seed=31, original=ORIGINAL, vocab=len(tok))
    d = tmp_path_factory.mktemp("phi3") / "phi3"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return model, tok, d


def reference(model, tok, prompt: str, n: int) -> tuple[str, int]:
    """transformers' greedy text after the prompt, and the prompt's length in tokens."""
    ids = tok(prompt).input_ids
    with torch.inference_mode():
        tokens = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    assert len(tokens) == n, "the reference stopped at its end of sequence"
    stream = TextStream(tok)
    return "".join(stream.push(t) for t in tokens), len(ids)


@pytest.mark.parametrize("ranges", [[(0, 6)], [(0, 2), (2, 4), (4, 6)]], ids=["one", "three"])
def test_daemons_past_the_switch_generate_transformers_text(phi3_dir, ranges):
    """One daemon runs its decode steps back to back up to the switch (`Generation.plain_steps_left`)."""
    model, tok, path = phi3_dir
    expected = [reference(model, tok, prompt, n) for prompt, n in CASES]
    assert expected[0][1] + CASES[0][1] > ORIGINAL + 1 > expected[0][1] and expected[1][1] > ORIGINAL
    m = Mesh()
    try:
        entry = m.start_chain(ranges, extra=["--model", str(path)])[0]
        for (prompt, n), (text, prompt_tokens) in zip(CASES, expected):
            out = ctl(entry.socket, ["generate", "--max-tokens", str(n), "--ignore-eos", "--stats", prompt])
            assert out.returncode == 0, out.stderr
            assert out.stdout == text + "\n", prompt
            stats = json.loads(out.stderr.strip().splitlines()[-1])
            switched = 0 if prompt_tokens > ORIGINAL else ORIGINAL + 1 - prompt_tokens
            assert (stats["rope_table"], stats["rope_switched_at"], stats["reroutes"]) == ("long", switched, 0)
            assert len(stats["route"]) == len(ranges)
        if len(ranges) == 1:  # its steps ran back to back, up to the switch and after it
            assert entry.status()["batches"]["run_passes"] >= sum(n for _, n in CASES) - 2 * len(CASES)
    finally:
        m.close()

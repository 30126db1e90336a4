"""The spread a checked generation's comparison must allow between replicas of one recipe on one kind
of CPU: none. Two separately loaded shards of SmolLM2's layers 10:20 (the bundled Q4_1 file), in the
`native` and the `exact` lane, give the same bits for the same session, also when one of them runs it
stacked in a pass with another session; so checked routes compare tokens exactly, and a single
flipped bit is a fault, not rounding. (Across lanes the bits differ: replicas of different recipes
never share a route.)"""

import pytest
import torch

from meshd.shard.artifact import open_artifact
from meshd.shard.recipe import get_recipe
from meshd.shard.runtime import Shard


@pytest.fixture(scope="module")
def artifact():
    return open_artifact("smollm2")


@pytest.mark.parametrize("lane", ["native", "exact"])
def test_two_replicas_of_a_range_agree_bit_for_bit(artifact, lane):
    recipe = get_recipe(lane, artifact)
    a, b = Shard(artifact, 10, 20, recipe), Shard(artifact, 10, 20, recipe)
    hidden = artifact.config.hidden
    gen = torch.Generator().manual_seed(22)
    prompt = torch.randn(1, 7, hidden, generator=gen)
    a.open_session("s", 64)
    b.open_session("s", 64)
    b.open_session("other", 64)
    outs_a = [a.forward("s", prompt, 0)]
    outs_b = [b.forward_batch([("s", prompt, 0), ("other", torch.randn(1, 3, hidden, generator=gen), 0)])[0]]
    for step in range(6):  # decode steps, b's beside another session's
        x = torch.randn(1, 1, hidden, generator=gen)
        outs_a.append(a.decode_step("s", x, 7 + step))
        outs_b.append(b.forward_batch([("s", x, 7 + step), ("other", x, 3 + step)])[0])
    for x, y in zip(outs_a, outs_b):
        assert torch.equal(x, y)
        assert x.abs().max() > 0

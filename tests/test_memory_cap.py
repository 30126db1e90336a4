"""A model no capped daemon could hold alone is served by three: a synthetic ~1 B Llama (Q4_0 GGUF).

Each daemon runs in its own memory cgroup with a hard limit that a daemon loading the whole model
would exceed; the three generate what one uncapped process generates, and a daemon asked for the
whole model under the same cap refuses up front (exit 2, a message) instead of being killed.
"""

import os
import subprocess
import sys

import pytest
import torch

from meshd.cli.localmesh import Mesh, ctl
from meshd.shard import footprint
from meshd.shard.artifact import open_artifact
from meshd.shard.recipe import NATIVE
from meshd.shard.runtime import Shard
from meshd.shard.tokenizer import load_tokenizer
from meshd.testing.cgroup import CgroupUnavailable, open_memory_cgroup
from meshd.testing.synthetic import write_synthetic

pytestmark = pytest.mark.slow
PROCESS_MB = 380  # a head daemon's own cost: Python, torch, libp2p, transformers' tokenizer (measured ~340)
TOKENS = 8
RANGES = [(0, 5), (5, 11), (11, 16)]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return open_artifact(write_synthetic(tmp_path_factory.mktemp("syn") / "synthetic-1b.q4_0.gguf"))


def one_process_text(art, prompt: str) -> str:
    tok = load_tokenizer(art)
    shard = Shard(art, 0, art.config.n_layers, NATIVE)
    ids = tok(prompt).input_ids
    shard.open_session("s")
    out = [int(shard.forward("s", torch.tensor([ids]), 0).argmax())]
    for p in range(TOKENS - 1):
        out.append(int(shard.forward("s", torch.tensor([[out[-1]]]), len(ids) + p).argmax()))
    return tok.decode(out, skip_special_tokens=True)


def test_three_capped_daemons_serve_what_none_could_hold_alone(synthetic):
    art = synthetic
    whole = footprint.weight_bytes(art, NATIVE, 0, art.config.n_layers)
    thirds = [footprint.weight_bytes(art, NATIVE, a, b) for a, b in RANGES]
    assert whole > 1.0e9 * 0.5625 and art.config.n_layers == 16  # ~1.1 B parameters at 4.5 bits
    cap = int(PROCESS_MB * 1e6 + max(thirds) + footprint.staging_bytes(art))
    assert PROCESS_MB * 1e6 + whole > cap  # a whole-model daemon cannot fit under the cap
    prompt = "The capital of France is"
    expected = one_process_text(art, prompt)
    m = Mesh()
    try:
        with open_memory_cgroup(cap) as g0, open_memory_cgroup(cap) as g1, open_memory_cgroup(cap) as g2, \
                open_memory_cgroup(cap) as g3:
            boot = None
            daemons = []
            for (a, b), g in zip(RANGES, (g0, g1, g2)):
                args = ["--model", str(art.path), "--layers", f"{a}:{b}", *(["--bootstrap", boot] if boot else [])]
                d = m.start(f"d{a}", args, preexec_fn=g.enter)
                daemons.append(d)
                if boot is None:
                    boot = d.wait_serving()["addrs"][0]
            for d in daemons:
                d.wait_for(lambda s: s["state"] == "serving" and s["complete"], what="complete coverage")
            out = ctl(daemons[0].socket, ["generate", "--max-tokens", str(TOKENS), "--ignore-eos", prompt])
            assert out.returncode == 0, out.stderr
            assert out.stdout == expected + "\n"
            for d, g, w in zip(daemons, (g0, g1, g2), thirds):
                assert d.proc.poll() is None and g.oom_kills() == 0
                peak = g.peak_bytes()
                assert peak is None or peak <= cap
                print(f"{d.name}: weights {w / 1e6:.0f} MB, cgroup peak {(peak or 0) / 1e6:.0f} MB,"
                      f" cap {cap / 1e6:.0f} MB, whole model {whole / 1e6:.0f} MB")
            # the whole model under the same cap: refused before loading, with the reason
            greedy = m.start("whole", ["--model", str(art.path), "--layers", "0:16"], preexec_fn=g3.enter)
            assert greedy.proc.wait(120) == 2, greedy.tail()
            assert "memory limit" in greedy.tail() and g3.oom_kills() == 0
            m.close()  # every process out of the groups before they are removed
    except CgroupUnavailable as exc:
        pytest.skip(f"no memory cgroup to cap daemons with: {exc}")
    finally:
        m.close()


def test_a_fixed_range_beyond_memory_is_refused_up_front(synthetic):
    art = synthetic
    need = footprint.weight_bytes(art, NATIVE, 0, 16)
    out = subprocess.run([sys.executable, "-m", "meshd.cli", "join", "--model", str(art.path), "--layers", "0:16",
                          "--memory", str(need // 2), "--state-dir", "/tmp/meshd-refuse-state",
                          "--socket", "/tmp/meshd-refuse.sock", "--listen", "/ip4/127.0.0.1/tcp/0"],
                         capture_output=True, text=True, timeout=120, env={**os.environ})
    assert out.returncode == 2, out.stderr
    assert "more than --memory allows" in out.stderr and "layers 0:16" in out.stderr

"""One daemon holding the whole model (the common case on one box): its decode steps run back to back
on the compute thread (`ShardService.decode_run`), and the text stays that of one process."""

import json
import signal
import subprocess
import sys
import time
from functools import partial

import pytest
import trio

from meshd.cli.localmesh import Mesh, ctl

pytestmark = pytest.mark.slow
PROMPTS = ["Tell me a story about a dragon", "List three fruits and their colours."]
N = 96


def local(prompt: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "meshd.cli", "local", "--max-tokens", str(N), *args, prompt],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def daemon():
    m = Mesh()
    try:
        d = m.start("d", ["--layers", "0:30"])
        d.wait_serving()
        yield d
    finally:
        m.close()


def generate(d, prompt: str, *args: str, tokens: int = N) -> tuple[str, dict]:
    r = ctl(d.socket, ["generate", "--max-tokens", str(tokens), "--stats", *args, prompt])
    assert r.returncode == 0, r.stderr
    return r.stdout, json.loads(r.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("sampling", [(), ("--temperature", "0.8", "--seed", "7")], ids=["greedy", "seeded"])
def test_a_daemon_holding_the_model_gives_the_text_of_one_process(daemon, sampling):
    before = daemon.status()["batches"]
    extra = ("--no-speculate",) if sampling else ()  # a sampled generation's drafts would change its text
    tokens = 0
    for prompt in PROMPTS:
        text, stats = generate(daemon, prompt, *sampling, *extra)
        assert text == local(prompt, *sampling) and stats["tokens"] > 1
        tokens += stats["tokens"]
    # every step of a run counts as a pass: the prefill's, and one a token after the first; all the
    # decode steps but each generation's first ran back to back
    after = daemon.status()["batches"]
    assert after["passes"] - before["passes"] >= tokens
    assert after["run_passes"] - before["run_passes"] >= tokens - 2 * len(PROMPTS)


def test_concurrent_generations_on_one_daemon_equal_their_solo_text(daemon):
    """A run gives way when another session's work comes; both go on, each with its solo text."""
    solo = [generate(daemon, p, "--ignore-eos", tokens=300)[0] for p in PROMPTS]
    together, most = [None] * len(PROMPTS), 0

    async def main():
        nonlocal most

        async def one(i):
            together[i] = (await trio.to_thread.run_sync(partial(generate, daemon, PROMPTS[i], "--ignore-eos",
                                                                 tokens=300)))[0]

        async def watch():
            nonlocal most
            while True:
                most = max(most, (await trio.to_thread.run_sync(daemon.status))["sessions"])
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with trio.open_nursery() as both:
                for i in range(len(PROMPTS)):
                    both.start_soon(one, i)
                    await trio.sleep(0.3)  # the second comes while the first runs
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert together == solo and most == 2

def test_a_client_that_leaves_mid_run_leaves_no_kv(daemon):
    """The run ends with its client (not at its 2000 tokens), and the daemon serves on."""
    before = daemon.status()["batches"]["run_passes"]
    proc = subprocess.Popen([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(daemon.socket), "generate",
                             "--max-tokens", "2000", "--ignore-eos", "Tell me a long story."],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(1)  # its run has begun
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = daemon.status()
        if st["sessions"] == 0 and st["kv_bytes"] == 0:
            break
        time.sleep(0.2)
    assert (st["sessions"], st["kv_bytes"], st["state"]) == (0, 0, "serving")
    assert st["batches"]["run_passes"] - before < 1000
    assert generate(daemon, PROMPTS[0])[0] == local(PROMPTS[0])  # and serves on as before

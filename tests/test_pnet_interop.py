"""meshd's private mesh against js-libp2p's (`@libp2p/pnet`, versions in tests/interop/package.json):
each reads the other's key files, each dials the other and pings it through the private network,
and each refuses the other with a different key. Needs node (20 or newer) and those packages:

    cp tests/interop/package.json DIR/ && npm install --prefix DIR
    MESHD_JS_LIBP2P=DIR pytest tests/test_pnet_interop.py
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.host.ping import ID as PING

from meshd.p2p.host import connect, full_addrs, open_host
from meshd.p2p.pnet import Pnet
from meshd.p2p.swarmkey import read_swarm_key, write_new_swarm_key

JS_DIR = os.environ.get("MESHD_JS_LIBP2P", "")
pytestmark = pytest.mark.skipif(not (JS_DIR and (Path(JS_DIR) / "node_modules" / "@libp2p" / "pnet").is_dir()
                                     and shutil.which("node")),
                                reason="set MESHD_JS_LIBP2P to a folder with tests/interop/package.json installed")
HERE = Path(__file__).parent / "interop"


@pytest.fixture
def js(tmp_path):
    """`js(*args)`: the command line of the js peer, run from the folder that holds its packages."""
    for f in ("pnet_peer.mjs", "polyfill.mjs", "genkey.mjs"):
        shutil.copy(HERE / f, Path(JS_DIR) / f)
    return lambda *args: ["node", "--import", str(Path(JS_DIR) / "polyfill.mjs"), str(Path(JS_DIR) / args[0]), *args[1:]]


async def _js_dials(js, addr: str, keyfile) -> dict:
    out = await trio.run_process(js("pnet_peer.mjs", "dial", addr, str(keyfile)), capture_stdout=True,
                                 capture_stderr=True)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


async def _meshd_dials_js(js, host, keyfile):
    """(connected, ping echoed) for meshd dialling a listening js peer."""
    proc = await trio.lowlevel.open_process(js("pnet_peer.mjs", "listen", str(keyfile)), stdout=subprocess.PIPE)
    try:
        buf = b""
        with trio.fail_after(30):
            while b"\n" not in buf:
                buf += await proc.stdout.receive_some(4096)
        addr = json.loads(buf.split(b"\n")[0])["addrs"][0]
        try:
            pid = await connect(host, addr, timeout=10)
        except BaseException:
            return False, False
        stream = await host.new_stream(pid, [PING])
        payload = os.urandom(32)
        await stream.write(payload)
        with trio.fail_after(10):
            echo = await stream.read(32)
        return True, echo == payload
    finally:
        proc.kill()


async def test_meshd_and_js_libp2p_share_a_private_mesh_and_refuse_other_keys(js, tmp_path):
    ours = write_new_swarm_key(tmp_path / "meshd.key")
    subprocess.run(js("genkey.mjs", str(tmp_path / "js.key")), check=True, timeout=60)
    theirs = read_swarm_key(tmp_path / "js.key")  # js-libp2p's key file, read here
    assert theirs.psk != ours.psk
    pnet = Pnet(ours)
    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], pnet) as host:
        addr = full_addrs(host)[0]
        got = await _js_dials(js, addr, ours.path)  # our key file, read by js-libp2p
        assert got["ok"] and got["peers"] == [host.get_id().to_base58()], got
        assert pnet.refusals.count == 0
        got = await _js_dials(js, addr, theirs.path)
        assert not got["ok"] and pnet.refusals.count >= 1
        assert await _meshd_dials_js(js, host, ours.path) == (True, True)
        assert await _meshd_dials_js(js, host, theirs.path) == (False, False)

"""Daemon settings: flags > MESHD_* environment > TOML file > defaults; layer ranges; memory budgets."""

import pytest

from meshd.dht.placement import largest_layer_bytes
from meshd.core.settings import Settings, default_socket, load_settings
from meshd.node.wiring import configure, relay_limits
from meshd.shard import blocks
from meshd.shard.artifact import open_artifact
from meshd.shard.recipe import get_recipe


def test_flags_beat_environment_beat_file(tmp_path):
    cfg = tmp_path / "meshd.toml"
    cfg.write_text('model = "file-model"\nnum_layers = 7\nlayers = "auto"\nbootstrap = ["/ip4/1.2.3.4/tcp/1/p2p/x"]\n')
    env = {"MESHD_NUM_LAYERS": "9", "MESHD_LISTEN": "/ip4/127.0.0.1/tcp/5,/ip4/127.0.0.1/tcp/6"}
    s = load_settings({"num_layers": None, "layers": "3:5", "listen": None}, str(cfg), environ=env)
    assert s.model == "file-model" and s.num_layers == 9 and s.layers == "3:5"
    assert s.listen == ["/ip4/127.0.0.1/tcp/5", "/ip4/127.0.0.1/tcp/6"]
    assert s.bootstrap == ["/ip4/1.2.3.4/tcp/1/p2p/x"]
    s = load_settings({"num_layers": 4}, str(cfg), environ=env)
    assert s.num_layers == 4


def test_unknown_setting_and_bad_ranges_are_refused(tmp_path):
    cfg = tmp_path / "meshd.toml"
    cfg.write_text("layrs = '0:3'\n")
    with pytest.raises(ValueError, match="unknown settings"):
        load_settings({}, str(cfg), environ={})
    for bad in ("5", "3:2", "0:31", "a:b"):
        with pytest.raises(ValueError):
            Settings(layers=bad).parse_layers(30)
    assert Settings(layers="auto").parse_layers(30) is None and Settings(layers="0:30").parse_layers(30) == (0, 30)


def test_socket_defaults_follow_systemd_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/meshd")
    assert str(default_socket(tmp_path)) == "/run/meshd/meshd.sock"
    monkeypatch.delenv("RUNTIME_DIRECTORY")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert str(default_socket(tmp_path)) == "/run/user/1000/meshd/meshd.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket(tmp_path) == tmp_path / "meshd.sock"


def test_memory_budget_bounds_the_auto_range():
    artifact, recipe = open_artifact("smollm2"), get_recipe("exact")
    params = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576  # q, o, k, v, gate/up/down, norms
    assert largest_layer_bytes(artifact, recipe) == params * 4  # float32 in the exact recipe
    matrices, rows, norms = params - 2 * 576, 576 + 192 + 192 + 576 + 2 * 1536 + 576, 2 * 576
    recipe = get_recipe("compact")
    assert largest_layer_bytes(artifact, recipe) == matrices + 2 * rows + 4 * norms  # int8, a bfloat16 scale per row
    recipe = get_recipe("auto", artifact)
    assert recipe.name == "native"  # the default for a quantized GGUF
    block = sum(artifact.stored_bytes(n) for n in artifact.tensor_names() if n.startswith("blk.15."))
    assert largest_layer_bytes(artifact, recipe) == block == matrices * 5 // 8 + 4 * norms  # Q4_1 repacks at its own 5 bits
    per = params * 4
    assert Settings().layers_wanted(30, per) == 30
    assert Settings(num_layers=10).layers_wanted(30, per) == 10
    assert Settings(num_layers=10, memory=7 * per + 1).layers_wanted(30, per) == 7
    assert Settings(memory=1).layers_wanted(30, per) == 1
    assert Settings(num_layers=99).layers_wanted(30, per) == 30


def test_threads_and_http_settings_come_from_flags_environment_and_file(tmp_path):
    cfg = tmp_path / "m.toml"
    cfg.write_text('threads = 3\nhttp = "127.0.0.1:9000"\nhttp_token_file = "%s"\n' % (tmp_path / "tok"))
    (tmp_path / "tok").write_text("abc\n")
    s = load_settings({}, str(cfg), environ={})
    assert (s.threads, s.http, s.bearer_token()) == (3, "127.0.0.1:9000", "abc")
    s = load_settings({"threads": 1, "http_token": "xyz"}, str(cfg), environ={"MESHD_THREADS": "2"})
    assert (s.threads, s.bearer_token()) == (1, "xyz")
    assert load_settings({}, None, environ={"MESHD_THREADS": "2"}).threads == 2
    assert load_settings({}, None, environ={}).http == ""  # the HTTP API is off unless asked


def test_the_example_config_parses_with_every_commented_setting_switched_on(tmp_path):
    import re
    from pathlib import Path

    text = (Path(__file__).parent.parent / "systemd" / "meshd.toml.example").read_text()
    on = re.sub(r"^# ?([a-z_]+ *=)", r"\1", text, flags=re.M)
    assert on != text
    cfg = tmp_path / "meshd.toml"
    cfg.write_text(on)
    s = load_settings({}, str(cfg), environ={})
    assert s.relay == "auto" and s.relays == 2 and s.hole_punch == 1 and relay_limits(s).circuit_bytes == 1024 << 20


def test_speculation_settings_from_flag_environment_and_file(tmp_path):
    assert load_settings({}, environ={}).speculate_on  # the default: auto, at most 8 drafts
    off = load_settings({}, environ={"MESHD_SPECULATE": "off"})
    assert off.speculate == "off" and not off.speculate_on
    cfg = tmp_path / "m.toml"
    cfg.write_text('draft_max = 3\nspeculate = "off"\n')
    s = load_settings({"speculate": "auto"}, str(cfg), environ={})
    assert s.speculate_on and s.draft_max == 3
    assert not load_settings({"draft_max": 0}, environ={}).speculate_on  # no drafts: plain decoding
    assert load_settings({}, environ={}).draft == ""  # prompt lookup unless a draft model is named
    assert load_settings({}, environ={"MESHD_DRAFT": "small.gguf"}).draft == "small.gguf"
    assert load_settings({"draft": "smollm2"}, environ={"MESHD_DRAFT": "small.gguf"}).draft == "smollm2"
    with pytest.raises(ValueError, match="--speculate"):
        load_settings({}, environ={"MESHD_SPECULATE": "sometimes"}).speculate_on
    with pytest.raises(ValueError, match="--draft-max"):
        load_settings({"draft_max": -2}, environ={}).speculate_on


@pytest.mark.skipif(blocks.KERNEL is None or blocks.isa() == "portable", reason="the kernel has one path here")
def test_kernel_isa_caps_the_kernel_and_an_unknown_one_is_refused():
    best = blocks.isa()
    try:
        configure(Settings(kernel_isa="portable"))
        assert blocks.isa() == "portable"
        configure(Settings(kernel_isa="avx512"))  # at most what the CPU has
        assert blocks.isa() == best
        with pytest.raises(ValueError, match="unknown instruction set"):
            configure(Settings(kernel_isa="avx3"))
    finally:
        blocks.limit_isa(best)

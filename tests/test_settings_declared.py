"""Each setting is declared once: its flag, MESHD_* variable, TOML key, default and help all come from
its `Settings` field, and `meshd join` offers exactly the declared flags."""

import argparse

from meshd.cli.main import LOCAL_SETTINGS, build_parser
from meshd.core import settings as st
from meshd.core.settings import DECLARED, Settings, add_flags, default, load_settings


def subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def options(parser: argparse.ArgumentParser) -> dict:
    return {a.option_strings[-1]: a for a in parser._actions if a.option_strings and a.dest != "help"}


def test_join_offers_exactly_the_declared_flags_with_their_help():
    join = options(subparser("join"))
    flagged = {st.flag_name(n) for n, f in DECLARED.items() if f.metadata["flag"]}
    assert set(join) == flagged | {"--config"}
    for name in DECLARED:
        if st.flag_name(name) in join:
            action = join[st.flag_name(name)]
            assert action.dest == name and action.help == st.help_text(name) and action.default is None
            assert action.choices == DECLARED[name].metadata["choices"]
    assert {"--record-ttl", "--forwarding", "--cache-dir"}.isdisjoint(join)  # set by MESHD_* or the file only
    assert join["--bootstrap"].__class__.__name__ == "_AppendAction" and join["--require-swarm-key"].const == 1
    assert join["--max-sessions"].type is int and join["--busy-wait"].type is float and join["--model"].type is None
    assert set(options(subparser("local"))) >= {st.flag_name(n) for n in LOCAL_SETTINGS}


def test_help_writes_in_the_declared_default():
    assert st.help_text("max_sessions").endswith("(default 64)")
    assert st.help_text("kv_budget") == "bytes of KV cache for all sessions (default 1 GiB)"
    assert "(default 0.25; 0: none)" in st.help_text("verify_rate")
    assert "(default 30; a second SIGTERM" in st.help_text("drain_timeout")
    most = default("draft_max")
    assert st.help_text("draft_max").startswith(f"as an entry: draft tokens a step carries at most (default {most};")


def test_every_setting_has_help_and_one_name_in_each_place(tmp_path):
    for name, f in DECLARED.items():
        assert f.metadata["help"], name
    assert (st.flag_name("num_layers"), st.env_name("num_layers")) == ("--num-layers", "MESHD_NUM_LAYERS")
    cfg = tmp_path / "m.toml"
    cfg.write_text("record_ttl = 4\n")
    assert load_settings({}, str(cfg), environ={}).record_ttl == 4.0
    assert load_settings({}, str(cfg), environ={"MESHD_RECORD_TTL": "5"}).record_ttl == 5.0
    assert default("listen") == Settings().listen and default("listen") is not default("listen")


def test_flags_parse_into_settings_with_their_precedence():
    args = build_parser().parse_args(["join", "--bootstrap", "/a", "--bootstrap", "/b", "--max-sessions", "3",
                                      "--require-swarm-key", "--hole-punch", "0"])
    s = load_settings(st.flags_given(args), "/dev/null", environ={"MESHD_MAX_SESSIONS": "9", "MESHD_RELAYS": "5"})
    assert (s.bootstrap, s.max_sessions, s.require_swarm_key, s.hole_punch, s.relays) == (["/a", "/b"], 3, 1, 0, 5)
    assert load_settings(st.flags_given(build_parser().parse_args(["join"])), "/dev/null", environ={}) == Settings()


def test_declared_choices_are_those_of_the_parts_below():
    from meshd import wire
    from meshd.shard import blocks
    from meshd.shard.recipe import CHOICES

    assert sorted(DECLARED["recipe"].metadata["choices"]) == sorted(CHOICES)
    assert DECLARED["kernel_isa"].metadata["choices"] == list(blocks.ISAS)
    assert DECLARED["kernel_layout"].metadata["choices"] == list(blocks.LAYOUTS)
    assert DECLARED["wire_encoding"].metadata["choices"] == list(wire.ENCODINGS)
    assert default("wire_encoding") == wire.DEFAULT_ENCODING and default("chunk_tokens") == wire.DEFAULT_CHUNK_TOKENS


def test_add_flags_takes_a_subset():
    parser = argparse.ArgumentParser()
    add_flags(parser, ["chunk_tokens", "listen"])
    assert set(options(parser)) == {"--chunk-tokens", "--listen"}
    assert parser.parse_args(["--chunk-tokens", "16"]).chunk_tokens == 16

"""meshctl starts at once: it imports neither trio, libp2p nor torch; and its lines read off status dicts."""

import subprocess
import sys

from meshd.cli.render import (draft_line, handover_line, load_line, prefix_line, prompt_line, render_status,
                              sessions_line)


def test_meshctl_imports_no_event_loop_no_libp2p_no_torch():
    code = ("import sys, meshd.cli.ctl; heavy = [m for m in ('trio', 'libp2p', 'torch', 'transformers') if m in sys.modules];"
            " print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_meshctl_without_a_daemon_exits_3_quickly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(tmp_path / "none.sock"), "status"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 3 and "no daemon socket" in out.stderr


def test_the_load_line_shows_an_entrys_generations_per_microbatch():
    st = {"queue": 3, "batches": {"mean_batch": 2.5, "largest_batch": 4, "passes": 10}, "busy_refusals": 1,
          "max_sessions": 64, "microbatches": [4, 3]}
    line = load_line(st)
    assert line.startswith("load      3 frames queued, batches of 2.5 on average (largest 4, 10 passes)")
    assert line.endswith("1 refused busy, limit 64 sessions, generations per microbatch 4/3")
    assert load_line({**st, "microbatches": []}).endswith("limit 64 sessions")


def test_the_drafts_line_shows_the_setting_and_how_many_drafts_stood():
    line = draft_line({"mode": "auto", "draft_max": 8, "drafted": 40, "accepted": 30})
    assert line == "drafts    speculate auto (at most 8 a step): 40 sent, 30 accepted (75%)"
    assert draft_line({"mode": "off", "draft_max": 8, "drafted": 0, "accepted": 0}).endswith("0 sent, 0 accepted")
    assert draft_line(None) == "drafts    unknown"
    with_model = {"mode": "auto", "draft_max": 4, "drafted": 8, "accepted": 6,
                  "source": {"model": "small.gguf", "recipe": "native", "layers": 30}}
    assert draft_line(with_model) == ("drafts    speculate auto (at most 4 a step, draft model small.gguf (native)):"
                                      " 8 sent, 6 accepted (75%)")


CACHE = {"entries": 3, "held_bytes": 12_400_000, "held_tokens": 2900, "hits": 5, "misses": 2, "tokens_reused": 11200,
         "evictions": 0, "ttl_s": 600.0}
STATUS = {"peer_id": "12D3KooWme", "state": "serving", "model": "m.gguf", "recipe": "native", "range": [0, 10],
          "n_layers": 30, "sessions": 1, "kv_bytes": 14_000_000, "generations": 1, "addrs": [], "peers": [],
          "prefix_cache": CACHE}


def test_the_prefix_line_shows_what_is_kept_and_how_often_it_was_reused():
    assert prefix_line(STATUS) == ("prefix    3 kept (12.4 MB, 2,900 tokens); 5 hits of 7 asked, 11,200 tokens reused;"
                                   " 0 evicted; TTL 600 s")
    off = {**CACHE, "entries": 0, "held_bytes": 0, "held_tokens": 0, "hits": 1, "misses": 0, "ttl_s": 0.0}
    assert prefix_line({"prefix_cache": off}).endswith("1 hit of 1 asked, 11,200 tokens reused; 0 evicted;"
                                                        " TTL 0 s (keeping off)")
    assert prefix_line({"prefix_cache": None}) == "prefix    none (no layers held here)"
    assert prefix_line({}) == "prefix    unknown"  # an older daemon
    assert prefix_line({"prefix_cache": {"entries": 1}}) == ("prefix    1 kept (0.0 MB, 0 tokens); 0 hits of 0 asked,"
                                                             " 0 tokens reused; 0 evicted; TTL -")


def test_status_says_how_much_kv_is_kept_and_reads_an_older_daemons_status():
    lines = render_status(STATUS).splitlines()
    assert "sessions  1 open, 14.0 MB KV, 1 generating" in lines
    assert lines[lines.index("sessions  1 open, 14.0 MB KV, 1 generating") + 1].startswith(
        "prefix    3 kept (12.4 MB")
    older = {k: v for k, v in STATUS.items() if k != "prefix_cache"}
    lines = render_status(older).splitlines()
    assert "sessions  1 open, 14.0 MB KV, 1 generating" in lines and "prefix    unknown" in lines
    assert sessions_line({**STATUS, "prefix_cache": None}) == "sessions  1 open, 14.0 MB KV, 1 generating"


def test_the_prompt_line_says_how_many_prompt_tokens_were_reused():
    assert prompt_line({"prompt_tokens": 2931, "cached_tokens": 2912}) == "prompt 2,931 tokens (2,912 reused)"
    assert prompt_line({"prompt_tokens": 12, "cached_tokens": 0}) == "prompt 12 tokens"
    assert prompt_line({"prompt_tokens": 12}) == "prompt 12 tokens"  # an older entry


def test_status_shows_hand_overs_and_reads_an_older_daemons_status():
    h = {"sent": 2, "received": 1, "failed": 0, "refused": 3, "positions": 1_280, "moved": 1, "replayed": 0}
    assert handover_line(h) == ("handover  2 sent, 1 received (1,280 positions), 0 failed, 3 refused; routes moved 1,"
                                " replayed 0")
    assert "handover  unknown" in render_status(STATUS).splitlines()  # an older daemon says nothing of them
    assert handover_line(h) in render_status({**STATUS, "handovers": h}).splitlines()


def test_meshctl_says_a_retraction_and_writes_the_text_as_it_stands_again(tmp_path, capsys):
    """A checked generation whose text goes out at once takes some back: meshctl says so on stderr and writes
    the text that stands again on a new line, the rest after it, so that its last line is the answer."""
    import io
    import socket
    import threading

    from meshd.cli.ctl import stream_answer
    from meshd.wire import GenerateRequest, StreamEvent, encode

    path = tmp_path / "s.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    events = [StreamEvent(request_id=1, kind="text", text="Hello wr", stats={"tokens": 2}),
              StreamEvent(request_id=1, kind="verified", stats={"verified_through": 1}),
              StreamEvent(request_id=1, kind="retract", text="a check found generated token 1 wrong",
                          stats={"tokens": 1, "keep_chars": 5}),
              StreamEvent(request_id=1, kind="text", text=" world", stats={"tokens": 2}),
              StreamEvent(request_id=1, kind="done", stats={"tokens": 2, "retracted": 1})]

    def serve():
        conn, _ = server.accept()
        conn.recv(1 << 16)
        conn.sendall(b"".join(encode(e) for e in events))
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    out = io.StringIO()
    code, stats, text = stream_answer(path, GenerateRequest(request_id=1, prompt="x"), 10.0, out)
    server.close()
    assert code == 0 and stats["retracted"] == 1 and text == "Hello world"
    assert out.getvalue() == "Hello wr\nHello world"
    assert "a check found generated token 1 wrong" in capsys.readouterr().err


def test_status_and_the_ledger_say_how_generations_are_checked():
    from meshd.cli.render import check_lines, render_ledger

    line = check_lines({"verify_rate": 0.25, "verify_by": "prefill", "verify_window": 16, "verify_release": "checked",
                        "checked": 3, "disagreed": 1, "excluded": []})[0]
    assert "verify rate 0.25 by prefill, windows of 16, text checked: 3 checked, 1 disagreed" in line
    assert "in lockstep" in check_lines({"verify_rate": 0.25, "verify_by": "lockstep", "excluded": []})[0]
    totals = {"enabled": True, "path": "/x", "generations": {"completed": 2}, "sessions": {}, "checked": 2,
              "unchecked": 0, "peers": {}, "windows": {"agreed": 30, "disagreed": 1}}
    assert "windows     30 agreed, 1 disagreed (checked by prefill)" in render_ledger(totals)

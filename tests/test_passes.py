"""Where a pass's outputs go (meshd/hop/passes.py): pure, with made-up pieces of work."""

from meshd.hop.links import Links
from meshd.hop.passes import local_tokens, route_outputs
from meshd.hop.scheduler import Work
from meshd.wire import Forward, Phase, Token


class Home:
    def __init__(self, peer: str) -> None:
        self.peer = peer


def piece(sid: bytes, out) -> Work:
    w = Work(key=(sid, 0), rows=1, decode=True, payload=Forward(session_id=sid, epoch=0, step=1, phase=Phase.DECODE,
                                                                position=3))
    w.output = [out]
    return w


def test_tokens_for_an_entry_in_this_daemon_are_the_sessions_the_next_pass_waits_for():
    remote = Links(Home("entry-elsewhere"))
    links = {(b"a", 0): None, (b"b", 0): None, (b"c", 0): remote, (b"d", 0): None}
    done = [piece(b"a", Token(session_id=b"a", epoch=0, step=1, token_id=5)),
            piece(b"b", Token(session_id=b"b", epoch=0, step=1, token_id=6)),
            piece(b"c", Token(session_id=b"c", epoch=0, step=1, token_id=7)),  # goes to another daemon
            piece(b"d", Forward(session_id=b"d", epoch=0, step=1, phase=Phase.DECODE, position=3))]  # not a tail
    assert local_tokens(done, links.get) == [(b"a", 0), (b"b", 0)]
    hops, forwarded = route_outputs(done, links.get, pass_id=9)
    assert not hops and forwarded == 0
    # the remote entry is told how many of this pass's tokens come its way; local ones are left alone
    assert (done[2].output[0].pass_id, done[2].output[0].pass_size) == (9, 1)
    assert done[0].output[0].pass_size == 0

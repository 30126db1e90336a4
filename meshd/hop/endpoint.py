"""A shard speaking `meshd.wire`: messages in, messages out, no I/O.

Rules: one `ShardEndpoint` per loaded shard serves many sessions, each keyed by (session id, epoch).
A session is opened only if the model and recipe fingerprints and the layer range match; every
failure becomes an `Error` message for that session (never an exception out of `handle`), so a bad
request cannot take down the daemon or touch another session. The tail samples and answers with a
`Token` on the last prefill chunk and on every decode step.
A session may open from KV kept of the same requester's earlier tokens (`OpenSession.prefix`, answered with
`Opened.reused`; a `Close` with `keep` keeps it: `meshd/shard/prefix.py`), and a tail's session may sample
under a grammar (`meshd/shard/grammar.py`), fed the generated ids the head sends on with its output (`fed`).
KV a leaving hop hands over comes only as an entry asked for it (`AcceptKV`, then `KVChunk`s: `meshd/hop/handover.py`).
Sessions come and go through its `SessionTable` (`meshd/hop/sessions.py`): `_open` is the way in, `release` (and
the shard's evictions, `_evicted`) the way out, whose closer here frees the shard's part and writes the ledger.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from meshd.core.settings import default
from meshd.hop import sketch
from meshd.hop.admission import TYPICAL_LENGTH, Capacity, busy
from meshd.hop.handover import HandOverRefused, Incoming
from meshd.hop.sessions import HopSession, SessionTable
from meshd.shard import grammar, prefix
from meshd.shard.kv import CacheMiss, KVBudgetExceeded
from meshd.shard.batch import PASS, SCORE, STEPS
from meshd.shard.runtime import Shard
from meshd.shard.sampler import Sampler, SamplingParams
from meshd.wire import (AcceptKV, Cancel, Close, Error, ErrorCode, Forward, KVChunk, Message, OpenSession, Opened,
                        Phase, Tensor, Token)

TOKENS, HIDDEN, DRAFTS, FED = "tokens", "hidden", "drafts", "fed"  # fed: a frame's token ids, carried to the
# hop that samples under a grammar (its input: meshd/shard/grammar.py)
KIND = {Phase.PREFILL: PASS, Phase.DECODE: STEPS, Phase.VERIFY: SCORE}  # how a frame's positions are computed


MAX_SESSIONS = default("max_sessions")
IDLE_WHEN_FULL_S = default("session_idle_full")  # a session unused this long gives its room to a new one when the
# shard is full (a live generation sends a frame every step; an entry waits at most --busy-wait, 30 s, for a busy hop)


class ShardEndpoint:
    """Admission: at most `max_sessions` sessions, and only as many as the KV budget holds at the
    length each asks for (its KV is promised at open, so a session admitted never runs out of KV
    mid-generation). Past either bound, OpenSession gets a retriable `busy` at once, unless sessions
    unused for `idle_when_full` seconds can give their room: a session kept alive by a frame every few
    minutes holds its KV only while nobody else needs it."""

    def __init__(self, shard: Shard, model_fingerprint: str, recipe_fingerprint: str,
                 max_sessions: int = MAX_SESSIONS, idle_when_full: float = IDLE_WHEN_FULL_S) -> None:
        self.shard, self.model_fp, self.recipe_fp = shard, model_fingerprint, recipe_fingerprint
        self.max_sessions, self.idle_when_full = max_sessions, idle_when_full
        self.sessions = SessionTable()
        self.sessions.closers.append(self._let_go)
        shard.on_evict.append(self._evicted)
        self.refused = 0  # sessions refused as busy
        self.ledger = None  # the daemon's work ledger: one row per session served for another peer
        self.tokenizer = None  # a tail's (the head's too): what a grammar's tokens are (meshd/node/slot.py sets it)
        self.incoming = Incoming(shard)  # KV other hops hand over to this one (meshd/hop/handover.py)

    def handle(self, msg: Message, requester: str = "") -> list[Message]:
        """Answer one message; `requester` is the peer whose stream it came on ("": this daemon's entry)."""
        try:
            if isinstance(msg, OpenSession):
                return self._open(msg, requester)
            if isinstance(msg, Forward):
                return self._forward(msg)
            if isinstance(msg, Close):
                self.release((msg.session_id, msg.epoch), "completed", prefix.unpack_or_none(msg.keep))
                return []
            if isinstance(msg, Cancel):
                self.release((msg.session_id, msg.epoch), "cancelled")
                return []
            if isinstance(msg, AcceptKV):
                return self._accept_kv(msg, requester)
            if isinstance(msg, KVChunk):
                done = self.incoming.chunk(msg, requester)
                return [done] if done is not None else []
            return [Error(code=ErrorCode.BAD_FRAME, message=f"a shard does not take {type(msg).__name__}")]
        except HandOverRefused as exc:
            return [self._error(msg, ErrorCode.BAD_FRAME, str(exc))]
        except (KVBudgetExceeded, CacheMiss, ValueError, TypeError) as exc:  # GrammarError is a ValueError
            return self._failed(msg, exc)

    def _accept_kv(self, msg: AcceptKV, requester: str) -> list[Message]:
        """Take a hand-over an entry asks for (answered `Opened` with the ticket as session id), or refuse it."""
        if (msg.model_fingerprint, msg.recipe_fingerprint) != (self.model_fp, self.recipe_fp):
            return [self._error(msg, ErrorCode.MODEL_MISMATCH, "a hand-over of another model or recipe")]
        try:
            self.incoming.accept(msg, requester)
        except KVBudgetExceeded as exc:
            return [busy(f"busy: {exc}", getattr(msg, "request_id", 0), getattr(msg, "session_id", b""))]
        return [Opened(request_id=0, session_id=msg.ticket, epoch=0)]

    def release(self, key: tuple[bytes, int], outcome: str = "failed", keep: list[bytes] = ()) -> None:
        """Let a session go: `completed` when its entry closed it, `cancelled`, or `failed` (its
        stream was lost, or it sat idle past the KV TTL). With `keep` (the chain of the tokens its KV
        holds, `meshd/shard/prefix.py`) its KV is kept for a later session of the same requester that
        extends those tokens."""
        if self.sessions.close(key, outcome, keep) is None:
            self.shard.release(key)  # not open here: whatever the shard holds under its key goes

    def _let_go(self, session: HopSession) -> None:
        """The table's closer: the shard's part of a closed session goes (or its KV is kept), and the ledger
        says how it ended."""
        if session.keep:
            self.shard.keep(session.key, session.requester, list(session.keep))
        else:
            self.shard.release(session.key)
        if session.requester and self.ledger is not None:
            self.ledger.session_served(session.requester, *session.layers, session.positions, session.ended,
                                       session.opened_at)

    def _evicted(self, key: tuple[bytes, int]) -> None:
        """The shard's KV store evicted a session (idle past its TTL): it ends, as having failed."""
        self.sessions.close(key, "failed")

    def evict_expired(self) -> list[tuple[bytes, int]]:
        """End the sessions idle past the KV TTL (through `_evicted`) and hand-overs whose KV stopped coming;
        the keys of the sessions evicted."""
        self.incoming.expire()
        return self.shard.evict_expired()

    def capacity(self, reclaiming: bool = False) -> Capacity:
        """The numbers admission weighs; with `reclaiming`, the room of sessions unused past
        `idle_when_full` counts as free (`admit` takes it back when a new session needs it)."""
        sessions = list(self.sessions.values())
        if reclaiming:
            quiet = set(self.shard.kv.idle(self.idle_when_full))
            sessions = [s for s in sessions if s.key not in quiet]
        return Capacity(len(sessions), self.max_sessions, sum(s.promised for s in sessions),
                        self.shard.kv.budget_bytes)

    def admit(self, key: tuple[bytes, int], need: int) -> str | None:
        """Why a new session needing `need` KV bytes cannot be taken now, or None if it can. When
        the shard is full, sessions idle past their TTL go first, then those unused past
        `idle_when_full`, the longest unused first, until the new one fits."""
        if key in self.sessions:
            return None  # reopened: it replaces itself
        if self.capacity().refusal(need) is not None:
            self.evict_expired()
        for quiet in self.shard.kv.idle(self.idle_when_full):
            if self.capacity().refusal(need) is None:
                break
            self.release(quiet)
        return self.capacity().refusal(need)

    def free_sessions(self) -> int:
        """Sessions of a typical length (`TYPICAL_LENGTH` positions) that would be admitted now."""
        return self.capacity(reclaiming=True).free_sessions(self.shard.session_kv_bytes(TYPICAL_LENGTH))

    def kv_need(self, msg: OpenSession) -> int:
        """The KV bytes a session is promised at open: its whole length on its layers (a windowed
        layer's window and rollback only)."""
        length = min(msg.max_length or self.shard.max_positions, self.shard.max_positions)
        return self.shard.session_kv_bytes(max(0, length), msg.start, msg.end)

    def _error(self, msg: Message, code: str, text: str, retriable: bool = False) -> Error:
        return Error(code=code, message=text, retriable=retriable, request_id=getattr(msg, "request_id", 0),
                     session_id=getattr(msg, "session_id", b""))

    def _open(self, msg: OpenSession, requester: str = "") -> list[Message]:
        if msg.model_fingerprint != self.model_fp:
            return [self._error(msg, ErrorCode.MODEL_MISMATCH,
                                f"this shard serves model {self.model_fp[:12]}, not {msg.model_fingerprint[:12]}")]
        if msg.recipe_fingerprint != self.recipe_fp:
            return [self._error(msg, ErrorCode.RECIPE_MISMATCH,
                                f"this shard runs recipe {self.recipe_fp[:12]}, not {msg.recipe_fingerprint[:12]}")]
        if not self.shard.start <= msg.start < msg.end <= self.shard.end:
            return [self._error(msg, ErrorCode.BAD_FRAME, f"this shard serves layers [{self.shard.start},"
                                f" {self.shard.end}), not [{msg.start}, {msg.end})")]
        asked = prefix.unpack(msg.prefix)  # a malformed chain refuses the open, before anything is held
        key = (msg.session_id, msg.epoch)
        need = self.kv_need(msg)
        why = self.admit(key, need)
        if why is not None:
            self.refused += 1
            return [busy(f"busy: {why}", msg.request_id, msg.session_id)]
        tail = msg.end == self.shard.config.n_layers
        sampler = Sampler(SamplingParams(msg.temperature, msg.top_k, msg.top_p, msg.seed)) if tail else None
        constraint = self._constraint(msg) if tail and msg.grammar else None  # a bad grammar refuses the open
        self.shard.open_session(key, msg.max_length, msg.start, msg.end, msg.rope_table)  # a table it lacks: refused
        self.sessions.open(HopSession(key, sampler, head=msg.start == 0, microbatch=msg.microbatch, promised=need,
                                      layers=(msg.start, msg.end), requester=requester, opened_at=time.time(),
                                      constraint=constraint, carries_ids=bool(msg.grammar) and not tail))
        reused = self.shard.reuse(key, requester, asked) if asked else 0
        return [Opened(request_id=msg.request_id, session_id=msg.session_id, epoch=msg.epoch, reused=reused)]

    def opened_by(self, key: tuple[bytes, int], peer: str) -> bool:
        """Whether session `key` is open here for `peer` (or not open at all: nothing to refuse)."""
        session = self.sessions.get(key)
        return session is None or session.requester == peer

    def grammar_tokenizer(self):
        """The tokenizer as grammars see it (`meshd/shard/grammar.py`), built the first time it is asked for,
        from the tokenizer a tail keeps for it (`tokenizer`); ValueError where it has none."""
        if self.tokenizer is None:
            raise ValueError("this hop keeps no tokenizer: it cannot sample under a grammar")
        return grammar.ll_tokenizer(self.tokenizer)

    def _constraint(self, msg: OpenSession) -> grammar.Constraint:
        """The grammar a sampling session keeps to."""
        return grammar.Constraint(msg.grammar, self.grammar_tokenizer(), msg.grammar_from)

    def _forward(self, msg: Forward) -> list[Message]:
        return self.forward_batch([msg])[0]

    def forward_batch(self, msgs: list[Forward]) -> list[list[Message]]:
        """Several sessions' Forward frames in one pass (at most one a session); each gets the
        replies it would get alone, an Error in place of any that cannot run."""
        replies: list[list[Message] | None] = [None] * len(msgs)
        jobs, where = [], []
        for i, msg in enumerate(msgs):
            try:
                jobs.append(self._job(msg))
                where.append(i)
            except (CacheMiss, ValueError, TypeError) as exc:
                replies[i] = self._failed(msg, exc)
        for i, (_, x, position, _), out in zip(where, jobs, self.shard.forward_batch(jobs) if jobs else []):
            if isinstance(out, Exception):  # answered without raising it: a raised one would hold this frame
                replies[i] = self._failed(msgs[i], out)
                continue
            try:
                replies[i] = self._reply(msgs[i], out, position + x.shape[1])
            except (CacheMiss, KVBudgetExceeded, ValueError, TypeError) as exc:
                replies[i] = self._failed(msgs[i], exc)
        return replies  # type: ignore[return-value]

    def _job(self, msg: Forward) -> tuple:
        key = (msg.session_id, msg.epoch)
        state = self.sessions.get(key)
        if state is None:
            raise CacheMiss(f"session {msg.session_id.hex()[:12]} epoch {msg.epoch} is not open here")
        want = TOKENS if state.head else HIDDEN
        tensor = next((t for t in msg.tensors if t.name == want), None)
        if tensor is None:
            raise ValueError(f"forward frame lacks the {want!r} tensor")
        x = tensor.to_torch()
        if msg.phase == Phase.VERIFY:
            self._drafts(msg, x, state.head)  # refused here, before the pass, when they do not fit
        return key, x, msg.position, KIND.get(msg.phase, PASS)

    @staticmethod
    def _drafts(msg: Forward, x, head: bool) -> torch.Tensor:
        """A VERIFY frame's drafts, int64 [1, n - 1]: after the head's first token id, or the
        `drafts` tensor that travels with the hidden states."""
        if head:
            return x[:, 1:]
        t = next((t for t in msg.tensors if t.name == DRAFTS), None)
        if t is None:
            raise ValueError("a verify frame lacks the 'drafts' tensor")
        drafts = t.to_torch()
        if drafts.dtype not in (torch.int32, torch.int64) or tuple(drafts.shape) != (1, x.shape[1] - 1):
            raise ValueError(f"a verify frame of {x.shape[1]} positions needs drafts int [1, {x.shape[1] - 1}],"
                             f" not {drafts.dtype} {tuple(drafts.shape)}")
        return drafts.long()

    def _failed(self, msg: Message, exc: Exception) -> list[Message]:
        if isinstance(exc, KVBudgetExceeded):
            return [busy(str(exc), getattr(msg, "request_id", 0), getattr(msg, "session_id", b""))]
        if isinstance(exc, CacheMiss):
            return [self._error(msg, ErrorCode.UNKNOWN_SESSION, str(exc), retriable=True)]
        if isinstance(exc, (ValueError, TypeError)):
            return [self._error(msg, ErrorCode.BAD_FRAME, str(exc))]
        raise exc

    def _reply(self, msg: Forward, out, next_position: int) -> list[Message]:
        state = self.sessions[(msg.session_id, msg.epoch)]
        state.positions += next_position - msg.position
        drafts = None
        if msg.phase == Phase.VERIFY:
            x = next(t for t in msg.tensors if t.name == (TOKENS if state.head else HIDDEN)).to_torch()
            drafts = self._drafts(msg, x, state.head)
        if state.sampler is None:
            tensors = (Tensor.from_torch(HIDDEN, out.to(self.shard.recipe.torch_wire)),)
            if drafts is not None:
                tensors += (Tensor.from_torch(DRAFTS, drafts),)
            tensors += self._fed(msg, state)
            tensors += sketch.carried(msg.tensors, out, state.layers)  # when the entry asked (checked routes)
            return [Forward(session_id=msg.session_id, epoch=msg.epoch, step=msg.step, phase=msg.phase,
                            position=msg.position, chunk_index=msg.chunk_index, chunk_total=msg.chunk_total,
                            tensors=tensors)]
        constraint = state.constraint
        if constraint is not None:  # the grammar takes the generated ids fed (a verify frame's drafts as accepted)
            fed = self._fed_ids(msg, state)
            constraint.feed(msg.position, fed[:1] if drafts is not None else fed)
        if msg.phase == Phase.PREFILL and msg.chunk_index != msg.chunk_total - 1:
            return []
        accepted = 0
        if drafts is None:
            token, logprob = state.sampler.sample(out, next_position, constraint)
        else:
            accepted, token, logprob = state.sampler.verify(out, drafts[0].tolist(), msg.position + 1, constraint,
                                                            exact=sketch.teacher(msg.tensors))  # a check's window
            # the rejected drafts' positions leave this hop's KV at once (the others' with the next frame)
            self.shard.trim((msg.session_id, msg.epoch), msg.position + accepted + 1)
        return [Token(session_id=msg.session_id, epoch=msg.epoch, step=msg.step, token_id=token, logprob=logprob,
                      accepted=accepted, tensors=sketch.carried(msg.tensors, out, state.layers))]

    @staticmethod
    def _fed(msg: Forward, state: HopSession) -> tuple[Tensor, ...]:
        """The token ids that travel on with a frame's output: a head's own, where its route samples under a
        grammar; those it came with, elsewhere."""
        if state.head and state.carries_ids:
            return tuple(replace(t, name=FED) for t in msg.tensors if t.name == TOKENS)
        return tuple(t for t in msg.tensors if t.name == FED)

    @staticmethod
    def _fed_ids(msg: Forward, state: HopSession) -> list[int]:
        t = next((t for t in msg.tensors if t.name == (TOKENS if state.head else FED)), None)
        if t is None:
            raise ValueError("a frame of a session with a grammar lacks its token ids ('fed')")
        ids = t.to_torch()
        if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(f"a frame's token ids must be int [1, n], not {ids.dtype} {tuple(ids.shape)}")
        return ids[0].tolist()


def token_frame(session_id: bytes, epoch: int, step: int, phase: Phase, position: int, ids: list[int],
                chunk_index: int = 0, chunk_total: int = 1) -> Forward:
    """The Forward frame that feeds token ids to a head."""
    t = Tensor.from_torch(TOKENS, torch.tensor([ids], dtype=torch.int64))
    return Forward(session_id=session_id, epoch=epoch, step=step, phase=phase, position=position,
                   chunk_index=chunk_index, chunk_total=chunk_total, tensors=(t,))

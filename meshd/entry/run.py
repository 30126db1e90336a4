"""One generation as its entry runs it: the request, its record (`Generation`), its sampling, its
account of routes (`Retries`), the client's stream its text goes to, and what the stage it moves to
next needs (the route a hop's hand-over left, the disagreement to settle, the wait).

Rule: a token's text goes to the client once, in order, whole: sending it is shielded from
cancellation (a hop failing meanwhile), so a token counts as generated once its text is under way and
a reroute never sends it again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable

import trio

from meshd.entry.policy import Retries
from meshd.entry.state import Generation
from meshd.shard.sampler import SamplingParams
from meshd.shard.tokenizer import TextStream
from meshd.wire import GenerateRequest, StreamEvent

if TYPE_CHECKING:
    from meshd.entry.lockstep import Disagreement
    from meshd.entry.opening import Moved

Emit = Callable[[StreamEvent], Awaitable[None]]


@dataclass
class Run:
    req: GenerateRequest
    gen: Generation
    sampling: SamplingParams
    retries: Retries
    text: TextStream  # the tokens' text so far (a token may add none: its text comes with a later one)
    emit: Emit
    moved: Moved | None = None  # a hop of the last try left: the next try's route and its hops' streams
    disagreement: Disagreement | None = None  # a checked try's routes disagreed: what the third route settles
    wait: tuple[float, bool] = (0.0, False)  # the next wait: its seconds, and whether the mesh view is refreshed after

    async def retract(self, keep: int, reason: str) -> None:
        """Take back the generated tokens from `keep` on: a `retract` event tells the client how much of the text
        it was sent stays (`keep_chars` characters, the text of `keep` tokens), when some of theirs went out;
        the text goes on from there."""
        gen = self.gen
        if gen.streamed > keep:
            text = TextStream(self.text.tokenizer)
            for token in gen.tokens[:keep]:
                text.push(token)
            gen.check.retracted += gen.streamed - keep
            self.text = text
            with trio.CancelScope(shield=True):
                await self.emit(StreamEvent(request_id=self.req.request_id, kind="retract", text=reason,
                                            stats={"tokens": keep, "keep_chars": text.emitted}))
        gen.retract(keep)

    async def verified(self, through: int) -> None:
        """Tell the client its first `through` generated tokens are checked (a check whose text goes out at once)."""
        with trio.CancelScope(shield=True):
            await self.emit(StreamEvent(request_id=self.req.request_id, kind="verified",
                                        stats={"verified_through": through}))

    async def emit_tokens(self, tokens: list[int]) -> None:
        """The tokens' text, in order, all of it (they count as generated: see `emit_token`)."""
        with trio.CancelScope(shield=True):
            for token in tokens:
                await self.emit_token(token)

    async def emit_token(self, token: int) -> None:
        """Send a generated token's text to the client. Not cancelled half-way by a hop failing
        meanwhile: the token counts as generated, and a reroute does not send its text again."""
        gen = self.gen
        piece = self.text.push(token)
        gen.streamed += 1
        if piece:  # how many tokens the text so far holds; the first text also how long the prompt was,
            first = {"prompt_tokens": len(gen.ids), "cached_tokens": gen.reused}  # and how much of it was reused
            stats = {"tokens": gen.streamed} | (first if not gen.emitted else {})
            gen.emitted = True
            with trio.CancelScope(shield=True):
                await self.emit(StreamEvent(request_id=self.req.request_id, kind="text", text=piece, token_id=token,
                                            stats=stats))

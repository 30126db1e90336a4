"""One pass of several sessions' jobs through a shard's layers: what `Shard.forward_batch` runs.

Rules: jobs are (key, x, position) or (key, x, position, kind), at most one a session. Their rows go
through the layers stacked (`rows.Rows`), so each result is bit for bit what the session gets alone;
sessions that enter or leave the shard mid-range, or rotate with another RoPE table (a longrope model's
long one), run as groups of their own. A job that cannot run (unknown session, bad input, KV budget
full) gets its exception in its place, as a `plain_error`, and the others run. Kinds: PASS (a prompt
chunk), STEPS (positions computed as one-position decode steps would compute them, bit for bit) and
SCORE (as STEPS, and the tail returns every position's logits).
"""

from __future__ import annotations

import torch

from meshd.shard import rope
from meshd.shard.kv import CacheMiss, KVBudgetExceeded
from meshd.shard.rows import Rows

PASS, STEPS, SCORE = "pass", "steps", "score"
KINDS = (PASS, STEPS, SCORE)


def plain_error(exc: Exception) -> Exception:
    """The same error without its traceback: a raised exception's traceback holds the frames it
    passed, here the batch's, with every job's input tensors, in a cycle (results -> exception ->
    traceback -> frame -> results) that only the cyclic collector frees; a frame of 62 MB stayed
    until it ran."""
    return type(exc)(*exc.args)


def run_jobs(shard, jobs: list[tuple]) -> list[torch.Tensor | Exception]:
    """Each job's result in its place: hidden states [1, n, hidden], or at the tail the logits of
    the last position [vocab] (SCORE: of every position, [n, vocab]), or the job's exception."""
    results: list[torch.Tensor | Exception | None] = [None] * len(jobs)
    groups: dict[tuple[int, int], list[tuple]] = {}
    with torch.inference_mode():
        seen = set()
        for i, (key, x, position, *rest) in enumerate(jobs):
            try:
                kind = rest[0] if rest else PASS
                if kind not in KINDS:
                    raise ValueError(f"unknown kind of pass {kind!r}")
                if key in seen:
                    raise ValueError(f"session {key!r} appears twice in one batch")
                seen.add(key)
                first, last = shard.session_range(key)
                table = shard.session_table(key)
                h = layer_input(shard, x, first, position)  # checked first: refused input keeps no session alive
                limit = shard.table_positions(table)
                if position + h.shape[1] > limit:  # named before the KV's own length check
                    raise rope.past_context(shard.config.rope_scaling, position + h.shape[1], limit, table)
                kv = shard.kv.get(key)
                kv.reserve(position, h.shape[1])
                groups.setdefault((first, last, table), []).append((i, kv, h, position, kind))
            except (CacheMiss, KVBudgetExceeded, ValueError, TypeError) as exc:
                results[i] = plain_error(exc)
        for (first, last, table), members in groups.items():
            _run_group(shard, first, last, shard.rotaries[table], members, results)
    return results  # type: ignore[return-value]


def layer_input(shard, x: torch.Tensor, first: int, position: int) -> torch.Tensor:
    """A job's input as the first layer takes it: embedded token ids, or hidden states."""
    cfg, recipe = shard.config, shard.recipe
    if first == 0:
        if x.dim() != 2 or x.shape[0] != 1 or x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"the head takes token ids [1, n], got {x.dtype} {tuple(x.shape)}")
        if x.numel() and (int(x.min()) < 0 or int(x.max()) >= cfg.vocab):
            raise ValueError(f"token ids must be in [0, {cfg.vocab})")
        h = shard.family.embed(shard.head, x.long(), position, recipe.torch_compute)
    else:
        if x.dim() != 3 or x.shape[0] != 1 or x.shape[2] != cfg.hidden:
            raise ValueError(f"expected hidden states [1, n, {cfg.hidden}], got {tuple(x.shape)}")
        if x.dtype not in (recipe.torch_wire, recipe.torch_compute):  # never converted: refused
            raise ValueError(f"expected hidden states in {recipe.wire_dtype} (recipe {recipe.name}),"
                             f" got {str(x.dtype).removeprefix('torch.')}")
        h = x.to(recipe.torch_compute)
    if h.shape[1] == 0:
        raise ValueError("nothing to run: zero positions")
    return h


def segments(members: list, passes_equal_steps: bool) -> list[tuple[object, int, int]]:
    """(kv, position, n) per segment of the pass. Where a pass of many positions rounds
    differently from one-position steps (torch's float matmuls pick their kernel by row count,
    its attention by query count), a STEPS or SCORE job goes as one segment a position, which
    every layer computes as the decode step of that position (`rows.Rows`)."""
    parts = []
    for _, kv, h, position, kind in members:
        n = h.shape[1]
        if kind != PASS and n > 1 and not passes_equal_steps:
            parts.extend((kv, position + j, 1) for j in range(n))
        else:
            parts.append((kv, position, n))
    return parts


def _run_group(shard, first: int, last: int, rotary, members: list, results: list) -> None:
    """The members' rows through layers [first, last), stacked and rotated with `rotary` (their
    sessions' table); each result into its place."""
    rows = Rows.stack(segments(members, shard.passes_equal_steps))
    h = torch.cat([m[2] for m in members], dim=1) if len(members) > 1 else members[0][2]
    mine = shard.layers[first - shard.start:last - shard.start]
    if hasattr(shard.family, "layers_forward"):  # all of them in one call where the family can
        h = shard.family.layers_forward(mine, h, shard.config, rotary, rows)
    else:
        for li, layer in enumerate(mine):
            h = shard.family.layer_forward(layer, h, shard.config, rotary, rows, li)
    spans, row = [], 0  # each member's rows [row, row + n)
    for _, kv, mh, position, _ in members:
        kv.commit(position + mh.shape[1])
        spans.append((row, mh.shape[1]))
        row += mh.shape[1]
    if last != shard.config.n_layers:
        for (i, *_), (r, n) in zip(members, spans):
            results[i] = h if len(members) == 1 else h[:, r:r + n]
        return
    picked = [range(r, r + n) if m[4] == SCORE else range(r + n - 1, r + n) for m, (r, n) in zip(members, spans)]
    flat = [r for rs in picked for r in rs]
    x = h[:, -1:] if flat == [h.shape[1] - 1] else h[:, flat]
    logits = shard.family.final(shard.tail, x, shard.config, Rows.stack([(None, 0, 1)] * len(flat))).float()
    at = 0
    for m, rs in zip(members, picked):
        results[m[0]] = logits[0, at:at + len(rs)] if m[4] == SCORE else logits[0, at]
        at += len(rs)

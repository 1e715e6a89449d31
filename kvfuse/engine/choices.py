"""A request's ``n`` choices: one prompt prefill, then ``n`` sequences decoding on their own.

A request with ``SamplingParams.n > 1`` runs as one sequence (choice 0, the *parent*) until its
prompt's KV is complete. Then the engine forks it (``fork``): each other choice gets a copy of
the prompt's live KV (``KVCache.fork``, taken from the same KV budget), the prompt's last logits
and a decode state of its own (sampler with the choice's seed, constraint matcher, stop strings,
penalty counts), and samples its first token from those logits. The prompt is thus planned,
loaded or computed, counted and stored once, by the parent; the choices differ only in what they
sample.

A choice whose copy does not fit in the KV budget (or in ``max_running``) waits in the queue
like a preempted sequence, and so does a choice preempted later: admitted again, it recomputes
the prompt and its own tokens without the cache (its ``Reuse`` is keyless: the prompt's entries,
its counters and its history belong to the parent). ``Choices`` gathers the members' outcomes:
the request finishes when every choice has, with one result holding all of them; the first
error ends the request and cancels the other choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvfuse.prompts.prompt import Prompt
from kvfuse.reuse import Reuse

from .request import GenerationResult
from .sequence import DecodeState, Sequence, SequenceStatus


@dataclass(eq=False)
class Choices:
    """The sequences of one request's choices, by index (the parent first), and which of them
    have finished."""

    members: list[Sequence]
    finished: set[int] = field(default_factory=set)

    def done(self, seq: Sequence) -> GenerationResult | None:
        """``seq`` finished; the request's result once every choice has (None before)."""
        self.finished.add(seq.choice)
        if len(self.finished) < len(self.members):
            return None
        return self.result()

    def result(self) -> GenerationResult:
        """The parent's result (prompt, reuse, timings until the last choice ended) with every
        choice."""
        parent = self.members[0]
        out = parent.result()
        out.choices = [s.decode.choice(s.choice) for s in self.members]
        out.timings = replace(
            out.timings,
            decode_s=max(s.timings.decode_s for s in self.members),
            total_s=max(s.timings.total_s for s in self.members),
        )
        return out


def child_reuse(r: Reuse) -> Reuse:
    """A forked choice's ``Reuse``: the parent's prompt as plain ids, no keys (a rerun after a
    preemption computes it whole), already counted (the parent counts the prompt once)."""
    return Reuse(
        r.request_id, Prompt.plain(r.prompt.ids), r.cache, r.blend, cancel=r.cancel, counted=True
    )


def fork(parent: Sequence, tokenizer, eos_token_ids) -> list[Sequence]:
    """Choices ``1..n-1`` of ``parent``'s request, right after the parent sampled its first token:
    each with its decode state and timings so far, started, not yet running (no KV: the caller
    copies the parent's or queues them). ``parent`` joins the returned choices' ``Choices``."""
    p = parent.request.params
    family = Choices([parent])
    parent.family = family
    for index in range(1, p.n):
        child = Sequence(
            parent.request,
            child_reuse(parent.reuse),
            status=SequenceStatus.WAITING,
            started=True,
            logits=parent.logits,
            timings=replace(parent.timings),
            t_start=parent.t_start,
            choice=index,
            family=family,
        )
        child.decode = DecodeState.new(
            p, parent.reuse.prompt.ids, tokenizer, eos_token_ids, index, parent.decode.history
        )
        child.decode.started_at = parent.decode.started_at
        family.members.append(child)
    return family.members[1:]

"""BeamSearchCoordinator: runs beam search requests as forked sequences on the paged KV.

Owns the beam requests' own queue and concurrency quota, and the mapping between a beam
search's live beams (``core.beam_search.BeamSearch``) and the scheduler's ``Request``s. A
request starts as one sequence (the prompt, prefilled once); each step every live beam
computes one token and its top-K log-probabilities come back here instead of being
sampled. Once every live beam of a request has them, the search picks the next beams: a
beam extended once keeps its ``Request``, one extended several times is forked
(``Scheduler.fork_request``: the KV blocks are shared, a partly filled last block is copied
on write), and a beam nothing extends is pruned and frees its blocks at once. Finished
searches produce a single final ``RequestOutput`` with the n best beams.

Only ``max_beam_search_requests`` searches are in the scheduler at once (and never more
beams than ``max_num_seqs``); the rest wait in this queue, not in the scheduler's waiting
queue, so a burst of beam search requests does not queue ahead of standard ones. In the
scheduler the beams are a class of their own (``Request.is_beam``): they hold none of the
standard requests' ``max_num_seqs`` places, and yield the token budget and KV to them.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

from tokenmill.core.beam_search import BeamSearch, Continuation, Hypothesis
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.input_processor import ProcessedRequest, request_cache_salt
from tokenmill.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from tokenmill.tokenizer.detokenizer import IncrementalDetokenizer
from tokenmill.tokenizer.tokenizer import Tokenizer


@dataclass
class _Search:
    """One admitted beam search request: its search state and its live beam requests."""

    processed: ProcessedRequest
    search: BeamSearch
    beam_params: SamplingParams
    """What every beam request runs with: greedy, with the top-K logprobs the search needs."""
    metrics: RequestMetrics
    beams: list[Request] = field(default_factory=list)
    """Aligned with ``search.live_tokens``."""
    rows: dict[str, dict[int, float]] = field(default_factory=dict)
    """This step's top-K next-token logprobs, per beam request id, as they come in."""
    parked: set[str] = field(default_factory=set)
    """Beams taken out of the scheduler (KV freed) after reporting, so that a preempted
    sibling can get the memory; they come back, recomputed, once the step is decided."""


@dataclass(frozen=True)
class BeamLimits:
    """What the coordinator needs from the engine's configuration."""

    max_active_requests: int
    """Beam search requests in the scheduler at once (``--max-beam-search-requests``)."""
    max_num_seqs: int
    eos_token_ids: frozenset[int]
    max_total_tokens: int
    enable_prefix_caching: bool


class BeamSearchCoordinator:
    """Queues beam search requests, runs up to a quota of them, and steps their beams."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, limits: BeamLimits) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.limits = limits
        self._queue: deque[ProcessedRequest] = deque()
        self._active: dict[str, _Search] = {}
        self._owner: dict[str, str] = {}
        """Beam request id -> the user request it belongs to."""
        self._outputs: list[RequestOutput] = []
        self._failures: dict[str, Exception] = {}
        """Searches whose step raised: dropped, for the engine to fail (``take_failures``)."""
        self._ids = itertools.count()
        self.num_parked_beams = 0
        """Beams taken out of the scheduler to unblock a preempted sibling (memory pressure)."""

    # ---- requests ------------------------------------------------------------------------
    def has_request(self, request_id: str) -> bool:
        return request_id in self._active or any(p.request_id == request_id for p in self._queue)

    def add(self, processed: ProcessedRequest) -> None:
        """Queue a checked beam search request; it starts when the quota allows."""
        self._queue.append(processed)

    def owns(self, beam_request_id: str) -> bool:
        """Whether a scheduler request is one of the beams run here."""
        return beam_request_id in self._owner

    def owner_of(self, beam_request_id: str) -> str | None:
        """The user request a beam belongs to."""
        return self._owner.get(beam_request_id)

    def take_failures(self) -> dict[str, Exception]:
        """Searches whose own step raised since the last call (already dropped)."""
        failures, self._failures = self._failures, {}
        return failures

    def abort(self, request_id: str) -> bool:
        """Abort a queued or running beam search (its beams free their KV now); False if unknown."""
        for processed in self._queue:
            if processed.request_id == request_id:
                self._queue.remove(processed)
                metrics = RequestMetrics(arrival_time=processed.arrival_time)
                self._outputs.append(self._output(processed, metrics, [], "abort"))
                return True
        state = self._active.pop(request_id, None)
        if state is None:
            return False
        hypotheses = state.search.best(state.processed.params.n)
        self._drop_beams(state.beams)
        self._outputs.append(self._output(state.processed, state.metrics, hypotheses, "abort"))
        return True

    @property
    def num_queued(self) -> int:
        """Beam search requests waiting for the quota."""
        return len(self._queue)

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._queue or self._active or self._outputs)

    # ---- the loop ------------------------------------------------------------------------
    def admit(self) -> None:
        """Start queued searches while the quota and the batch bound allow (called before a step)."""
        limits = self.limits
        while self._queue and len(self._active) < limits.max_active_requests:
            width = self._queue[0].params.beam_width
            num_beams = sum(s.search.width for s in self._active.values())
            if self._active and num_beams + width > limits.max_num_seqs:
                return
            self._start(self._queue.popleft())

    def on_logprobs(self, beam: Request, logprobs: PositionLogprobs | None) -> None:
        """A beam computed its next position: keep its top-K log-probabilities for the step."""
        state = self._active.get(self._owner[beam.request_id])
        if state is None or logprobs is None:
            raise RuntimeError(f"beam {beam.request_id} returned no logprobs")
        state.rows[beam.request_id] = {t: lp.logprob for t, lp in logprobs.items()}

    def advance(self) -> list[RequestOutput]:
        """Step every search whose live beams all reported; returns finished requests' outputs."""
        now = time.monotonic()
        for request_id, state in list(self._active.items()):
            if len(state.rows) < len(state.beams):
                self._park_if_stalled(state)
                continue  # a beam was preempted or not scheduled yet: wait for it
            try:
                self._step_search(request_id, state, now)
            except Exception as exc:  # this search alone fails; the others go on
                self._active.pop(request_id, None)
                self._drop_beams(state.beams)
                self._failures[request_id] = exc
        outputs, self._outputs = self._outputs, []
        self.admit()
        return outputs

    # ---- internals -----------------------------------------------------------------------
    def _step_search(self, request_id: str, state: _Search, now: float) -> None:
        rows = [state.rows[b.request_id] for b in state.beams]
        state.rows.clear()
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        state.metrics.last_token_time = now
        continuations = state.search.step(rows)
        if state.search.is_done:
            del self._active[request_id]
            self._drop_beams(state.beams)
            state.metrics.finished_time = now
            hypotheses = state.search.best(state.processed.params.n)
            self._outputs.append(self._output(state.processed, state.metrics, hypotheses))
        else:
            self._branch(state, continuations)

    def _start(self, processed: ProcessedRequest) -> None:
        params = processed.params
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids |= self.limits.eos_token_ids
        # The input processor resolved max_tokens within the context (request_limits); None
        # (a ProcessedRequest built by hand) runs to the context's end, as every request may.
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.limits.max_total_tokens - len(processed.prompt_token_ids)
        search = BeamSearch(
            width=params.beam_width,
            max_tokens=max_tokens,
            stop_token_ids=frozenset(stop_ids),
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
        )
        beam_params = SamplingParams(
            temperature=0.0, max_tokens=None, ignore_eos=True, logprobs=search.num_candidates
        )
        first = self._new_beam(processed, beam_params, [])
        state = _Search(processed, search, beam_params, first.metrics, [first])
        self._active[processed.request_id] = state
        self.scheduler.add_request(first)

    def _new_beam(
        self, processed: ProcessedRequest, params: SamplingParams, output_token_ids: list[int]
    ) -> Request:
        rid = processed.request_id
        beam = Request(
            request_id=f"{rid}#beam{next(self._ids)}",
            prompt_token_ids=processed.prompt_token_ids,
            sampling_params=params,
            max_total_tokens=self.limits.max_total_tokens,
            priority=processed.priority,
            arrival_time=processed.arrival_time,
            cache_salt=request_cache_salt(processed, self.limits.enable_prefix_caching),
            parent_id=rid,
            is_beam=True,
        )
        beam.output_token_ids = list(output_token_ids)
        self._owner[beam.request_id] = rid
        return beam

    def _park_if_stalled(self, state: _Search) -> None:
        """Under memory pressure a preempted beam may wait for KV that its siblings hold while
        they wait for it to report: the reported ones leave the scheduler until the step is
        decided, so the group always progresses (at the cost of recomputing them)."""
        is_stalled = any(
            b.request_id not in state.rows and b.status is not RequestStatus.RUNNING
            for b in state.beams
        )
        if not is_stalled:
            return
        for beam in state.beams:
            if beam.request_id in state.rows and beam.request_id not in state.parked:
                self.scheduler.finish_request(beam.request_id, RequestStatus.PREEMPTED)
                beam.num_computed_tokens = 0
                state.parked.add(beam.request_id)
                self.num_parked_beams += 1

    def _branch(self, state: _Search, continuations: list[Continuation]) -> None:
        """Turn the chosen continuations into live beam requests: reuse, fork, prune."""
        children: dict[int, list[int]] = defaultdict(list)
        for j, c in enumerate(continuations):
            children[c.parent].append(j)
        beams: list[Request | None] = [None] * len(continuations)
        # Fork before any token is appended, while every parent still holds its blocks.
        for parent_index, js in children.items():
            parent = state.beams[parent_index]
            beams[js[0]] = parent
            is_parked = parent.request_id in state.parked
            for j in js[1:]:
                child = self._new_beam(state.processed, state.beam_params, parent.output_token_ids)
                if is_parked:  # nothing to share: it recomputes, like its parent
                    self.scheduler.add_request(child)
                else:
                    self.scheduler.fork_request(parent, child)
                beams[j] = child
            if is_parked:
                self.scheduler.add_request(parent)
        state.parked.clear()  # every parked beam is back in the scheduler or pruned below
        self._drop_beams([b for i, b in enumerate(state.beams) if i not in children])
        live: list[Request] = []
        for beam, c in zip(beams, continuations, strict=True):
            assert beam is not None
            beam.output_token_ids.append(c.token_id)
            live.append(beam)
        state.beams = live

    def _drop_beams(self, beams: list[Request]) -> None:
        """Pruned or finished beams leave the scheduler, which frees their KV blocks now."""
        for beam in beams:
            self._owner.pop(beam.request_id, None)
            self.scheduler.finish_request(beam.request_id, RequestStatus.FINISHED_ABORTED)

    def _output(
        self,
        processed: ProcessedRequest,
        metrics: RequestMetrics,
        hypotheses: list[Hypothesis],
        finish_reason: str | None = None,
    ) -> RequestOutput:
        """The one output of a beam search: the n best beams, best first, text in full."""
        params = processed.params
        completions = []
        for i, h in enumerate(hypotheses):
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                prompt_ids=processed.prompt_token_ids,
            )
            text = detokenizer.add_tokens(h.token_ids) + detokenizer.finish()
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(h.token_ids),
                    cumulative_logprob=h.cum_logprob,
                    finish_reason=finish_reason or h.finish_reason,
                    stop_reason=h.stop_reason,
                    text_delta=text,
                    token_ids_delta=list(h.token_ids),
                )
            )
        completions += [  # aborted before n beams had tokens
            CompletionOutput(i, "", [], finish_reason=finish_reason or "length")
            for i in range(len(completions), params.n)
        ]
        return RequestOutput(
            request_id=processed.request_id,
            prompt=processed.prompt_text,
            prompt_token_ids=processed.prompt_token_ids,
            outputs=completions,
            finished=True,
            metrics=metrics,
            num_cached_tokens=metrics.num_cached_tokens,
        )

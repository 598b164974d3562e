"""OutputProcessor: from sampled tokens to user-facing RequestOutputs.

Owns incremental detokenization, stop-string matching (which may span token boundaries),
logprob text, and folding the n child sequences of a request back into one RequestOutput
carrying everything so far, only what is new, or only the end (``RequestOutputKind``).
While a stop string could still be forming, the last ``len(longest stop) - 1`` characters
are held back from streaming so a client never sees text that is later retracted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sampling_params import RequestOutputKind
from tokenmill.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tokenmill.tokenizer.detokenizer import IncrementalDetokenizer
from tokenmill.tokenizer.tokenizer import Tokenizer


@dataclass
class _Child:
    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_chars_emitted: int = 0
    num_tokens_emitted: int = 0
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    is_reported_finished: bool = False


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    streaming_text_holdback: int = 0
    touched: bool = field(default=False)
    num_outputs: int = 0
    pooled: list[float] | None = None


class OutputProcessor:
    """Tracks every live request's text; produces outputs after each step."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        params = children[0].sampling_params
        kids = [
            _Child(
                request=c,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer,
                    skip_special_tokens=params.skip_special_tokens,
                    prompt_ids=c.prompt_token_ids,
                ),
                logprobs=[] if params.logprobs is not None else None,
            )
            for c in children
        ]
        parent = _Parent(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=children[0].prompt_token_ids,
            children=kids,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            output_kind=params.output_kind,
            streaming_text_holdback=max((len(s) for s in params.stop or []), default=1) - 1,
        )
        self._parents[request_id] = parent
        for c in children:
            self._child_to_parent[c.request_id] = request_id

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    def parent_id(self, child_id: str) -> str | None:
        """The user request a child sequence belongs to."""
        return self._child_to_parent.get(child_id)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return [c.request.request_id for c in parent.children] if parent else []

    def _find(self, child_id: str) -> tuple[_Parent, _Child] | None:
        parent_id = self._child_to_parent.get(child_id)
        if parent_id is None:
            return None
        parent = self._parents[parent_id]
        for child in parent.children:
            if child.request.request_id == child_id:
                return parent, child
        return None

    def add_prompt_logprobs(
        self, child_id: str, first_pos: int, entries: list[PositionLogprobs | None]
    ) -> None:
        """Logprobs of prompt positions first_pos...; positions already known (a chunk
        recomputed after preemption) are skipped, so each position is reported once."""
        found = self._find(child_id)
        if found is None:
            return
        parent, child = found
        if child.request.index != 0 or parent.prompt_logprobs is None:
            return
        new = entries[max(0, len(parent.prompt_logprobs) - first_pos) :]
        if first_pos + len(entries) > len(parent.prompt_logprobs) >= first_pos:
            self._decode_logprob_text(new)
            parent.prompt_logprobs.extend(new)

    def on_token(
        self, child_id: str, token_id: int, logprobs: PositionLogprobs | None
    ) -> str | None:
        """Record a new token's text; returns the matched stop string, if one ended it."""
        found = self._find(child_id)
        if found is None:
            return None
        parent, child = found
        parent.touched = True
        params = child.request.sampling_params
        if child.logprobs is not None and logprobs is not None:
            self._decode_logprob_text([logprobs])
            child.logprobs.append(logprobs)
            child.cumulative_logprob += logprobs[token_id].logprob
        previous_len = len(child.text)
        child.text += child.detokenizer.add_tokens([token_id])
        return self._check_stop_strings(
            child, params.stop or [], previous_len, params.include_stop_str_in_output
        )

    @staticmethod
    def _check_stop_strings(
        child: _Child, stops: list[str], previous_len: int, include: bool
    ) -> str | None:
        if not stops or child.finish_reason is not None:
            return None
        if child.request.num_output_tokens < child.request.sampling_params.min_tokens:
            return None
        longest = max(len(s) for s in stops)
        search_from = max(0, previous_len - longest + 1)
        best: tuple[int, str] | None = None
        for stop in stops:
            idx = child.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        child.text = child.text[: idx + len(stop)] if include else child.text[:idx]
        child.finish_reason = "stop"
        child.stop_reason = stop
        return stop

    def _decode_logprob_text(self, entries: list[PositionLogprobs | None]) -> None:
        for entry in entries:
            if entry is None:
                continue
            for token_id, lp in entry.items():
                if lp.decoded_token is None:
                    lp.decoded_token = self.tokenizer.id_to_token_text(token_id)

    def set_pooled(self, child_id: str, pooled: list[float]) -> None:
        """A pooling request's vector, reported with its (final) output."""
        found = self._find(child_id)
        if found is not None:
            found[0].pooled = pooled
            found[0].touched = True

    def mark_finished(self, child_id: str) -> None:
        """A child finished in the scheduler (eos, length, stop token, abort)."""
        found = self._find(child_id)
        if found is None:
            return
        parent, child = found
        parent.touched = True
        if child.finish_reason is None:
            status = child.request.status
            tail = child.detokenizer.finish()
            child.text += tail
            params = child.request.sampling_params
            if tail and status is not RequestStatus.FINISHED_ABORTED:
                self._check_stop_strings(
                    child,
                    params.stop or [],
                    len(child.text) - len(tail),
                    params.include_stop_str_in_output,
                )
            if child.finish_reason is None:  # no stop string in the flushed tail
                child.finish_reason = status.finish_reason or RequestStatus.FINISHED_ABORTED.value
                child.stop_reason = child.request.stop_reason

    def collect(self) -> list[RequestOutput]:
        """Outputs for every request that changed since the last call (per its output kind)."""
        outputs = []
        for parent_id in list(self._parents):
            parent = self._parents[parent_id]
            if not parent.touched:
                continue
            parent.touched = False
            finished = all(c.finish_reason is not None for c in parent.children)
            if parent.output_kind is RequestOutputKind.FINAL_ONLY and not finished:
                continue
            outputs.append(self._build(parent, finished))
            if finished:
                del self._parents[parent_id]
                for c in parent.children:
                    self._child_to_parent.pop(c.request.request_id, None)
        return outputs

    def _build(self, parent: _Parent, finished: bool) -> RequestOutput:
        delta = parent.output_kind is RequestOutputKind.DELTA
        completions = []
        for child in parent.children:
            done = child.finish_reason is not None
            visible = (
                len(child.text)
                if done
                else max(child.num_chars_emitted, len(child.text) - parent.streaming_text_holdback)
            )
            tokens = child.request.output_token_ids
            text_delta = child.text[child.num_chars_emitted : visible]
            ids_delta = tokens[child.num_tokens_emitted :]
            logprobs = None
            if child.logprobs is not None:
                logprobs = (
                    child.logprobs[child.num_tokens_emitted :] if delta else list(child.logprobs)
                )
            completions.append(
                CompletionOutput(
                    index=child.request.index,
                    text=text_delta if delta else child.text[:visible],
                    token_ids=ids_delta if delta else list(tokens),
                    logprobs=logprobs,
                    cumulative_logprob=child.cumulative_logprob
                    if child.logprobs is not None
                    else None,
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                    text_delta=text_delta,
                    token_ids_delta=ids_delta,
                )
            )
            child.num_chars_emitted = visible
            child.num_tokens_emitted = len(tokens)
        prompt_logprobs = parent.prompt_logprobs
        if prompt_logprobs is not None:
            prompt_logprobs = None if delta and parent.num_outputs else list(prompt_logprobs)
        parent.num_outputs += 1
        first = parent.children[0].request
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=first.metrics,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=first.metrics.num_cached_tokens,
            pooled=parent.pooled,
        )

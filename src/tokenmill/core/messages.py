"""What crosses between the engine and its workers each step (no torch, no pickle).

vLLM v1's ``SchedulerOutput`` is the model: a request's prompt, output so far, sampling
(or pooling) parameters, adapter id and grammar cross once (``NewRequestData``); every later
step sends only its id, where its computation starts, the tokens appended since and the
block ids added since (``CachedRequestData``), plus this step's draft tokens. Workers keep
the rest (``worker/request_state.py``). What comes back is ``StepOutput``: sampled tokens,
logprobs, pooled vectors, verified speculative tokens, and failures as text (the
per-request error boundary; an exception object never crosses).

In-process the structs are handed over as they are (the grammar is the compiled object);
across a process they are msgpack (``encode``/``decode_*``), and a compiled grammar
(llguidance) crosses as nil: a worker in another process compiles its own from
``sampling_params.structured_outputs``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenmill.core.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.core.structured_params import StructuredOutputsParams
from tokenmill.outputs import PositionLogprobs
from tokenmill.pooling_params import PoolingParams


class NewRequestData(msgspec.Struct, omit_defaults=True):
    """A sequence the workers have not seen (or must forget and take again): sent once."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: Any
    """The ``SamplingParams`` object in-process; its fields (``params_to_wire``) across one."""
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: list[int] = []
    index: int = 0
    lora_id: int = 0
    max_total_tokens: int = 2**31
    is_beam: bool = False
    pooling: Any = None
    """``PoolingParams`` (in-process) or its fields; None for a generating request."""
    grammar: Any = None
    """The compiled grammar in-process; nil across a process (the worker compiles its own)."""


class CachedRequestData(msgspec.Struct, array_like=True):
    """A sequence the workers already hold: only what changed since they last saw it."""

    request_id: str
    num_computed_tokens: int
    new_token_ids: list[int]
    """Tokens appended since the last step that scheduled it (usually the one just sampled)."""
    new_block_ids: list[int]
    replaces_block_ids: bool = False
    """True: ``new_block_ids`` is the whole table (after preemption or a copy-on-write)."""


class StepPlan(msgspec.Struct, omit_defaults=True):
    """One step for the workers, as a diff: the scheduler writes it (``Scheduler.schedule``)."""

    scheduled: list[tuple[str, int]] = []
    """(sequence id, tokens to compute), in the scheduler's order (rows are laid out so)."""
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    num_spec_tokens: dict[str, int] = {}
    """Per sequence, the draft tokens scheduled after its last token this step: the
    workers' proposer fills that many (the scheduler never sees a token id of a draft)."""
    max_proposal: int = 0
    """The speculation policy's k for the batch now: how many tokens a proposer prepares
    per request for the next step (0: it prepares none)."""
    finished_ids: list[str] = []
    """Sequences to forget before this step (finished, aborted)."""
    preempted_ids: list[str] = []
    blocks_to_copy: list[tuple[int, int]] = []
    draft_catch_up: dict[str, int] = {}
    """Draft model: per sequence the draft runs on this step, the tokens it reads first."""
    num_draft_computed: dict[str, int] = {}
    """Draft model: those sequences' draft KV length as the engine knows it."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class VerifiedTokens:
    """What verification kept for one request: accepted drafts, then one more token."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]
    num_draft_tokens: int

    @property
    def num_accepted(self) -> int:
        """Draft tokens accepted (the last token is the target's own)."""
        return len(self.token_ids) - 1


@dataclass
class StepOutput:
    """What a step produced per sequence (rank 0's answer; other ranks return None)."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, PositionLogprobs | None] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs | None]]] = field(
        default_factory=dict
    )
    """request_id -> (position of the first entry, logprobs of the prompt tokens that follow)."""
    grammar_ended: set[str] = field(default_factory=set)
    """Requests whose structured-output grammar is complete after this step's token."""
    failed: dict[str, str] = field(default_factory=dict)
    """request_id -> what raised while sampling or scoring that request alone (as text)."""
    pooled: dict[str, list[float]] = field(default_factory=dict)
    """Pooling requests whose prompt was completed this step: their pooled vector."""
    num_draft_computed: dict[str, int] = field(default_factory=dict)
    """Draft model: each drafted sequence's draft KV length after this step."""
    verified: dict[str, VerifiedTokens] = field(default_factory=dict)
    """Requests that verified speculative tokens: every token kept (``sampled`` holds the
    first), with the target's logprobs."""
    num_proposable: dict[str, int] = field(default_factory=dict)
    """Per request that produced tokens: how many tokens the proposer has ready for its
    next step (the engine asks for at most that many)."""


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams as builtins: its fields, the enum by value, structured outputs as a dict."""
    wire = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    wire["output_kind"] = params.output_kind.value
    if params.logit_bias is not None:  # pairs: msgpack maps would want string keys
        wire["logit_bias"] = [[t, b] for t, b in params.logit_bias.items()]
    so = params.structured_outputs
    if so is not None:
        wire["structured_outputs"] = {
            f.name: getattr(so, f.name)
            for f in dataclasses.fields(so)
            if getattr(so, f.name) is not None
        }
    return wire


def params_from_wire(wire: dict[str, Any] | SamplingParams) -> SamplingParams:
    """The inverse of ``params_to_wire`` (an in-process plan holds the object itself)."""
    if isinstance(wire, SamplingParams):
        return wire
    values = dict(wire)
    values["output_kind"] = RequestOutputKind(values["output_kind"])
    if values.get("logit_bias") is not None:
        values["logit_bias"] = {int(t): float(b) for t, b in values["logit_bias"]}
    if values.get("structured_outputs") is not None:
        values["structured_outputs"] = StructuredOutputsParams(**values["structured_outputs"])
    return SamplingParams(**values)


# ---- start-up: what a worker resolved and what the engine decided --------------------
class WorkerInfo(msgspec.Struct):
    """What a worker resolved at start-up (the engine's resolved config is built from it)."""

    device: str
    dtype: str
    kv_cache_dtype: str
    num_threads: int
    max_model_len: int
    model_load_s: float


class KVCacheSpec(msgspec.Struct):
    """What the engine's KV manager decided: the worker allocates exactly this."""

    num_blocks: int
    block_size: int
    wants_compiled_decode: bool
    """Decode-only steps go through the compiled step (static; paged with --compile-batch-sizes)."""


class CacheInfo(msgspec.Struct):
    """What allocating the cache, compiling and loading the draft cost on this worker."""

    kv_allocation_s: float
    kv_cache_bytes: int
    compile_time_s: float = 0.0
    compile_s_by_bucket: dict[int, float] = {}
    compile_cache_by_bucket: dict[int, str] = {}
    eager_reason: str | None = None
    """Why the static strategy's decode step runs eagerly (the model's forward cannot be
    compiled with fixed shapes); the engine logs it."""


def pooling_to_wire(pooling: PoolingParams | None) -> dict[str, Any] | None:
    return None if pooling is None else dataclasses.asdict(pooling)


def pooling_from_wire(wire: dict[str, Any] | PoolingParams | None) -> PoolingParams | None:
    if wire is None or isinstance(wire, PoolingParams):
        return wire
    return PoolingParams(**wire)


def _enc_hook(obj: object) -> Any:
    """Types msgpack cannot carry: sets as lists, anything opaque (a grammar) as nil."""
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    return None


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_plan_decoder = msgspec.msgpack.Decoder(StepPlan)
_output_decoder = msgspec.msgpack.Decoder(StepOutput | None)


def plan_for_wire(plan: StepPlan) -> StepPlan:
    """The plan as another process takes it: parameters as builtins (``params_to_wire``),
    grammars as nil (the worker there compiles its own). In-process plans keep the objects."""
    if not plan.new_requests:
        return plan
    return msgspec.structs.replace(
        plan,
        new_requests=[
            msgspec.structs.replace(
                new,
                sampling_params=params_to_wire(new.sampling_params),
                pooling=pooling_to_wire(new.pooling),
                grammar=None,
            )
            for new in plan.new_requests
        ],
    )


def encode(message: object) -> bytes:
    """A plan, a step output or any builtin value as msgpack bytes."""
    return _encoder.encode(message)


def decode_plan(data: bytes) -> StepPlan:
    return _plan_decoder.decode(data)


def decode_output(data: bytes) -> StepOutput | None:
    return _output_decoder.decode(data)


def decode_any(data: bytes, type: Any = Any) -> Any:
    """Any message into ``type`` (builtins when Any)."""
    return msgspec.msgpack.decode(data, type=type)

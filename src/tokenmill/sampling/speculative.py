"""Verification of speculative tokens: keep the longest prefix the target model accepts.

Each request with k draft tokens brings k + 1 logits rows (the target's prediction after
its last token and after each draft token). Every row is processed as the sampler would
process it at that position: penalties and min_tokens see the draft tokens accepted before
it, so each verified position gets exactly the parameters plain decoding would give it.
Greedy rows accept a draft token while it is the argmax. Sampled rows use speculative
rejection sampling: a draft token d (proposed with a point-mass q, as n-gram and greedy
drafting do) is accepted with probability p(d); on rejection the token is drawn from the
residual max(0, p - q), i.e. p without d, renormalised; when every draft is accepted one
more token is drawn from the last row. The output therefore follows the target
distribution exactly. Random draws come from the request's own generator when it is
seeded, so a seeded request stays deterministic. Logprobs are the target's raw ones.

A greedy request that nothing processes (no penalties, logit_bias, min_tokens left or
grammar) and that asks no logprobs takes the raw argmax of its rows: the per-position
views would change nothing there, and building them is most of a small step's verify cost.
"""

from __future__ import annotations

import copy

import torch

from tokenmill import kernels
from tokenmill.core.messages import VerifiedTokens
from tokenmill.core.request import Request
from tokenmill.sampling.categorical import categorical
from tokenmill.sampling.sampler import Sampler


def position_views(request: Request, drafts: list[int]) -> list[Request]:
    """The request as the sampler sees it at each verified position (drafts before it
    counted as output), so penalties and min_tokens apply per position."""
    views = []
    for j in range(len(drafts) + 1):
        view = copy.copy(request)
        view.output_token_ids = request.output_token_ids + drafts[:j]
        views.append(view)
    return views


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``probs`` (unnormalised is fine) by the inverse CDF."""
    uniform = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device)
    return int(categorical(probs.reshape(1, -1), uniform)[0])


def _accept_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """The target's argmax at each position up to and including the first that differs
    from the draft (all of them, plus the bonus token, when every draft matches)."""
    tokens: list[int] = []
    for j, target in enumerate(kernels.argmax(logits).tolist()):
        tokens.append(target)
        if j == len(drafts) or target != drafts[j]:
            break
    return tokens


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    request: Request,
    drafts: list[int],
    token_bitmask: torch.Tensor | None = None,
) -> VerifiedTokens:
    """Verify ``drafts`` of one request against its ``len(drafts) + 1`` logits rows;
    ``token_bitmask`` holds a structured-output grammar's mask per position."""
    params = request.sampling_params
    if (
        params.is_greedy
        and params.logprobs is None
        and token_bitmask is None
        and not Sampler.needs_processing([request], None)
    ):
        # min_tokens: the first position has the fewest outputs, so if it needs no mask
        # none does; penalties and logit_bias are per request.
        kept = _accept_greedy(logits, drafts)
        return VerifiedTokens(kept, [None] * len(kept), len(drafts))
    views = position_views(request, drafts)
    processed = sampler.process(logits, views, token_bitmask)
    is_greedy = request.sampling_params.is_greedy
    tokens: list[int] = []
    if is_greedy:
        tokens = _accept_greedy(processed, drafts)
    else:
        probs = sampler.probs(processed, views)
        generator = sampler.generator_for(request)
        for j in range(len(drafts) + 1):
            row = probs[j]
            if j == len(drafts):
                tokens.append(_draw(row, generator))
                break
            draft = drafts[j]
            u = torch.rand((), generator=generator, device=row.device)
            if bool(u < row[draft]):
                tokens.append(draft)
                continue
            residual = row.clone()
            residual[draft] = 0.0
            tokens.append(_draw(residual, generator))
            break
    rows = len(tokens)
    logprobs = Sampler.logprobs_of(logits[:rows], tokens, views[:rows])
    return VerifiedTokens(tokens, logprobs, len(drafts))

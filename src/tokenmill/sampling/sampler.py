"""Sampler: turns a batch of logits into next tokens, vectorised over requests.

Order of operations follows vLLM: logit bias, min_tokens masking and penalties on the raw
logits, then greedy rows take the argmax; other rows get temperature, min_p, top_k, top_p
and are sampled by the inverse CDF (``sampling/categorical.py``: one uniform variate a row),
which lets a seeded request draw from its own generator while the rest of the batch shares one.
Reported logprobs are the model's raw log-probabilities (before any processing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill import kernels
from tokenmill.core.request import Request
from tokenmill.outputs import Logprob, PositionLogprobs
from tokenmill.sampling.categorical import categorical
from tokenmill.sampling.nucleus import apply_top_k_top_p
from tokenmill.structured.bitmask import apply_token_bitmask


@dataclass
class SamplerOutput:
    """Sampled token per row, its raw logprob, and the top-k logprobs where asked."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """Logits with +inf clamped to the dtype's largest value (a -inf ban is kept): one pass,
    where clamping both ends and restoring the -inf entries took three and a mask."""
    return logits.clamp(max=torch.finfo(logits.dtype).max)


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output) penalties, in place."""
    batch, vocab = logits.shape
    device = logits.device
    max_out = max(len(r.output_token_ids) for r in requests)
    counts = torch.zeros(batch, vocab + 1, device=device)
    if max_out:
        out_ids = torch.full((batch, max_out), vocab, dtype=torch.long, device=device)
        for i, r in enumerate(requests):
            if r.output_token_ids:
                out_ids[i, : len(r.output_token_ids)] = torch.tensor(
                    r.output_token_ids, device=device
                )
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
    counts = counts[:, :vocab]
    rep = _column([r.sampling_params.repetition_penalty for r in requests], device)
    if (rep != 1.0).any():
        seen = counts > 0
        max_prompt = max(r.num_prompt_tokens for r in requests)
        prompt_ids = torch.full((batch, max_prompt), vocab, dtype=torch.long, device=device)
        for i, r in enumerate(requests):
            prompt_ids[i, : r.num_prompt_tokens] = torch.tensor(r.prompt_token_ids, device=device)
        prompt_seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device)
        prompt_seen.scatter_(1, prompt_ids, True)
        seen |= prompt_seen[:, :vocab]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        # A penalty beyond float32's range ranks instead of poisoning the row: +inf becomes
        # the largest finite logit, and a banned token (-inf; -inf * 0 is NaN) stays banned.
        penalised = torch.where(logits == float("-inf"), logits, _finite(penalised))
        logits = torch.where(seen, penalised, logits)
    freq = _column([r.sampling_params.frequency_penalty for r in requests], device)
    presence = _column([r.sampling_params.presence_penalty for r in requests], device)
    return logits - freq * counts - presence * (counts > 0).float()


def apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> None:
    """Add each row's ``logit_bias`` to its logits, in place, first of all (as OpenAI and
    vLLM do: the grammar, min_tokens and penalties then act on the biased logits)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, r in enumerate(requests):
        for token, bias in (r.sampling_params.logit_bias or {}).items():
            rows.append(i)
            cols.append(token)
            values.append(bias)
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    bias_values = torch.tensor(values, dtype=logits.dtype, device=device)
    logits.index_put_(index, bias_values, accumulate=True)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely one's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    """Stateful only for per-request generators (kept across preemption, dropped on finish)."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)

    def _request_generator(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed((seed + request.index) % 2**64)
            self._generators[request.request_id] = gen
        return gen

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Sample one token per row; ``token_bitmask`` (packed int32 bits per row) bans
        the tokens a row's grammar does not allow, before anything else."""
        raw = logits
        is_greedy = [r.sampling_params.is_greedy for r in requests]
        if all(is_greedy) and not self.needs_processing(requests, token_bitmask):
            token_list = kernels.argmax(logits).tolist()  # the common batch: one argmax
            return SamplerOutput(token_list, self.logprobs_of(raw, token_list, requests))
        logits = self.process(logits, requests, token_bitmask)
        greedy = kernels.argmax(logits)
        if all(is_greedy):
            tokens = greedy
        else:
            tokens = torch.where(
                torch.tensor(is_greedy, device=self.device), greedy, self._sample(logits, requests)
            )
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self.logprobs_of(raw, token_list, requests))

    @staticmethod
    def needs_processing(requests: list[Request], token_bitmask: torch.Tensor | None) -> bool:
        """Whether ``process`` would change any row (else greedy rows take the raw argmax
        without a copy). Whatever ``process`` applies must be tested here too."""
        return (
            token_bitmask is not None
            or any(r.num_output_tokens < r.sampling_params.min_tokens for r in requests)
            or any(r.sampling_params.has_penalties for r in requests)
            or any(r.sampling_params.logit_bias for r in requests)
        )

    def process(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        token_bitmask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A copy of the logits with the grammar mask, min_tokens and penalties applied:
        greedy rows take its argmax."""
        logits = logits.clone()
        if any(r.sampling_params.logit_bias for r in requests):
            apply_logit_bias(logits, requests)
        if token_bitmask is not None:
            apply_token_bitmask(logits, token_bitmask)
        self._mask_min_tokens(logits, requests)
        if any(r.sampling_params.has_penalties for r in requests):
            logits = apply_penalties(logits, requests)
        return logits

    def generator_for(self, request: Request) -> torch.Generator:
        """The generator a request draws its randomness from: its own if seeded."""
        return self._request_generator(request) or self.generator

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """One draw per row; ``logits`` is ``process``'s copy, used up in place."""
        probs = self.probs(logits, requests, consume=True)
        f64 = torch.float64
        uniforms = torch.rand(
            len(requests), generator=self.generator, dtype=f64, device=self.device
        )
        for i, r in enumerate(requests):
            gen = self._request_generator(r)
            if gen is not None and not r.sampling_params.is_greedy:
                uniforms[i] = torch.rand((), generator=gen, dtype=f64, device=self.device)
        return categorical(probs, uniforms)

    def probs(
        self, logits: torch.Tensor, requests: list[Request], *, consume: bool = False
    ) -> torch.Tensor:
        """The distribution sampled rows draw from: processed logits under temperature,
        min_p, top_k and top_p.

        ``consume``: ``logits`` is a copy the caller gives up (the sampler's processed
        copy): temperature and the exponential are applied to it in place, and weights in
        proportion to the probabilities (what ``categorical`` draws from) are returned
        without softmax's normalising pass. Each pass over a 16 x 262,144 float32 tensor,
        and each fresh 16 MB buffer's page faults, cost milliseconds a step on a CPU."""
        params = [r.sampling_params for r in requests]
        temperature = _column(
            [p.temperature if not p.is_greedy else 1.0 for p in params], self.device
        )
        logits = logits.div_(temperature) if consume else logits / temperature
        # a huge logit over a tiny temperature (the buffer is ours either way)
        logits = logits.clamp_(max=torch.finfo(logits.dtype).max)
        min_p = _column([p.min_p for p in params], self.device)
        if (min_p > 0).any():
            logits = apply_min_p(logits, min_p)
        top_k = torch.tensor([p.top_k for p in params], device=self.device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device)
        if (top_k > 0).any() or (top_p < 1).any():
            logits = apply_top_k_top_p(logits, top_k, top_p)
        if not consume:
            return logits.softmax(dim=-1)
        return logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()

    @staticmethod
    def _mask_min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
        for i, r in enumerate(requests):
            params = r.sampling_params
            if r.num_output_tokens < params.min_tokens:
                banned = set(params.stop_token_ids or ())
                if not params.ignore_eos:
                    banned |= set(r.eos_token_ids)
                banned = {t for t in banned if t < logits.shape[1]}
                if banned and r.grammar is not None:
                    # A grammar that allows only EOS now wins over min_tokens.
                    allowed = torch.isfinite(logits[i])
                    allowed[sorted(banned)] = False
                    if not allowed.any():
                        continue
                if banned:
                    logits[i, sorted(banned)] = float("-inf")

    @staticmethod
    def logprobs_of(
        raw: torch.Tensor, tokens: list[int], requests: list[Request]
    ) -> list[PositionLogprobs | None]:
        wanted = [r.sampling_params.logprobs for r in requests]
        if all(w is None for w in wanted):
            return [None] * len(requests)
        rows = [i for i, w in enumerate(wanted) if w is not None]
        logprobs = raw[rows].log_softmax(dim=-1)
        chosen = torch.tensor([tokens[i] for i in rows], device=raw.device)
        return _fill(wanted, rows, logprobs, chosen, len(requests))


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> list[PositionLogprobs]:
    """For each row: the chosen token's logprob and rank, plus the top-k tokens."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    out: list[PositionLogprobs] = []
    for j in range(logprobs.shape[0]):
        entry: PositionLogprobs = {}
        if top_vals is not None and top_ids is not None:
            for rank, (tid, val) in enumerate(
                zip(top_ids[j].tolist(), top_vals[j].tolist(), strict=True), 1
            ):
                entry[tid] = Logprob(val, rank)
        entry[int(chosen[j])] = Logprob(float(chosen_lp[j]), int(ranks[j]))
        out.append(entry)
    return out


def _fill(
    wanted: list[int | None],
    rows: list[int],
    logprobs: torch.Tensor,
    chosen: torch.Tensor,
    size: int,
) -> list[PositionLogprobs | None]:
    k = max(w or 0 for w in wanted)
    entries = top_logprobs(logprobs, chosen, k)
    out: list[PositionLogprobs | None] = [None] * size
    for j, i in enumerate(rows):
        entry = entries[j]
        keep = wanted[i] or 0
        if keep < k:  # trim the extra top entries this row did not ask for
            chosen_id = int(chosen[j])
            entry = {t: lp for t, lp in entry.items() if lp.rank <= keep or t == chosen_id}
        out[i] = entry
    return out

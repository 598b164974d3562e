"""Teacher-forced scoring: the engine's full next-token distribution at every position.

Accuracy checks of reduced precision (``tokenmill verify --quantization``) compare these
distributions with a reference's on the same token sequences, so one early difference
cannot send the rest of a sequence elsewhere. Tokens go through the engine's own decode
path one position per step, in batches of ``batch_size`` sequences, so the numbers describe
the kernels that serve real decode steps (the int kernels for small batches, the
dequantizing path above), with the engine's KV cache in its configured dtype.
"""

from __future__ import annotations

import torch

from tokenmill.core.request import Request
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.scheduled_batch import ScheduledBatch
from tokenmill.engine.llm_engine import LLMEngine


@torch.inference_mode()
def score_sequences(
    engine: LLMEngine, sequences: list[list[int]], batch_size: int = 1
) -> list[torch.Tensor]:
    """Per sequence, float32 log-probabilities [len - 1, vocab] of each next token.

    Needs an idle engine (nothing scheduled); the KV it uses is freed before returning.
    """
    if engine.has_unfinished_requests():
        raise RuntimeError("score_sequences needs an idle engine")
    results: list[torch.Tensor] = []
    for start in range(0, len(sequences), batch_size):
        batch = [
            Request(f"__score_{start + i}__", list(seq), SamplingParams(max_tokens=1))
            for i, seq in enumerate(sequences[start : start + batch_size])
        ]
        rows: list[list[torch.Tensor]] = [[] for _ in batch]
        try:
            for position in range(max(len(r.prompt_token_ids) for r in batch) - 1):
                live = [
                    (i, r) for i, r in enumerate(batch) if position < len(r.prompt_token_ids) - 1
                ]
                sched = ScheduledBatch()
                for _, request in live:
                    if engine.kv_manager.allocate(request, 1) is None:
                        raise RuntimeError("the KV cache cannot hold the sequences being scored")
                    sched.scheduled.append((request, 1))
                    sched.block_tables[request.request_id] = engine.kv_manager.block_table(
                        request.request_id
                    )
                runner = engine.runner
                hidden = runner.forward(runner.prepare_inputs(sched))
                logprobs = runner.model.compute_logits(hidden).log_softmax(dim=-1)
                for row, (i, request) in enumerate(live):
                    rows[i].append(logprobs[row].cpu())
                    request.num_computed_tokens += 1
        finally:
            for request in batch:
                engine.kv_manager.free(request)
        results.extend(torch.stack(r) for r in rows)
    engine.kv_manager.reset_prefix_cache()
    return results

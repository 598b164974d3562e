"""OutputProcessor edge cases that need a controlled detokenizer."""

from __future__ import annotations

from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.outputs import RequestOutput
from tokenmill.tokenizer import Tokenizer


class _HeldBackDetokenizer:
    """Emits nothing per token and everything at finish, like a held-back byte run."""

    def __init__(self, tail: str) -> None:
        self.tail = tail

    def add_tokens(self, ids: list[int]) -> str:
        return ""

    def finish(self) -> str:
        return self.tail


def _processor_with(
    params: SamplingParams, tail: str, tokenizer_dir
) -> tuple[OutputProcessor, Request]:
    proc = OutputProcessor(Tokenizer.from_pretrained(tokenizer_dir))
    req = Request("r", [1, 2], params)
    proc.add_request("r", None, [req])
    proc._parents["r"].children[0].detokenizer = _HeldBackDetokenizer(tail)
    return proc, req


def _finish_by_length(params: SamplingParams, tail: str, tokenizer_dir) -> RequestOutput:
    """One token, then the scheduler ends the request by length; the flush emits ``tail``."""
    proc, req = _processor_with(params, tail, tokenizer_dir)
    req.append_output_token(7)
    req.status = RequestStatus.FINISHED_LENGTH
    proc.on_token("r", 7, None)
    proc.mark_finished("r")
    (out,) = proc.collect()
    return out


def test_stop_string_in_the_final_flush_still_stops(tokenizer_dir) -> None:
    out = _finish_by_length(SamplingParams(stop=["X"], max_tokens=1), "abXcd", tokenizer_dir)
    assert out.outputs[0].text == "ab"
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "X"


def test_length_finish_without_stop_keeps_reason(tokenizer_dir) -> None:
    out = _finish_by_length(SamplingParams(stop=["X"], max_tokens=1), "abc", tokenizer_dir)
    assert out.outputs[0].text == "abc" and out.outputs[0].finish_reason == "length"

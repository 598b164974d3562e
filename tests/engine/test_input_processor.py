"""What the input processor adds to a request's prefix-cache salt: the caller's namespace (client
``cache_salt``, API key), the LoRA adapter, and the request itself when nothing may be shared."""

from __future__ import annotations

from dataclasses import replace

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine.input_processor import ProcessedRequest, request_cache_salt
from tokenmill.lora_request import LoRARequest
from tokenmill.pooling_params import PoolingParams

BASE = ProcessedRequest("r1", [1, 2, 3], None, SamplingParams(), 0, 0.0)
LORA = LoRARequest("a", 1, "/nowhere")


def test_an_unsalted_base_model_request_shares_with_every_other() -> None:
    assert request_cache_salt(BASE, enable_prefix_caching=True) is None
    assert request_cache_salt(replace(BASE, request_id="r2", nonce="n2"), True) is None


def test_the_caller_and_the_adapter_both_count() -> None:
    salted = replace(BASE, cache_salt="tenant-a")
    adapted = replace(BASE, lora_request=LORA)
    both = replace(BASE, cache_salt="tenant-a", lora_request=LORA)
    salts = [request_cache_salt(r, True) for r in (BASE, salted, adapted, both)]
    assert len(set(salts)) == 4
    # The same caller and adapter on another request: the same namespace.
    assert request_cache_salt(replace(both, request_id="r2", nonce="n2"), True) == salts[3]
    # A client salt spelled like an adapter's salt is not that adapter's namespace.
    assert request_cache_salt(replace(BASE, cache_salt=LORA.cache_salt), True) != salts[2]


def test_without_prefix_caching_each_request_is_its_own_namespace() -> None:
    salted = replace(BASE, cache_salt="tenant-a", lora_request=LORA)
    first = request_cache_salt(salted, enable_prefix_caching=False)
    assert first is not None
    assert request_cache_salt(replace(salted, nonce="another"), False) != first
    # a request id the client sent twice is still a new namespace
    assert request_cache_salt(replace(salted, request_id="r1", nonce="n2"), False) != first
    assert request_cache_salt(salted, False) == first  # its n samples share the prompt


def test_a_pooling_that_reads_every_position_shares_nothing() -> None:
    mean = replace(BASE, pooling=PoolingParams(pooling_type="MEAN"), cache_salt="tenant-a")
    assert request_cache_salt(mean, True) != request_cache_salt(
        replace(mean, nonce="another"), True
    )
    last = replace(mean, pooling=PoolingParams(pooling_type="LAST"))
    assert request_cache_salt(last, True) == request_cache_salt(
        replace(last, nonce="another"), True
    )

"""LoRA adapters: greedy tokens identical to transformers + peft (fp32) for every family,
alone and in one batch mixing three adapters with the base model."""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import FAMILIES, peft_greedy
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import InvalidRequestError
from tokenmill.lora_request import LoRARequest

MAX_NEW = 8

ADAPTERS = [
    {"seed": 1},  # every projection, r=8
    {"seed": 2, "r": 4, "target_modules": ["q_proj", "v_proj"], "use_rslora": True},
    {
        "seed": 3,
        "r": 16,
        "lora_alpha": 8,
        "target_modules": ["k_proj", "o_proj", "up_proj", "down_proj"],
        "rank_pattern": {"down_proj": 2},
        "alpha_pattern": {"o_proj": 32},
    },
]


def _prompts(vocab: int, num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(3, 40))] for _ in range(num)]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_match_peft_alone_and_mixed(
    make_model, make_adapter, reference_greedy, family: str
) -> None:
    folder = make_model(family)
    adapters = [make_adapter(folder, **options) for options in ADAPTERS]
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    llm = LLM(str(folder), dtype="float32", max_model_len=128, enable_lora=True, max_loras=3)
    prompts = _prompts(llm.tokenizer.vocab_size, 3, seed=7)
    expected = {
        lora.lora_int_id: peft_greedy(folder, path, prompts, MAX_NEW)
        for lora, path in zip(loras, adapters, strict=True)
    }
    expected[0], _ = reference_greedy(folder, prompts, MAX_NEW)
    assert expected[1] != expected[0], "the adapter changes nothing: the test would prove nothing"
    # A single request, then one adapter for a whole batch.
    for lora in loras:
        out = llm.generate(prompts[0], _greedy(), use_tqdm=False, lora_request=lora)[0]
        assert out.outputs[0].token_ids == expected[lora.lora_int_id][0], lora
        outs = llm.generate(prompts, _greedy(), use_tqdm=False, lora_request=lora)
        assert [o.outputs[0].token_ids for o in outs] == expected[lora.lora_int_id], lora
    # One batch: every prompt once with each adapter and once on the base model.
    batch = [(p, i, lora) for i, p in enumerate(prompts) for lora in [None, *loras]]
    random.Random(3).shuffle(batch)
    outs = llm.generate(
        [p for p, _, _ in batch], _greedy(), use_tqdm=False, lora_request=[lo for *_, lo in batch]
    )
    for (_, i, lora), out in zip(batch, outs, strict=True):
        want = expected[lora.lora_int_id if lora else 0][i]
        assert out.outputs[0].token_ids == want, (i, lora)


def test_more_adapters_than_slots_wait_for_one(make_model, make_adapter) -> None:
    """With max_loras=2 a third adapter's requests wait for a slot; every answer is its own;
    the CPU cache keeps adapters in use and evicts the least recently used idle ones."""
    folder = make_model("llama")
    adapters = [make_adapter(folder, **options) for options in ADAPTERS]
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=2,
        max_num_batched_tokens=64,
    )
    prompts = _prompts(llm.tokenizer.vocab_size, 3, seed=9)
    expected = {
        lo.lora_int_id: peft_greedy(folder, p, prompts, MAX_NEW)
        for lo, p in zip(loras, adapters, strict=True)
    }
    batch = [(i, lora) for lora in loras for i in range(len(prompts))]
    outs = llm.generate(
        [prompts[i] for i, _ in batch],
        _greedy(),
        use_tqdm=False,
        lora_request=[lo for _, lo in batch],
    )
    for (i, lora), out in zip(batch, outs, strict=True):
        assert out.outputs[0].token_ids == expected[lora.lora_int_id][i], (i, lora)
    manager = llm.engine.runner.lora
    assert manager is not None
    # adapters of unfinished requests are never evicted (a step never reads a folder) ...
    assert (manager.num_loads, manager.num_cpu_loras) == (3, 3)
    # ... the least recently used idle ones are, once a new one comes
    other = LoRARequest("a4", 4, str(adapters[0]))
    llm.generate(prompts[0], _greedy(), use_tqdm=False, lora_request=other)
    assert (manager.num_loads, manager.num_cpu_loras) == (4, 2)
    out = llm.generate(prompts[0], _greedy(), use_tqdm=False, lora_request=loras[0])[0]
    assert out.outputs[0].token_ids == expected[1][0] and manager.num_loads == 5


def _broken_copy(tmp_path, adapter, edit=None, drop: str | None = None):
    """A copy of an adapter folder with its config edited or one file removed."""
    import json
    import shutil

    folder = tmp_path / f"broken-{drop or 'config'}"
    shutil.copytree(adapter, folder)
    if drop:
        (folder / drop).unlink()
    if edit:
        path = folder / "adapter_config.json"
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def lora_llm(make_model) -> LLM:
    return LLM(
        str(make_model("llama")), dtype="float32", max_model_len=128, enable_lora=True, max_loras=2
    )


def test_bad_adapters_are_refused_naming_the_problem(
    tmp_path, make_model, make_adapter, lora_llm: LLM
) -> None:
    from tokenmill.model.lora import LoRAError

    folder = make_model("llama")
    good = make_adapter(folder, seed=1)
    cases = [
        (tmp_path / "nowhere", "not a readable PEFT LoRA adapter folder"),
        (
            _broken_copy(tmp_path, good, drop="adapter_config.json"),
            "not a readable PEFT LoRA adapter folder",
        ),
        (
            _broken_copy(tmp_path, good, drop="adapter_model.safetensors"),
            "not a readable PEFT LoRA adapter folder",
        ),
        (make_adapter(folder, seed=4, r=32), "rank 32, above --max-lora-rank 16"),
        (
            make_adapter(folder, seed=5, target_modules=["q_proj", "lm_head"]),
            "target module 'lm_head'",
        ),
        (
            _broken_copy(tmp_path, good, edit=lambda c: c.update(use_dora=True)),
            "DoRA (use_dora) is not supported",
        ),
        # an adapter trained on another base model: q/k/v have other shapes
        (
            make_adapter(make_model("llama", num_key_value_heads=1), seed=6),
            "an adapter for another base model",
        ),
    ]
    for i, (path, message) in enumerate(cases):
        with pytest.raises(LoRAError, match=re.escape(message)):
            lora_llm.generate(
                [5, 6, 7], _greedy(), lora_request=LoRARequest(f"bad{i}", 100 + i, str(path))
            )
    assert lora_llm.engine.list_loras() == []  # nothing half-loaded
    assert not lora_llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        LLM(str(folder), dtype="float32", max_model_len=64).generate(
            [5, 6], _greedy(), lora_request=LoRARequest("a", 1, str(good))
        )


def test_prefix_cache_is_keyed_by_adapter(make_model, make_adapter, lora_llm: LLM) -> None:
    folder = make_model("llama")
    adapter = make_adapter(folder, seed=1)
    lora = LoRARequest("a1", 1, str(adapter))
    prompt = _prompts(lora_llm.tokenizer.vocab_size, 1, seed=11)[0] * 2  # > 2 full blocks
    kv = lora_llm.engine.kv_manager.stats
    base = lora_llm.generate(prompt, _greedy())[0].outputs[0].token_ids
    hits = kv.num_hit_tokens
    tuned = lora_llm.generate(prompt, _greedy(), lora_request=lora)[0].outputs[0].token_ids
    assert kv.num_hit_tokens == hits  # the base model's blocks are not the adapter's
    assert tuned == peft_greedy(folder, adapter, [prompt], MAX_NEW)[0] != base
    again = lora_llm.generate(prompt, _greedy(), lora_request=lora)[0].outputs[0].token_ids
    assert kv.num_hit_tokens > hits and again == tuned  # its own blocks are


def test_unloading_waits_for_running_requests(make_model, make_adapter, lora_llm: LLM) -> None:
    """``remove_lora`` while its request runs: the request finishes with it, then it is freed."""
    folder = make_model("llama")
    adapter = make_adapter(folder, seed=2, r=4, target_modules=["q_proj", "v_proj"])
    lora = LoRARequest("a2", 2, str(adapter))
    engine = lora_llm.engine
    prompt = _prompts(lora_llm.tokenizer.vocab_size, 1, seed=12)[0]
    engine.add_request("x", prompt, _greedy(), lora_request=lora)
    engine.step()
    assert engine.remove_lora(2) and 2 in engine.list_loras()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].outputs[0].token_ids == peft_greedy(folder, adapter, [prompt], MAX_NEW)[0]
    assert 2 not in engine.list_loras()
    with pytest.raises(InvalidRequestError, match="was unloaded"):
        engine.add_request("y", prompt, _greedy(), lora_request=lora)


def test_static_strategy_runs_adapter_steps_eagerly(make_model, make_adapter) -> None:
    folder = make_model("llama")
    adapter = make_adapter(folder, seed=1)
    lora = LoRARequest("a1", 1, str(adapter))
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        kv_cache="static",
        max_num_seqs=2,
        compile_batch_sizes=(1,),
        enable_lora=True,
    )
    prompt = _prompts(llm.tokenizer.vocab_size, 1, seed=13)[0] * 2
    base = llm.generate(prompt, _greedy())[0].outputs[0].token_ids
    assert llm.engine.runner.num_compiled_steps > 0  # base decodes run the compiled step
    compiled = llm.engine.runner.num_compiled_steps
    tuned = llm.generate(prompt, _greedy(), lora_request=lora)[0].outputs[0].token_ids
    assert llm.engine.runner.num_compiled_steps == compiled  # adapter decodes ran eagerly
    assert tuned == peft_greedy(folder, adapter, [prompt], MAX_NEW)[0] != base
    # the slot's KV from the base run was not reused for the adapter (nor back)
    assert llm.generate(prompt, _greedy())[0].outputs[0].token_ids == base


def test_n_samples_share_the_adapter_without_prefix_caching(make_model, make_adapter) -> None:
    folder = make_model("llama")
    adapter = make_adapter(folder, seed=1)
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        enable_lora=True,
        enable_prefix_caching=False,
    )
    prompt = _prompts(llm.tokenizer.vocab_size, 1, seed=14)[0] * 2
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=2)
    out = llm.generate(prompt, params, lora_request=LoRARequest("a1", 1, str(adapter)))[0]
    want = peft_greedy(folder, adapter, [prompt], MAX_NEW)[0]
    assert [c.token_ids for c in out.outputs] == [want, want]


def _rewrite_weights(folder: Path, dest: Path, change) -> Path:  # type: ignore[no-untyped-def]
    """A copy of an adapter whose tensors went through ``change(name, tensor)``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    save_file(
        {k: change(k, v) for k, v in tensors.items()}, str(dest / "adapter_model.safetensors")
    )
    return dest


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e6])
def test_adapters_with_non_finite_weights_are_refused(
    tmp_path, make_model, make_adapter, value: float
) -> None:
    """A NaN adapter was accepted and poisoned other tenants' rows. 1e6 is finite
    in float32 but overflows float16 once scaled."""
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.lora import LoRAError, load_lora_adapter

    folder = make_model("llama")
    good = make_adapter(folder, seed=1)

    def poison(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if "layers.1.self_attn.v_proj.lora_B" in name:
            tensor = tensor.clone()
            tensor[0, 0] = value
        return tensor

    bad = _rewrite_weights(good, tmp_path / "bad", poison)
    cfg = ModelConfig.from_folder(folder)
    with pytest.raises(LoRAError, match=r"NaN or infinite|beyond torch\.float16.s range"):
        load_lora_adapter(bad, cfg, 16, torch.float16)


def test_a_rank_other_than_the_config_declares_is_refused(
    tmp_path, make_model, make_adapter
) -> None:
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.lora import LoRAError, load_lora_adapter

    folder = make_model("llama")
    declared_4 = _broken_copy(tmp_path, make_adapter(folder, seed=1), edit=lambda c: c.update(r=4))
    with pytest.raises(
        LoRAError, match=re.escape("has rank 8, but adapter_config.json declares r=4")
    ):
        load_lora_adapter(declared_4, ModelConfig.from_folder(folder), 16, torch.float32)


def test_unreadable_paths_all_give_the_same_error(tmp_path, make_model) -> None:
    """Missing, a plain file, a folder that is no adapter: one message, so a client cannot
    tell which paths exist."""
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.lora import LoRAError, load_lora_adapter

    folder = make_model("llama")
    cfg = ModelConfig.from_folder(folder)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    messages = set()
    for path in (tmp_path / "missing", a_file, folder, tmp_path):
        with pytest.raises(LoRAError) as info:
            load_lora_adapter(path, cfg, 16, torch.float32)
        messages.add(info.value.message.replace(str(path), "<path>"))
    assert len(messages) == 1, messages


def test_padding_rows_never_carry_another_slots_nan_into_row_0(make_model) -> None:
    """Rows of the step point at row 0 for padding, and a slot between two used ones runs
    over row 0 too: a NaN there (an unloaded or poisoned adapter's slot) must not reach it."""
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.lora import LoRAStacks, LoRAStepState

    cfg = ModelConfig.from_folder(make_model("llama"))
    stacks = LoRAStacks(cfg, 3, 4, torch.float32, torch.device("cpu"))
    for layer in stacks.a:
        layer["qkv"].normal_()
        layer["qkv"][1].fill_(float("nan"))  # the slot no row of this step uses
    for layer in stacks.b:
        for b in layer["qkv"]:
            b.normal_()
    rows = torch.tensor([[1, 0], [0, 0], [2, 3]])
    mask = torch.tensor([[True, False], [False, False], [True, True]]).unsqueeze(-1)
    state = LoRAStepState(stacks, 0, 3, rows, mask, frozenset({"qkv"}))
    x = torch.randn(4, cfg.hidden_size)
    y = torch.zeros(4, cfg.q_size + 2 * cfg.kv_size)
    out = state.apply(0, "qkv", x, y)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # row 0 is on the base model


def test_lora_slot_bytes_is_what_the_stacks_allocate(make_model) -> None:
    """The start-up memory check sizes LoRA slots with ``sizing.lora_slot_bytes``."""
    from tokenmill.model import sizing
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.lora import LoRAStacks

    cfg = ModelConfig.from_folder(make_model("qwen3"))
    stacks = LoRAStacks(cfg, 3, 4, torch.bfloat16, torch.device("cpu"))
    assert sizing.lora_slot_bytes(cfg, 3, 4, 2) == stacks.nbytes

"""The Hugging Face config of a GGUF file whose architecture transformers' GGUF reader cannot read.

transformers turns llama.cpp's metadata into a config for most families, but it has no mapping
for OLMo 2, and it reads a ``llama`` file with experts (Mixtral, which llama.cpp's converter
writes as ``llama`` plus ``llama.expert_count``) as a dense Llama. For those two, this module
maps the metadata keys llama.cpp's ``convert_hf_to_gguf.py`` writes (named by ``gguf.Keys``)
onto the fields of transformers' own config class, so the folder ``model/gguf_folder.py``
writes is the one ``save_pretrained`` would have written. The tensors need no mapping of ours:
gguf's ``TensorNameMap`` already names them (``model/gguf_weights.py``). What a mapping does
not read (RoPE scaling, OLMo 3's sliding window, per-expert tensors) is refused by name
(``unsupported``) rather than dropped. No torch.
"""

from __future__ import annotations

import re
from typing import Any

OWN_MODEL_TYPES = {"olmo2": "Olmo2ForCausalLM", "mixtral": "MixtralForCausalLM"}
"""The transformers model types whose config tokenmill maps itself, and their classes."""

_PER_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")
"""One tensor per expert (``blk.0.ffn_gate.3.weight``): llama.cpp's older Mixtral layout,
before its converter stacked each layer's experts into ``ffn_*_exps``."""


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _decimal(value: float) -> float:
    """A float32 field as the shortest decimal that reads back as it (``1e-06``, not the
    ``9.99999997e-07`` a float32 widened to double prints): the source config's value."""
    import numpy as np

    return float(str(np.float32(value)))


def own_model_type(reader: Any) -> str | None:
    """``olmo2`` or ``mixtral`` when this file's config is mapped here, else None (then
    transformers' GGUF reader writes it)."""
    from gguf import Keys

    arch = _field(reader, Keys.General.ARCHITECTURE)
    if arch == "olmo2":
        return "olmo2"
    experts = _field(reader, Keys.LLM.EXPERT_COUNT.format(arch=arch))
    if arch == "llama" and isinstance(experts, int) and experts > 0:
        return "mixtral"
    return None


def unsupported(reader: Any) -> str | None:
    """Why this file's mapping would lose something the model needs, or None."""
    from gguf import Keys

    model_type = own_model_type(reader)
    if model_type is None:
        return None
    arch = _field(reader, Keys.General.ARCHITECTURE)
    scaling = _field(reader, Keys.Rope.SCALING_TYPE.format(arch=arch))
    if scaling not in (None, "none"):
        return (
            f"{arch}.rope.scaling.type is {scaling!r}, but {model_type} files are read with "
            "plain RoPE only"
        )
    window = _field(reader, Keys.Attention.SLIDING_WINDOW.format(arch=arch))
    if model_type == "olmo2" and window:
        return (
            f"an olmo2 file with olmo2.attention.sliding_window {window} (OLMo 3) is not "
            "supported: tokenmill has no OLMo 3 family"
        )
    n_embd = _field(reader, Keys.LLM.EMBEDDING_LENGTH.format(arch=arch))
    n_head = _field(reader, Keys.Attention.HEAD_COUNT.format(arch=arch))
    head_dim = _field(reader, Keys.Attention.KEY_LENGTH.format(arch=arch))
    if head_dim is None and isinstance(n_embd, int) and isinstance(n_head, int) and n_head > 0:
        head_dim = n_embd // n_head
    rotary = _field(reader, Keys.Rope.DIMENSION_COUNT.format(arch=arch))
    if isinstance(rotary, int) and rotary != head_dim:
        return (
            f"{arch}.rope.dimension_count is {rotary}, not the head size {head_dim}: "
            f"{model_type} rotates whole heads"
        )
    if model_type == "mixtral":
        split = next((t.name for t in reader.tensors if _PER_EXPERT.fullmatch(t.name)), None)
        if split is not None:
            return (
                f"tensor {split!r} holds one expert on its own, llama.cpp's older Mixtral "
                "layout; tokenmill reads the stacked ffn_gate_exps, ffn_up_exps and "
                "ffn_down_exps that convert_hf_to_gguf.py writes (convert the model again)"
            )
    return None


def _required(model_type: str) -> dict[str, str]:
    """transformers field -> the ``gguf.Keys`` template it is read from (the file must hold it)."""
    from gguf import Keys

    fields = {
        "hidden_size": Keys.LLM.EMBEDDING_LENGTH,
        "intermediate_size": Keys.LLM.FEED_FORWARD_LENGTH,
        "num_hidden_layers": Keys.LLM.BLOCK_COUNT,
        "num_attention_heads": Keys.Attention.HEAD_COUNT,
        "max_position_embeddings": Keys.LLM.CONTEXT_LENGTH,
        "rms_norm_eps": Keys.Attention.LAYERNORM_RMS_EPS,
    }
    if model_type == "mixtral":
        fields["num_local_experts"] = Keys.LLM.EXPERT_COUNT
        fields["num_experts_per_tok"] = Keys.LLM.EXPERT_USED_COUNT
    return fields


def hf_config(reader: Any) -> dict[str, Any]:
    """``transformers.AutoConfig.for_model(**result)`` is this file's model config; a
    ``ValueError`` names a metadata key the file lacks."""
    from gguf import Keys

    model_type = own_model_type(reader)
    if model_type is None:
        raise ValueError("transformers' GGUF reader maps this architecture's config")
    arch = _field(reader, Keys.General.ARCHITECTURE)

    def key(template: str) -> Any:
        return _field(reader, template.format(arch=arch))

    config: dict[str, Any] = {"model_type": model_type}
    config["architectures"] = [OWN_MODEL_TYPES[model_type]]
    for name, template in _required(model_type).items():
        config[name] = key(template)
        if config[name] is None:
            raise ValueError(f"the file has no {template.format(arch=arch)}")
    config["rms_norm_eps"] = _decimal(config["rms_norm_eps"])
    tokens = reader.fields.get(Keys.Tokenizer.LIST)
    config["vocab_size"] = key(Keys.LLM.VOCAB_SIZE) or (len(tokens.data) if tokens else None)
    if config["vocab_size"] is None:
        raise ValueError(f"the file has neither {arch}.vocab_size nor a token list")
    config["num_key_value_heads"] = (
        key(Keys.Attention.HEAD_COUNT_KV) or config["num_attention_heads"]
    )
    if (head_dim := key(Keys.Attention.KEY_LENGTH)) is not None:
        config["head_dim"] = head_dim  # else the class's hidden_size // num_attention_heads
    # llama.cpp's base when the file names none (not transformers' class default)
    config["rope_theta"] = _decimal(key(Keys.Rope.FREQ_BASE) or 10000.0)
    # llama.cpp writes the output projection only when it is not the embedding matrix
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    config["bos_token_id"] = _field(reader, Keys.Tokenizer.BOS_ID)
    config["eos_token_id"] = _field(reader, Keys.Tokenizer.EOS_ID)
    config["pad_token_id"] = _field(reader, Keys.Tokenizer.PAD_ID)
    if model_type == "mixtral":
        # each expert's width: llama.cpp's llama files give it as the feed-forward length
        config["intermediate_size"] = (
            key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH) or config["intermediate_size"]
        )
        config["sliding_window"] = None  # a llama file carries no window
    return config

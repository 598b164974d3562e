"""Train the shipped demo model: a tiny Llama that writes English-like text.

Owns the whole recipe behind ``src/tokenmill/model/demo_weights/``: assembling a corpus that
every machine already has (docstrings of Python's standard library, licence texts), training
the byte-level BPE tokenizer, training the model with plain torch on CPU, measuring held-out
perplexity, and writing a standard Hugging Face folder. ``docs/demo_model.md`` records what
one run produced.

    python scripts/train_demo_model.py            # ~15 min on one CPU thread
    python scripts/train_demo_model.py --max-steps 20 --out /tmp/demo   # smoke run
    python scripts/train_demo_model.py --draft-only /tmp/draft   # untrained truncated draft
    python scripts/train_demo_model.py --train-draft   # the shipped draft, ~5 min
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from demo_corpus import (
    build_corpus,
    chat_documents,
    dependency_distributions,
    source_chars,
    word_counts,
)
from safetensors.torch import save_file
from torch import nn

from tokenmill.model.demo import (
    BOS_TOKEN,
    DEMO_DRAFT_LAYERS,
    EOS_TOKEN,
    IM_END_TOKEN,
    build_bpe_tokenizer,
    build_truncated_draft,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DRAFT_OUT = REPO_ROOT / "src/tokenmill/model/demo_draft_weights"
DRAFT_LAYERS = 1
"""The shipped draft keeps one decoder layer of the demo's four (its dims are the demo's)."""

# ~3.8M parameters: small enough that tests which start servers on the demo stay fast.
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    # The weights are stored in bfloat16 (half the bytes), but the model runs in float32 by
    # default everywhere, as the random demo did: upcasting bf16 values to fp32 is exact.
    "torch_dtype": "float32",
    "use_cache": True,
}
SEQ_LEN = 256
NUM_EVAL_SAMPLE_WINDOWS = 16


# ---------------------------------------------------------------------------- corpus


# ---------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden, self.head_dim = cfg["hidden_size"], cfg["head_dim"]
        self.num_heads, self.num_kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.view(batch, length, n, self.head_dim).transpose(1, 2)

        def rotate(t: torch.Tensor) -> torch.Tensor:  # HF Llama's rotate_half convention
            first, second = t.chunk(2, dim=-1)
            return t * cos + torch.cat((-second, first), dim=-1) * sin

        q = rotate(heads(self.q_proj(x), self.num_heads))
        k = rotate(heads(self.k_proj(x), self.num_kv_heads))
        v = heads(self.v_proj(x), self.num_kv_heads)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class TrainableLlama(nn.Module):
    """A training-only Llama whose parameter names are Hugging Face's, so the state dict ships as is.

    Written out rather than taken from transformers because it trains 25-45% faster on CPU;
    the tests check that transformers and tokenmill reproduce its held-out perplexity.
    """

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        head_dim = cfg["head_dim"]
        inv_freq = 1.0 / cfg["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(cfg["max_position_embeddings"]).float(), inv_freq)
        self.register_buffer("cos", torch.cat((angles, angles), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((angles, angles), -1).sin(), persistent=False)
        for name, param in self.named_parameters():
            if not name.endswith("norm.weight"):
                nn.init.normal_(param, std=cfg["initializer_range"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        cos, sin = self.cos[:length], self.sin[:length]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


# ---------------------------------------------------------------------------- training


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """``<s> text </s>`` per text, concatenated: the layout the engine's prompts start with."""
    bos, eos = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids += [bos, *encoding.ids, eos]
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """Non-overlapping ``[n, seq_len]`` windows; each predicts its tokens 1..seq_len-1."""
    n = len(stream) // seq_len
    return stream[: n * seq_len].view(n, seq_len)


def window_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch)
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), batch[:, 1:].reshape(-1))


@torch.no_grad()
def perplexity(model: nn.Module, batches: torch.Tensor, batch_size: int = 16) -> float:
    """exp(mean next-token loss) over all windows, in float32."""
    total, count = 0.0, 0
    for start in range(0, len(batches), batch_size):
        batch = batches[start : start + batch_size]
        total += window_loss(model, batch).item() * batch[:, 1:].numel()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


def lr_at(step: int, max_steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, max_steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: nn.Module, train_windows: torch.Tensor, heldout: torch.Tensor, args) -> dict:
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train_windows), generator=generator)
    cursor, losses, start = 0, [], time.monotonic()
    history = []
    for step in range(args.max_steps):
        if cursor + args.batch_size > len(order):
            order, cursor = torch.randperm(len(train_windows), generator=generator), 0
        batch = train_windows[order[cursor : cursor + args.batch_size]]
        cursor += args.batch_size
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.max_steps, args.lr, args.warmup_steps)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16_autocast):
            loss = window_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % args.log_every == 0 or step + 1 == args.max_steps:
            elapsed = time.monotonic() - start
            recent = sum(losses[-args.log_every :]) / len(losses[-args.log_every :])
            seen = (step + 1) * args.batch_size * SEQ_LEN
            line = f"step {step + 1}/{args.max_steps} loss {recent:.3f} tokens {seen} {seen / elapsed:.0f} tok/s"
            if (step + 1) % (args.log_every * 8) == 0:
                model.eval()
                ppl = perplexity(model, heldout)
                model.train()
                history.append({"step": step + 1, "train_loss": recent, "heldout_perplexity": ppl})
                line += f" heldout ppl {ppl:.2f}"
            print(line, flush=True)
    elapsed = time.monotonic() - start
    tail = losses[-args.log_every :]
    return {
        "steps": args.max_steps,
        "tokens_seen": args.max_steps * args.batch_size * SEQ_LEN,
        "train_seconds": round(elapsed, 1),
        "final_train_loss": round(sum(tail) / len(tail), 4),
        "history": history,
    }


# ---------------------------------------------------------------------------- output


def save_model(model: nn.Module, cfg: dict, folder: Path) -> None:
    """config.json, generation_config.json and bfloat16 weights, in Hugging Face's layout."""
    bos_id, eos_ids = cfg["bos_token_id"], cfg["eos_token_id"]
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_ids}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    weights = {
        name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()
    }
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "src/tokenmill/model/demo_weights")
    parser.add_argument("--words-out", type=Path, default=REPO_ROOT / "tests/model/demo_words.txt")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--max-steps", type=int, default=700)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--draft-only",
        type=Path,
        metavar="DIR",
        help="skip training: write the demo's speculative-decoding draft (its first "
        "DEMO_DRAFT_LAYERS layers, same tokenizer) from --out into DIR and exit",
    )
    parser.add_argument(
        "--train-draft",
        type=Path,
        nargs="?",
        const=DRAFT_OUT,
        metavar="DIR",
        help="distil the speculative-decoding draft from the demo in --out (its embeddings, "
        "head and first layer, trained to match the demo's next-token distribution on the "
        "same corpus, same tokenizer) into DIR (default: the shipped demo_draft_weights)",
    )
    parser.add_argument("--draft-steps", type=int, default=300)
    parser.add_argument(
        "--no-bf16-autocast",
        dest="bf16_autocast",
        action="store_false",
        help="train in float32 (bf16 autocast is ~15%% faster on CPUs with AVX512-BF16)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.draft_only is not None:
        # A draft is not trained here (it would cost minutes of CPU more); a truncated-layer
        # copy shares the demo's embeddings and head, so its guesses are often the demo's.
        build_truncated_draft(args.out, args.draft_only, DEMO_DRAFT_LAYERS)
        print(f"draft: {DEMO_DRAFT_LAYERS} layers of {args.out} written to {args.draft_only}")
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.train_draft is not None:
        train_draft(args)
        return
    began = time.monotonic()

    documents = build_corpus()
    train_docs = [d for d in documents if not d.is_heldout]
    heldout_docs = [d for d in documents if d.is_heldout]
    chats = chat_documents(train_docs)
    print(
        f"corpus: {len(train_docs)} training and {len(heldout_docs)} held-out documents, "
        f"{len(chats)} chat exchanges ({time.monotonic() - began:.0f}s)",
        flush=True,
    )

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_bpe_tokenizer(
        args.out, corpus="\n".join(d.text for d in train_docs), vocab_size=args.vocab_size
    )
    train_texts = [d.text for d in train_docs]
    train_stream = token_stream(tokenizer, train_texts + chats)
    heldout_stream = token_stream(tokenizer, [d.text for d in heldout_docs])
    num_chat_tokens = len(token_stream(tokenizer, chats))
    train_windows, heldout_windows = windows(train_stream), windows(heldout_stream)
    print(
        f"tokens: {len(train_stream)} training ({num_chat_tokens} in chats), "
        f"{len(heldout_stream)} held out",
        flush=True,
    )

    cfg = {
        **MODEL_CONFIG,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "bos_token_id": tokenizer.token_to_id(BOS_TOKEN),
        "eos_token_id": [tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(IM_END_TOKEN)],
    }
    model = TrainableLlama(cfg)
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {num_params} parameters, {args.max_steps} steps of "
        f"{args.batch_size}x{SEQ_LEN} tokens",
        flush=True,
    )
    result = train(model, train_windows, heldout_windows, args)

    # Measure what ships: the bfloat16-rounded weights, run in float32.
    model.eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    sample_docs, sample_stream = [], torch.empty(0, dtype=torch.long)
    for doc in heldout_docs:
        if len(sample_stream) >= NUM_EVAL_SAMPLE_WINDOWS * SEQ_LEN:
            break
        sample_docs.append(doc.text)
        sample_stream = token_stream(tokenizer, sample_docs)
    sample_windows = windows(sample_stream)[:NUM_EVAL_SAMPLE_WINDOWS]
    heldout_ppl = perplexity(model, heldout_windows)
    sample_ppl = perplexity(model, sample_windows)
    print(f"held-out perplexity {heldout_ppl:.3f} (eval sample {sample_ppl:.3f})", flush=True)

    save_model(model, cfg, args.out)
    sample = {
        "seq_len": SEQ_LEN,
        "num_windows": len(sample_windows),
        "perplexity": round(sample_ppl, 4),
        "documents": sample_docs,
    }
    (args.out / "eval_sample.json").write_text(
        json.dumps(sample, indent=1, ensure_ascii=False) + "\n"
    )
    words = [w for w, _ in sorted(word_counts(train_docs).items(), key=lambda kv: (-kv[1], kv[0]))]
    args.words_out.write_text("\n".join(words[:5000]) + "\n")
    summary = {
        "corpus": {
            "documents_train": len(train_docs),
            "documents_heldout": len(heldout_docs),
            "chars_train": sum(len(t) for t in train_texts),
            "chars_heldout": sum(len(d.text) for d in heldout_docs),
            "tokens_train": len(train_stream),
            "tokens_train_chats": num_chat_tokens,
            "tokens_heldout": len(heldout_stream),
            "chat_exchanges": len(chats),
            "chars_by_source": source_chars(documents),
        },
        "parameters": num_params,
        "batch_size": args.batch_size,
        "seq_len": SEQ_LEN,
        "peak_lr": args.lr,
        "bf16_autocast": args.bf16_autocast,
        **result,
        "heldout_perplexity": round(heldout_ppl, 4),
        "eval_sample_perplexity": round(sample_ppl, 4),
        "total_seconds": round(time.monotonic() - began, 1),
        "machine": machine_description(),
        "python": platform.python_version(),
        "dependencies": dependency_distributions(),
    }
    (args.out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2))


# ---------------------------------------------------------------------------- draft


def load_trained(folder: Path) -> tuple[TrainableLlama, dict]:
    """A shipped model folder back as a TrainableLlama (bf16 weights upcast, exactly)."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    model = TrainableLlama(cfg)
    model.load_state_dict(
        {k: v.float() for k, v in load_file(folder / "model.safetensors").items()}
    )
    return model, cfg


def distil_loss(draft: nn.Module, teacher: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """KL(teacher || draft) over next-token distributions: a draft is judged by how often
    its guesses are the target's, not by the corpus."""
    with torch.no_grad():
        target = teacher(batch).float().log_softmax(-1)
    logp = draft(batch).float().log_softmax(-1)
    vocab = logp.shape[-1]
    return F.kl_div(
        logp.reshape(-1, vocab), target.reshape(-1, vocab), log_target=True, reduction="batchmean"
    )


@torch.no_grad()
def greedy_agreement(draft: nn.Module, teacher: nn.Module, batches: torch.Tensor) -> float:
    """How often the draft's argmax is the teacher's: the greedy acceptance of one draft
    token given the true prefix (an upper bound on per-position acceptance)."""
    same = total = 0
    for start in range(0, len(batches), 16):
        batch = batches[start : start + 16]
        same += int((draft(batch).argmax(-1) == teacher(batch).argmax(-1)).sum())
        total += batch.numel()
    return same / total


def train_draft(args: argparse.Namespace) -> None:
    """Distil a ``DRAFT_LAYERS``-layer draft from the demo in ``args.out`` into ``args.train_draft``.

    Starts from the demo's embeddings, first layer(s), final norm and head (the truncated
    draft), then trains every weight on the demo's own next-token distributions over the
    demo's training corpus, tokenized with the demo's tokenizer (so the two share it).
    """
    import shutil

    from tokenizers import Tokenizer

    began = time.monotonic()
    teacher, cfg = load_trained(args.out)
    teacher.eval()
    tokenizer = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    documents = build_corpus()
    train_docs = [d for d in documents if not d.is_heldout]
    heldout_docs = [d for d in documents if d.is_heldout]
    train_windows = windows(token_stream(tokenizer, [d.text for d in train_docs]))
    heldout_windows = windows(token_stream(tokenizer, [d.text for d in heldout_docs]))
    draft_cfg = {**cfg, "num_hidden_layers": DRAFT_LAYERS}
    draft = TrainableLlama(draft_cfg)
    draft.load_state_dict(
        {
            k: v
            for k, v in teacher.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < DRAFT_LAYERS
        }
    )
    agreement_before = greedy_agreement(draft, teacher, heldout_windows)
    print(
        f"draft: {sum(p.numel() for p in draft.parameters())} parameters; held-out greedy "
        f"agreement before training {agreement_before:.3f}",
        flush=True,
    )
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr / 2, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train_windows), generator=generator)
    start, losses = time.monotonic(), []
    for step in range(args.draft_steps):
        cursor = (step * args.batch_size) % max(1, len(order) - args.batch_size)
        batch = train_windows[order[cursor : cursor + args.batch_size]]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.draft_steps, args.lr / 2, args.warmup_steps)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16_autocast):
            loss = distil_loss(draft, teacher, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % args.log_every == 0:
            recent = sum(losses[-args.log_every :]) / args.log_every
            print(
                f"draft step {step + 1}/{args.draft_steps} KL {recent:.3f} "
                f"({time.monotonic() - start:.0f}s)",
                flush=True,
            )
    draft.eval()
    with torch.no_grad():
        for param in draft.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    agreement = greedy_agreement(draft, teacher, heldout_windows)
    heldout_ppl = perplexity(draft, heldout_windows)
    print(f"held-out greedy agreement {agreement:.3f}, perplexity {heldout_ppl:.2f}", flush=True)
    out = args.train_draft
    out.mkdir(parents=True, exist_ok=True)
    save_model(draft, draft_cfg, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(args.out / name, out / name)
    tail = losses[-args.log_every :]
    summary = {
        "teacher": "demo_weights",
        "recipe": f"the demo's embeddings, first {DRAFT_LAYERS} layer(s), norm and head, "
        "distilled (KL to the demo's next-token distribution) on the demo's training corpus",
        "parameters": sum(p.numel() for p in draft.parameters()),
        "steps": args.draft_steps,
        "batch_size": args.batch_size,
        "seq_len": SEQ_LEN,
        "peak_lr": args.lr / 2,
        "final_train_kl": round(sum(tail) / max(1, len(tail)), 4),
        "heldout_greedy_agreement_before": round(agreement_before, 4),
        "heldout_greedy_agreement": round(agreement, 4),
        "heldout_perplexity": round(heldout_ppl, 4),
        "train_seconds": round(time.monotonic() - start, 1),
        "total_seconds": round(time.monotonic() - began, 1),
        "machine": machine_description(),
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

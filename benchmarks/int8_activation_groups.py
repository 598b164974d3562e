"""Which int8 activation granularity keeps a model's answers? A fake-quantization study in torch.

Every linear layer but the LM head gets int8 weights per output channel (as ``--quantization
int8``) and int8 activations with one scale per row (what the kernels do today), per group of
32 or 64 inputs, or per row with some projections left in float. Top-1 agreement and mean KL,
teacher-forced on 8 prompts x 64 greedy float32 tokens, against float32 transformers: the
quantity ``tokenmill verify`` reports. Run before writing a kernel for a granularity.

    python benchmarks/int8_activation_groups.py ~/.cache/tokenmill-real/smollm2-135m-instruct
"""

import sys

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch
import transformers

torch.set_num_threads(2)
M = sys.argv[1]
tok = transformers.AutoTokenizer.from_pretrained(M)
model = transformers.AutoModelForCausalLM.from_pretrained(M, dtype=torch.float32).eval()
prompts = [
    "The history of the Roman Empire",
    "Write a Python function that sorts a list",
    "Explain photosynthesis to a child.",
    "What is the capital of Australia? Answer:",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "def fibonacci(n):",
    "Translate to French: I like cheese.",
]
msgs = [
    tok.apply_chat_template(
        [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
    )
    if tok.chat_template
    else p
    for p in prompts
]
seqs = []
with torch.no_grad():
    for m in msgs:
        ids = tok(m, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=64, do_sample=False)
        seqs.append((ids.shape[1], out))
    ref = [model(o).logits[0, n - 1 : -1].float() for n, o in seqs]
lins = [
    (n, m)
    for n, m in model.named_modules()
    if isinstance(m, torch.nn.Linear) and "lm_head" not in n
]
orig = {n: m.weight.data.clone() for n, m in lins}


def qw(w):  # per output channel symmetric int8
    s = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    return (w / s).round().clamp(-127, 127) * s


def qx(x, group):
    sh = x.shape
    if group:
        x = x.reshape(*sh[:-1], sh[-1] // group, group)
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    x = (x / s).round().clamp(-127, 127) * s
    return x.reshape(sh)


def run(name, group, skip=()):
    hooks = []
    for n, m in lins:
        if any(k in n for k in skip):
            m.weight.data = orig[n]
            continue
        m.weight.data = qw(orig[n])
        hooks.append(m.register_forward_pre_hook(lambda mod, args, g=group: (qx(args[0], g),)))
    agree = tot = 0
    kl = 0.0
    with torch.no_grad():
        for (n, o), r in zip(seqs, ref, strict=True):
            lg = model(o).logits[0, n - 1 : -1].float()
            agree += (lg.argmax(-1) == r.argmax(-1)).sum().item()
            tot += lg.shape[0]
            kl += torch.nn.functional.kl_div(
                lg.log_softmax(-1), r.log_softmax(-1), log_target=True, reduction="sum"
            ).item()
    for h in hooks:
        h.remove()
    for n, m in lins:
        m.weight.data = orig[n]
    print(f"{name:40s} top1 {agree / tot:.3f}  KL {kl / tot:.4f}", flush=True)


run("per-row act", 0)
run("per-group-32 act", 32)
run("per-group-64 act", 64)
run("per-row, down_proj bf16", 0, ("down_proj",))
run("per-row, o_proj+down_proj float", 0, ("down_proj", "o_proj"))

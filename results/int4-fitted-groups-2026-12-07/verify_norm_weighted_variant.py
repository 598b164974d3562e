import sys, inspect, torch
import tokenmill.model.quant_int4 as qi
import tokenmill.model.loader as ld
import tokenmill.model.quant as qm
LEVELS = tuple(float(x) for x in sys.argv[2].split(","))
POWER = float(sys.argv[3])
CUR = {"imp": None}
def gain(norm):
    w = norm.weight.float()
    return (1 + w) if norm.offset else w
orig_ql = qm.quantize_linear
def ql(weight, bias, method, group_size):
    f = inspect.currentframe().f_back
    parent, name = f.f_locals["parent"], f.f_locals["name"]
    model = f.f_back.f_locals.get("model") if f.f_back else None
    imp = None
    for mod in f.f_back.f_locals["model"].modules():
        if getattr(mod, "attn", None) is parent and name == "qkv" and mod.input_norm is not None:
            imp = gain(mod.input_norm)
        if getattr(mod, "mlp", None) is parent and name == "gate_up":
            imp = gain(mod.pre_mlp_norm if mod.pre_mlp_norm is not None else mod.post_attn_norm)
    CUR["imp"] = None if imp is None or POWER == 0 else imp.abs() ** POWER
    try:
        return orig_ql(weight, bias, method, group_size)
    finally:
        CUR["imp"] = None
ld.quantize_linear = ql
def fitted(w, half):
    rows, groups, size = w.shape
    imp = CUR["imp"]
    if imp is None:
        a = torch.ones_like(w)
    else:
        pad = torch.ones(groups * size); pad[: imp.numel()] = imp / imp.mean()
        a = pad.view(1, groups, size).expand_as(w)
    A = a.sum(-1, keepdim=True)
    w_low, w_high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    aw = (a * w).sum(-1, keepdim=True)
    def codes_for(s, o):
        if half: s, o = s.half().float(), o.half().float()
        s = s.clamp(min=1e-8)
        c = torch.round((w - o) / s).clamp(0, 15)
        return c, s, o, (a * (c * s + o - w) ** 2).sum(dim=-1, keepdim=True)
    codes, scale, low, error = codes_for((w_high - w_low) / 15.0, w_low)
    for levels in LEVELS:
        grid = torch.round((w - w_low) / ((w_high - w_low) / levels).clamp(min=1e-8)).clamp(0, 15)
        for it in range(2):
            aq = (a * grid).sum(-1, keepdim=True)
            det = A * (a * grid * grid).sum(-1, keepdim=True) - aq * aq
            fit = det > 1e-20
            s = (A * (a * grid * w).sum(-1, keepdim=True) - aq * aw) / det.where(fit, 1.0)
            s = s.where(fit, scale)
            o = ((aw - s * aq) / A).where(fit, low)
            c, s, o, e = codes_for(s, o)
            better = e < error
            codes, scale, low = c.where(better, codes), s.where(better, scale), o.where(better, low)
            error = e.where(better, error)
            grid = c
    return codes, scale, low
qi._fitted_groups = fitted
from tokenmill.entrypoints.cli import main
sys.argv=['tokenmill','verify','--model',sys.argv[1],'--quantization','int4'] + sys.argv[4:]; main()

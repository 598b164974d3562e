import sys, torch
import tokenmill.model.quant_int4 as qi
LEVELS = () if sys.argv[2] == "none" else tuple(float(x) for x in sys.argv[2].split(","))
MODE = sys.argv[3]
def fitted(w, half):
    size = w.shape[-1]
    if MODE == "abs":
        a = (w * w).mean(-1, keepdim=True).sqrt() + w.abs()
    elif MODE == "sq":
        a = w * w + 1e-12
    else:
        a = torch.ones_like(w)
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
sys.argv=['tokenmill','verify','--model',sys.argv[1],'--quantization','int4']+sys.argv[4:]; main()

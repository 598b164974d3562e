"""What the int8 and int4 projections share: the base module with its row-count dispatch
(int kernel, prefill GEMM, or dequantize + GEMM), and which tokenmill kernel a projection is
stored for on this machine. ``quant`` holds the int8 projection and the factory,
``quant_int4`` the int4 one."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import envs, kernels
from tokenmill.model.layers import GATED_KERNEL_ACTS

TILES = ("amx", "vnni")
"""The kernels that read AMX tiles (``kernels/amx_layout.py``)."""
Op = Callable[..., torch.Tensor]
"""A linear op of tokenmill's kernels (``kernels.linear_int8_amx`` and its siblings)."""
EVERY_BATCH = torch.iinfo(torch.int64).max
"""``max_kernel_rows`` of a projection whose int kernel serves every batch size."""
BF16_ROWS = torch.empty(0, 1, dtype=torch.bfloat16)
"""A bf16 CPU activation, for asking ``tile_kernel_op`` which op reads the tiles now."""


_PROMPT_CHUNKS = contextvars.ContextVar("tokenmill_prompt_chunks", default=False)


@contextlib.contextmanager
def prompt_chunks(present: bool) -> Iterator[None]:
    """Say, around a step's layers, whether the step holds prefill chunks (prompt tokens, or
    a speculative step's verified tokens): a projection may then take a path a decode-only
    step must not, since the fused decode step computes those with the int kernel
    (``Int4Linear.amx_prompt_gemm_rows``)."""
    token = _PROMPT_CHUNKS.set(present)
    try:
        yield
    finally:
        _PROMPT_CHUNKS.reset(token)


def in_prompt_chunks() -> bool:
    """Whether the step running now said it holds prefill chunks (``prompt_chunks``)."""
    return _PROMPT_CHUNKS.get()


QUANTIZE_ROWS = 256
"""Output channels quantized at a time: the fp32 temporaries stay ~1 MB instead of several
copies of the whole weight, which the C allocator then kept resident after loading."""


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activation dtype the int kernels run in: half as it is, fp32 rounded to bf16."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


class QuantizedLinear(nn.Module):
    """Common part of the int8 and int4 projections: bias, shapes, the row-count dispatch."""

    max_kernel_rows = 0
    """Rows up to which the int kernel beats dequantize + GEMM."""
    kernel: str | None
    """Which tokenmill kernel serves this projection: amx, vnni, rows, channels8 (int4), or
    None (torch's)."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.has_gemv = True
        """Whether the int kernel may serve small batches (else dequantize + GEMM always)."""
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._fast: tuple[Op, tuple[object, ...], str] | None = None
        """(op, its arguments after x, the ISA they were taken for): the whole forward of a
        projection whose kernel serves every batch, for the decoder's bf16 [tokens, hidden]
        rows. One stream calls ~65 projections a step; the general path (module buffer
        lookups, dispatch checks, reshape, casts, a separate bias add) cost ~15 us each."""

    def gated(
        self, x: torch.Tensor, act_and_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor | None:
        """As ``Linear.gated``: on a prefill chunk that runs as a bf16 GEMM from weights
        rebuilt in GEMV blocks (``_prefill_blocks``), the activation in the GEMM's epilogue
        on AMX (after it, in the same op, elsewhere); None elsewhere (the int kernels have no gated epilogue), and the MLP runs it after."""
        act = GATED_KERNEL_ACTS.get(act_and_mul)
        blocks = None if act is None else self._prefill_blocks(x)
        if blocks is None or act is None:
            return None
        flat = x.reshape(-1, self.in_features)
        y = kernels.gemv_bf16_act(flat, blocks, self.out_features, self.bias, act)
        return y.view(*x.shape[:-1], -1)

    def _kernel_call(
        self, x: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[Op, tuple[object, ...]] | None:
        """tokenmill's op for activations like ``x`` now, and its arguments after x (with
        ``bias``), or None where no tokenmill kernel takes them."""
        return None

    def _refresh_fast_path(self) -> None:
        fast = (
            self._kernel_call(BF16_ROWS, self.bias) if self.max_kernel_rows == EVERY_BATCH else None
        )
        self._fast = None if fast is None else (*fast, kernels.active_isa())

    def _apply(self, fn: Callable[..., torch.Tensor], recurse: bool = True) -> QuantizedLinear:
        result = super()._apply(fn, recurse)
        self._refresh_fast_path()  # the buffers may be new tensors now
        return result

    dequantized_gemm_rows: int | None = None
    """Rows (a prefill chunk's tokens) from which the projection dequantizes its weight to fp32
    (``_dequantized_weight``) and runs torch's fp32 GEMM instead of its int kernel; None: never."""

    amx_dequantized_gemm_rows = 257
    """The same where AMX-BF16 is active and the activations are bf16: the weight is rebuilt
    in bf16 and the GEMM runs on the tiles: tokenmill's on GEMV blocks where the layout
    rebuilds into them (``_dequantized_blocks``: int4 groups of 32 quantized at load, the
    MLP's activation then in the GEMM's epilogue), else oneDNN's through torch on rows.
    Against the rows and torch's GEMM, the blocks ran the 250M model's int4 prompt steps
    1.4-1.9x faster in alternating pairs, SmolLM2's and Gemma 3's level within the noise
    (``results/int4-prefill-blocks-amx-2026-12-07/``). On the AMX Xeon at 2
    threads over SmolLM2's projections (int4 groups of 32,
    ``results/int4-avx512-amx-2026-12-06/int4_prefill_amx.py``) it took 0.3-0.5x the int
    kernel's time at 256 rows and 0.15-0.25x at 2048, and 0.7-0.9x at 64. One above the
    default ``--max-num-seqs`` (256), so a decode step stays on the int kernel, as the fused
    decode step computes it."""

    def _dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The weight [out, in] in ``dtype`` (float32 or bfloat16) for the prefill GEMM, or
        None where this layout has no such path."""
        return None

    def _dequantized_blocks(self) -> torch.Tensor | None:
        """The weight in bf16 ``gemv_layout`` blocks for the AMX-BF16 prefill GEMM (tokenmill's
        own, which fuses the MLP's activation), or None where this layout has no such path
        (then the bf16 rows of ``_dequantized_weight`` go to torch's GEMM)."""
        return None

    avx512_dequantized_gemm_rows: int | None = None
    """The same on AVX-512 with BF16 dot products and no AMX (Zen 4/5), for the layouts whose
    int kernel loses to it there (None: the int kernel, then the fp32 GEMM from
    ``dequantized_gemm_rows`` if ``_fp32_gemm_wins``): the weight rebuilt in bf16 and
    multiplied by oneDNN's bf16 GEMM through torch (or ``kernels.gemv_bf16`` from GEMV
    blocks)."""

    def _bf16_gemm_rows(self) -> int | None:
        """Rows from which a bf16 prefill chunk runs as a bf16 GEMM of the rebuilt weight on
        this machine now (AMX-BF16 tiles, or AVX-512 BF16 dot products), or None."""
        if kernels.amx_bf16_active():
            return self.amx_dequantized_gemm_rows
        if kernels.active_isa() == "avx512_bf16":
            return self.avx512_dequantized_gemm_rows
        return None

    def _fp32_gemm_wins(self) -> bool:
        """Whether dequantize + torch's fp32 GEMM beats the int kernel from
        ``dequantized_gemm_rows`` rows on, with the kernel table active now."""
        return True

    def _on_bf16_gemm(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is a prefill chunk for the bf16 GEMM of the rebuilt weight."""
        rows = self._bf16_gemm_rows()
        return (
            rows is not None
            and x.dtype == torch.bfloat16
            and self.dequantized_gemm_rows is not None
            and x.numel() >= rows * self.in_features
            and kernels.supports(x)
            and not envs.is_off(envs.PREFILL_GEMM)
        )

    def _prefill_blocks(self, x: torch.Tensor) -> torch.Tensor | None:
        """The GEMV blocks for ``x``'s product where it runs as a bf16 GEMM from them, else
        None."""
        return self._dequantized_blocks() if self._on_bf16_gemm(x) else None

    def _prefill_gemm(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x``'s product by the GEMM of the dequantized weight (activations exact: fp32, or
        bf16 on AMX-BF16 and AVX-512 BF16), where ``x`` has ``dequantized_gemm_rows`` rows or
        more (``amx_dequantized_gemm_rows`` on AMX-BF16, ``avx512_dequantized_gemm_rows``
        on AVX-512 BF16); else None."""
        rows = self.dequantized_gemm_rows
        if rows is None or not kernels.supports(x) or envs.is_off(envs.PREFILL_GEMM):
            return None
        bf16_gemm = self._on_bf16_gemm(x)
        if not bf16_gemm and (x.numel() < rows * self.in_features or not self._fp32_gemm_wins()):
            return None
        blocks = self._dequantized_blocks() if bf16_gemm else None
        if blocks is not None:
            flat = x.reshape(-1, self.in_features)
            y = kernels.gemv_bf16(flat, blocks, self.out_features, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        weight = self._dequantized_weight(torch.bfloat16 if bf16_gemm else torch.float32)
        if weight is None:
            return None
        if bf16_gemm:
            return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), weight, bias).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prefill = self._prefill_gemm(x)
        if prefill is not None:
            return prefill
        fast = self._fast
        if (
            fast is not None
            and x.dtype == torch.bfloat16
            and x.dim() == 2
            and x.stride(1) == 1
            and fast[2] == kernels.active_isa()  # tests switch the ISA after load
        ):
            return fast[0](x, *fast[1])
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] <= self.max_kernel_rows and self.has_gemv:
            y = self._gemv(flat).to(x.dtype)
        else:
            y = F.linear(flat, self.dequantize(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` with float32 outputs (an LM head's logits). Here the kernel's own
        outputs, widened; ``Int8Linear`` overrides it with ops that never round."""
        return self(x).float()

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        call = self._kernel_call(x, None)
        if call is not None:
            return call[0](x.to(torch.bfloat16), *call[1])
        if self.kernel is not None:  # the ISA was switched after load (tests): stay correct
            return F.linear(x, self.dequantize(x.dtype))
        return self._torch_gemv(x)

    def _torch_gemv(self, x: torch.Tensor) -> torch.Tensor:
        """torch's int kernel, for layers stored in its packing (no tokenmill kernels)."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in ``dtype``, rebuilt from its quantized form."""
        raise NotImplementedError


def kernel_for(weight: torch.Tensor, tiles_ok: bool) -> str | None:
    """The tokenmill kernel a projection is stored for: amx or vnni (both read AMX tiles),
    rows (the AVX2 table, or a shape the tiles do not take), or None for torch's."""
    if weight.device.type != "cpu" or not kernels.available():
        return None
    if not tiles_ok:
        return "rows"
    if kernels.amx_active():
        return "amx"
    return "vnni" if kernels.active_isa() == "avx512_bf16" else "rows"


def w8a8_rows() -> bool:
    """Whether the row-major int kernels quantize activations (the AVX2 table's W8A8, int4
    in groups of 32+): then they beat dequantize + GEMM in the activation dtype at every row
    count (measured on the 250M model's MLP shapes at 16-512 rows, 2 threads: 1.3-7x, fp32
    and bf16 activations), so they serve every batch like the tile kernels; only prefill
    chunks of 512+ rows go to torch's fp32 GEMM (``dequantized_gemm_rows``)."""
    return kernels.active_isa() == "avx2"


def tile_kernel_op(kernel: str | None, x: torch.Tensor, amx_op: Op, vnni_op: Op) -> Op | None:
    """The op that reads the tile layout for ``x`` now: AMX where granted, else the VNNI
    kernels while the avx512 table is active; None (another path) otherwise."""
    if kernel == "amx" and kernels.amx_active():
        return amx_op
    if kernel in TILES and kernels.supports(x, float32=True):
        return vnni_op if kernels.active_isa() == "avx512_bf16" else None
    return None

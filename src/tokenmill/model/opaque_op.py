"""``opaque_op``: a Python function registered as a plain ``tokenmill::`` dispatcher op.

Why not ``torch.library.custom_op``: its Python wrapper runs on every call, also inside a
compiled graph (argument defaults filled in, aliasing checked, version counters bumped
for mutated arguments, a dynamo-disable context entered). The compiled static decode
step calls such an op several times per layer, so that wrapper was a large share of a
small model's decode step. Registered with ``torch.library.Library`` the dispatcher
calls the function directly; the schema (mutations included) and the fake kernel are the
same, so torch.compile treats the op exactly as before (opaque, cache writes declared).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

_LIB = torch.library.Library("tokenmill", "FRAGMENT")
_F = TypeVar("_F", bound=Callable[..., Any])


def opaque_op(name: str, mutates_args: Iterable[str] = ()) -> Callable[[_F], _F]:
    """Register ``fn`` as ``torch.ops.tokenmill.<name>`` (every device, no autograd);
    the function itself is returned unchanged. Give it a fake with ``register_fake``."""

    def register(fn: _F) -> _F:
        schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
        _LIB.define(name + schema)
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        return fn

    return register


def register_fake(name: str) -> Callable[[_F], _F]:
    """The op's shape function for FakeTensor tracing (torch.compile)."""

    def register(fn: _F) -> _F:
        torch.library.register_fake("tokenmill::" + name, lib=_LIB)(fn)
        return fn

    return register

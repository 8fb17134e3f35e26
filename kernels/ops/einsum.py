"""Einsum on ``shaders/einsum.comp``: any equation (ellipsis, implicit output, diagonals,
broadcast ellipsis dimensions), evaluated as a left-to-right chain of pairwise strided
contractions; intermediates live in the workspace. float32, int64 and int32."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d, serial_pieces,
    type_defines,
)
from vkpool.kernels.ops.attrs import str_attr

_DTYPES = (np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32))


def parse_equation(equation: str, ranks: Sequence[int]) -> tuple[list[str], str]:
    """Operand subscripts and output subscripts with '...' expanded into private symbols
    (right-aligned across operands, as numpy broadcasts them)."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise OpError(f"Einsum: equation {equation!r} has {len(terms)} operands, got {len(ranks)} inputs")
    ell_rank = 0
    for term, rank in zip(terms, ranks):
        letters = len(term.replace("...", ""))
        if "..." in term:
            ell_rank = max(ell_rank, rank - letters)
        elif letters != rank:
            raise OpError(f"Einsum: subscripts {term!r} do not match an input of rank {rank}")
    ell = [chr(0x100 + k) for k in range(ell_rank)]
    out_terms = []
    for term, rank in zip(terms, ranks):
        if "..." in term:
            n = rank - len(term.replace("...", ""))
            term = term.replace("...", "".join(ell[ell_rank - n:]))
        out_terms.append(term)
    if arrow:
        out = rhs.replace("...", "".join(ell))
    else:
        counts: dict[str, int] = {}
        for t in out_terms:
            for c in t:
                counts[c] = counts.get(c, 0) + 1
        out = "".join(ell) + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ell))
    return out_terms, out


@dataclass
class _Step:
    a: int                 # operand index, or -(k+1) for the result of step k
    b: int | None
    out: str               # letters of this step's result, in order
    extents: dict[str, int]
    terms: tuple[str, ...]


class Einsum(Op):
    op_type = "Einsum"

    def check(self) -> None:
        xs = [self.input(i) for i in range(len(self.inputs))]
        if not xs:
            raise OpError("Einsum: no inputs")
        dtype = xs[0].dtype
        if dtype not in _DTYPES or any(x.dtype != dtype for x in xs):
            raise UnsupportedOp(f"Einsum: element type {dtype} has no kernel")
        self.equation = str_attr(self, "equation", "")
        terms, out = parse_equation(self.equation, [len(x.shape) for x in xs])
        extents: dict[str, int] = {}
        for term, x in zip(terms, xs):
            for c, n in zip(term, x.shape):
                if extents.get(c, 1) not in (1, n) and n != 1:
                    raise OpError(f"Einsum: letter {c!r} has extents {extents[c]} and {n}")
                extents[c] = max(extents.get(c, 1), n)
        if any(c not in extents for c in out):
            raise OpError(f"Einsum: output letter not in any input of {self.equation!r}")
        self.terms, self.out, self.extents = terms, out, extents
        self.out_shape = tuple(extents[c] for c in out)
        # left-to-right chain: keep a letter while the output or a later operand needs it
        self.steps: list[_Step] = []
        cur, cur_term = 0, terms[0]
        for k in range(1, max(2, len(terms))):
            other = k if k < len(terms) else None
            later = "".join(terms[k + 1:]) + out
            seen = cur_term + (terms[k] if other is not None else "")
            keep = "".join(dict.fromkeys(c for c in seen if c in later))
            if other is None or k == len(terms) - 1:
                keep = out
            self.steps.append(_Step(cur, other, keep, extents,
                                    (cur_term,) + ((terms[k],) if other is not None else ())))
            cur, cur_term = -len(self.steps), keep

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.input(0).dtype)]

    def _size(self, letters: str) -> int:
        return math.prod(self.extents[c] for c in letters)

    def workspace_bytes(self) -> int:
        inter = [self._size(s.out) for s in self.steps[:-1]]
        return 2 * self.input(0).dtype.itemsize * max(inter) if inter else 0

    def flops(self) -> int:
        return sum(2 * self._size("".join(dict.fromkeys("".join(s.terms)))) for s in self.steps)

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        xs = [x for x in inputs if x is not None]
        letters = sorted(set("".join(self.terms)))
        names = {c: chr(ord("a") + i) if i < 26 else chr(ord("A") + i - 26) for i, c in enumerate(letters)}
        eq = ",".join("".join(names[c] for c in t) for t in self.terms) + "->" + "".join(names[c] for c in self.out)
        return [np.asarray(np.einsum(eq, *xs)).astype(xs[0].dtype).reshape(self.out_shape)]

    @staticmethod
    def _strides(term: str, shape: Sequence[int]) -> dict[str, int]:
        strides: dict[str, int] = {}
        acc = 1
        for c, n in zip(reversed(term), reversed(list(shape))):
            if n != 1:
                strides[c] = strides.get(c, 0) + acc
            acc *= n
        return strides

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        dtype = self.input(0).dtype
        half = self.workspace_bytes() // 2
        out: list[Dispatch] = []
        results: list[Ptr] = []
        for k, step in enumerate(self.steps):
            last = k == len(self.steps) - 1
            def src(i: int) -> tuple[Ptr, tuple[int, ...]]:
                if i >= 0:
                    return Ptr(ctx.inputs[i]), self.input(i).shape
                prev = self.steps[-i - 1]
                return results[-i - 1], tuple(self.extents[c] for c in prev.out)
            pa, sha = src(step.a)
            sa = self._strides(step.terms[0], sha)
            if step.b is not None:
                pb, shb = src(step.b)
                sb = self._strides(step.terms[1], shb)
            else:
                pb, sb = pa, {}
            summed = [c for c in dict.fromkeys("".join(step.terms)) if c not in step.out]
            dst = Ptr(ctx.outputs[0]) if last else Ptr(ctx.workspace, (k % 2) * half)
            nout, nsum = self._size(step.out), self._size("".join(summed))
            lst = lambda vals: ",".join(str(v) for v in list(vals) + [1])  # noqa: E731
            defines = {
                "NO": len(step.out), "NS": len(summed), "NOUT": nout, "NSUM": nsum,
                "OEXT": lst(self.extents[c] for c in step.out), "OSA": lst(sa.get(c, 0) for c in step.out),
                "OSB": lst(sb.get(c, 0) for c in step.out), "SEXT": lst(self.extents[c] for c in summed),
                "SSA": lst(sa.get(c, 0) for c in summed), "SSB": lst(sb.get(c, 0) for c in summed),
                "ONE_OPERAND": int(step.b is None), **type_defines(dtype),
            }
            results.append(dst)
            if nout:
                # a long sum runs as several dispatches, each adding its piece to what the last wrote
                out += [Dispatch("einsum", [pa, pb, dst, U32(start), U32(count)], groups_1d(nout, 64, ctx.caps),
                                 defines)
                        for start, count in serial_pieces(nsum, len(summed) + 1, ctx.caps, "Einsum")]
        return out


__all__ = ["Einsum", "parse_equation"]

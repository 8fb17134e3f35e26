"""Attention (opset 23+) on ``shaders/attention.comp`` (+ ``kv_concat.comp`` for the KV cache).

Supported: 3-D and 4-D Q/K/V, grouped heads (q_num_heads a multiple of kv_num_heads), bool
or float ``attn_mask`` broadcast over (batch, heads, query), masks shorter than the key length
(missing columns masked), ``is_causal`` aligned bottom-right on the cache, ``scale``,
``softcap``, ``past_key``/``past_value`` with ``present_*`` outputs, ``nonpad_kv_seqlen``,
sliding windows, and every ``qk_matmul_output_mode``. Scores and softmax are float32 whatever
``softmax_precision`` asks (float32 is at least as precise as any type it may name for float32
inputs). float16 Q/K/V (and a float16 mask) have the same kernels, read widened, computed in float32
and Y rounded once; without a KV cache, present outputs or the ``qk_matmul_output`` stage.

``packed_qkv`` (vkpool's own attribute, set by ``vkpool.fusion`` on float16 graphs, never in a
file): Q, K and V are side by side in input 0, one [B, S, Eq + Ek + Ev] tensor (one product of
the three projections), their sizes the attribute's three values; inputs 1 and 2 are absent.
The kernels read each from its columns (``QKV_ROW``: the packed row's length).

float16 attention without a KV cache on a device with cooperative matrices takes
``attention_coop.comp`` where a head's whole rows of scores fit its shared memory (16 query rows
per workgroup, the products on cooperative matrices, each row's softmax once over the whole row).
Otherwise three kernels: ``attention_tiled.comp`` (16 query rows per workgroup, keys and values through
shared memory in tiles with an online softmax) wherever the ``qk_matmul_output`` stage is not
asked for and a tile fits the device's shared memory; on a CPU-like device
(``DeviceCaps.cpu_like``) ``attention_rows.comp`` instead (a query row per invocation, its
online softmax in registers, no shared memory or barrier) where its loops fit the device's
limit; else ``attention.comp`` (one workgroup per query row, the scores in a workspace row).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from vkpool.kernels.base import (
    F32, LOOP_SLACK, DeviceCaps, Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, UnsupportedOp, check_grid,
    check_serial,
    groups_1d,
)
from vkpool.kernels.ops.gemm import ptr_at


_F32, _F16 = np.dtype(np.float32), np.dtype(np.float16)


class Attention(Op):
    op_type = "Attention"

    def check(self) -> None:
        self.packed: tuple[int, int, int] | None = None
        self.product: Any = None
        if self.attr("product"):
            self._setup_product()
        if self.attr("packed_qkv") is not None:
            self._unpack()
        q, k, v = self.input(0), self.input(1), self.input(2)
        for t in (q, k, v):
            if t.dtype not in (_F32, _F16) or t.dtype != q.dtype:
                raise UnsupportedOp(f"Attention: element types {q.dtype}, {k.dtype}, {v.dtype} have no kernel "
                                    "(float32 or float16, one type for Q, K and V)")
        self.half = q.dtype == _F16
        if self.half and (self.has_input(4) or self.has_input(5) or self.num_outputs > 1):
            raise UnsupportedOp("Attention: float16 has no kernel for a KV cache, present outputs or qk_matmul_output")
        rank = len(q.shape)
        if rank not in (3, 4) or len(k.shape) != rank or len(v.shape) != rank:
            raise OpError(f"Attention: Q/K/V must all be 3-D or all 4-D, got {q.shape}, {k.shape}, {v.shape}")
        self.is3d = rank == 3
        self.b = q.shape[0]
        if self.is3d:
            hq, hkv = self.attr("q_num_heads"), self.attr("kv_num_heads")
            if not hq or not hkv:
                raise OpError("Attention: 3-D inputs need q_num_heads and kv_num_heads")
            self.hq, self.hkv = int(hq), int(hkv)
            self.s, self.l = q.shape[1], k.shape[1]
            if q.shape[2] % self.hq or k.shape[2] % self.hkv or v.shape[2] % self.hkv:
                raise OpError("Attention: hidden sizes are not multiples of the head counts")
            self.d, self.dv = q.shape[2] // self.hq, v.shape[2] // self.hkv
            if k.shape[2] // self.hkv != self.d:
                raise OpError("Attention: Q and K head sizes differ")
        else:
            self.hq, self.s, self.d = q.shape[1], q.shape[2], q.shape[3]
            self.hkv, self.l, self.dv = k.shape[1], k.shape[2], v.shape[3]
            if k.shape[3] != self.d or v.shape[1] != self.hkv or v.shape[2] != self.l:
                raise OpError(f"Attention: K {k.shape} / V {v.shape} do not match Q {q.shape}")
        if self.hq % self.hkv:
            raise OpError(f"Attention: {self.hq} query heads do not group over {self.hkv} KV heads")
        self.has_past = self.has_input(4)
        if self.has_past != self.has_input(5):
            raise OpError("Attention: past_key and past_value come together")
        self.past = self.input(4).shape[2] if self.has_past else 0
        if self.has_past and (self.input(4).dtype != np.float32 or self.input(5).dtype != np.float32):
            raise UnsupportedOp("Attention: only float32 KV caches")
        self.t = self.past + self.l
        self.has_nonpad = self.has_input(6)
        if self.has_nonpad and self.has_past:
            raise OpError("Attention: nonpad_kv_seqlen cannot be combined with past_key/past_value")
        self.mask_shape: tuple[int, ...] | None = None
        if self.has_input(3):
            m = self.input(3)
            if m.dtype not in (_F32, np.dtype(np.bool_), q.dtype):
                raise UnsupportedOp(f"Attention: mask type {m.dtype} has no kernel with {q.dtype} Q")
            if not 1 <= len(m.shape) <= 4:
                raise OpError(f"Attention: mask rank {len(m.shape)}")
            ms = (1,) * (4 - len(m.shape)) + tuple(m.shape)
            for got, full in zip(ms[:3], (self.b, self.hq, self.s)):
                if got not in (1, full):
                    raise OpError(f"Attention: mask {m.shape} does not broadcast to {(self.b, self.hq, self.s, self.t)}")
            if ms[3] > self.t:
                raise OpError(f"Attention: mask has {ms[3]} key columns for {self.t} keys")
            self.mask_shape = ms
        self.scale = float(self.attr("scale", 1.0 / math.sqrt(self.d))) if self.attr("scale") is not None \
            else 1.0 / math.sqrt(self.d)
        self.softcap = float(self.attr("softcap", 0.0) or 0.0)
        self.causal = bool(self.attr("is_causal", 0))
        self.qk_mode = int(self.attr("qk_matmul_output_mode", 0))
        if self.qk_mode not in (0, 1, 2, 3):
            raise OpError(f"Attention: qk_matmul_output_mode {self.qk_mode}")
        self.wl = int(self.attr("left_window_size", -1))
        self.wr = int(self.attr("right_window_size", -1))

    def _setup_product(self) -> None:
        """``product`` (vkpool's own attribute, set by ``vkpool.fusion`` with ``packed_qkv``): input
        0 is A and inputs 7 and 8 the constant weights W and the bias of the packed Q/K/V product
        A @ W + bias, which the op computes itself. Split over K on a device with cooperative
        matrices, its float32 partial sums are added as ``attention_coop.comp`` stages Q, K and V
        (no pass of their own); otherwise the product writes the packed tensor into the workspace,
        where the attention kernels read it."""
        from vkpool.kernels.ops.gemm_f16 import fused_product_plan

        a = self.input(0)
        if len(a.shape) != 3:
            raise UnsupportedOp(f"Attention: a fused product needs a 3-D A, got {a.shape}")
        self.product = fused_product_plan(self, 0, 7, 8)
        n = self.product.p.N
        self.inputs[0] = TensorInfo((a.shape[0], a.shape[1], n), _F16)  # the packed Q/K/V the product makes

    def _product_regions(self) -> tuple[int, int]:
        """Byte offsets in the workspace of the product's partial sums and of its packed output."""
        own = -(-self._own_workspace() // 256) * 256
        return own, own + -(-self.product.workspace_bytes() // 256) * 256

    def _unpack(self) -> None:
        """Q, K and V's infos from the packed input 0 (``packed_qkv``)."""
        sizes = tuple(int(n) for n in self.attr("packed_qkv"))
        qkv = self.input(0)
        if len(sizes) != 3 or min(sizes) < 1 or len(qkv.shape) != 3 or sum(sizes) != qkv.shape[2] \
                or self.has_input(1) or self.has_input(2):
            raise OpError(f"Attention: packed_qkv {sizes} does not split a [B, S, {sum(sizes)}] input 0 "
                          f"(got {qkv.shape}, with inputs 1 and 2 absent)")
        self.packed = sizes  # type: ignore[assignment]
        b, s, _ = qkv.shape
        self.inputs[0:3] = [TensorInfo((b, s, n), qkv.dtype) for n in sizes]

    # -- shapes and costs ---------------------------------------------------------------------
    def output_infos(self) -> list[TensorInfo]:
        f = self.input(0).dtype
        y = (self.b, self.s, self.hq * self.dv) if self.is3d else (self.b, self.hq, self.s, self.dv)
        outs = [TensorInfo(y, f), TensorInfo((self.b, self.hkv, self.t, self.d), f),
                TensorInfo((self.b, self.hkv, self.t, self.dv), f), TensorInfo((self.b, self.hq, self.s, self.t), f)]
        return outs[: max(1, self.num_outputs)]

    def _own_workspace(self) -> int:
        return 4 * self.b * self.hq * self.s * self.t

    def workspace_bytes(self) -> int:
        if self.product is None:
            return self._own_workspace()
        return self._product_regions()[1] + 2 * self.product.p.M * self.product.p.N

    def flops(self) -> int:
        own = 2 * self.b * self.hq * self.s * self.t * (self.d + self.dv)
        return own + (self.product.flops() if self.product is not None else 0)

    def _tile_keys(self, caps: DeviceCaps | None) -> int | None:
        """Keys per tile of ``attention_tiled.comp`` (the most of 64, 32, 16 whose shared memory
        fits the device and that the keys fill), or None where no tile fits or the device runs
        fewer than its 256 invocations per workgroup."""
        limit = caps.shared_memory_bytes if caps is not None else 16384
        if caps is not None and caps.max_workgroup_invocations < 256:
            return None
        for kb in (64, 32, 16):
            if kb > 16 and kb // 2 >= self.t:
                continue
            floats = 16 * (self.d + 1) + kb * (self.d + 1) + kb * self.dv + 16 * kb + 16 * 16
            tiles = -(-self.t // kb)
            serial = tiles * (kb * (self.d + self.dv) // 256 + 2 + kb // 16 * self.d + 32 + -(-self.dv // 16) * kb)
            if 4 * floats <= limit and (caps is None or not caps.max_loop_iterations or serial + LOOP_SLACK <= caps.max_loop_iterations):
                return kb
        return None

    def _coop_defines(self, caps: DeviceCaps | None) -> dict[str, int] | None:
        """The defines of ``attention_coop.comp`` where it runs: float16 without a KV cache on a
        device with 16 x 16 x 16 float16 cooperative matrices, head sizes multiples of 16, every
        Q/K/V row start a multiple of 8 halves (16-byte vectors), and the whole rows of scores
        (T rounded up to 16) fitting the device's shared memory; else None."""
        if caps is None or not self.half or self.has_past or not caps.cooperative_matrix or not caps.float16 \
                or (16, 16, 16) not in caps.cooperative_matrix_f16 or caps.max_workgroup_invocations < 128 \
                or 128 % caps.subgroup_size or self.d % 16 or self.dv % 16:
            return None
        if self.packed is not None and any(n % 8 for n in self.packed):
            return None
        tp = -(-self.t // 16) * 16
        # Q's rows, the keys (then the values), the scores (then the output), the probabilities,
        # the rows' maxima and sums
        shared = 16 * self.d * 2 + tp * max(self.d, self.dv) * 2 + 16 * max(tp, self.dv) * 4 + 16 * tp * 2 + 16 * 9 * 4
        if shared > caps.shared_memory_bytes:
            return None
        # the values in memory of their own where it fits (staged with the keys: one wait on memory)
        apart = shared - tp * max(self.d, self.dv) * 2 + tp * (self.d + self.dv) * 2 <= caps.shared_memory_bytes
        # a row's 8 invocations in one subgroup (every device with cooperative matrices met has
        # subgroups of 8 or more)
        shuffle = caps.subgroup_shuffle and caps.subgroup_size >= 8
        return {"TP": tp, "V_APART": int(apart), "ROW_SHUFFLE": int(shuffle)}

    def _rows_defines(self, caps: DeviceCaps | None) -> dict[str, int] | None:
        """The defines of ``attention_rows.comp`` on a CPU-like device whose loop limit its
        invocations stay within, else None."""
        if caps is None or not caps.cpu_like:
            return None
        wg = caps.subgroup_size if caps.subgroup_shuffle and caps.subgroup_size <= 64 else 8
        kb = 8
        dp, dvp = -(-self.d // wg) * wg, -(-self.dv // wg) * wg
        # per key its score (DP/WG loads, DP shuffles) and its share of the output (DVP/WG, DVP);
        # per block of keys one rescale of the output row
        serial = (self.t * ((dp + dvp) * (wg + 1) // wg + 4) + -(-self.t // kb) * (dvp + 2 * kb)
                  + dp + 2 * dvp)
        if wg > caps.max_workgroup_invocations or \
                (caps.max_loop_iterations and serial + LOOP_SLACK > caps.max_loop_iterations):
            return None
        shuffle = int(caps.subgroup_shuffle and caps.subgroup_size == wg)
        return {"WG": wg, "KB": kb, "DP": dp, "DVP": dvp, "SHUFFLE": shuffle}

    # -- numpy reference ----------------------------------------------------------------------
    def _bias(self, mask: np.ndarray | None, nonpad: np.ndarray | None) -> np.ndarray:
        b, hq, s, t = self.b, self.hq, self.s, self.t
        bias = np.zeros((b, hq, s, t), np.float32)
        if mask is not None:
            m = mask.reshape(self.mask_shape)
            full = np.zeros(self.mask_shape[:3] + (t,), np.float32)
            width = m.shape[3]
            full[..., width:] = -np.inf
            full[..., :width] = np.where(m, 0, -np.inf) if m.dtype == np.bool_ else m
            bias = bias + full
        i = np.arange(s).reshape(1, 1, s, 1)
        j = np.arange(t).reshape(1, 1, 1, t)
        offset = (nonpad.reshape(-1, 1, 1, 1) - s) if nonpad is not None else self.past
        diff = i + offset - j
        allowed = np.ones_like(diff, dtype=bool)
        if self.causal:
            allowed &= diff >= 0
        if self.wl >= 0:
            allowed &= diff <= self.wl
        if self.wr >= 0:
            allowed &= -diff <= self.wr
        if nonpad is not None:
            allowed &= j < nonpad.reshape(-1, 1, 1, 1)
        return np.where(allowed, bias, -np.inf).astype(np.float32)

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        # float16 as the kernels compute it: widened, float32 throughout, Y rounded once
        wide = [x.astype(np.float32) if x is not None and x.dtype == _F16 else x for x in inputs]
        if self.product is not None:  # the packed product, rounded to float16 as the kernels keep it
            x = np.matmul(wide[0], wide[7]) + (wide[8] if len(wide) > 8 and wide[8] is not None else 0)
            wide[0] = x.astype(_F16).astype(np.float32)
        if self.packed is not None:
            eq, ek, _ = self.packed
            qkv = wide[0]
            wide[0:3] = [qkv[..., :eq], qkv[..., eq:eq + ek], qkv[..., eq + ek:]]
        get: Any = lambda k: wide[k] if k < len(wide) else None  # noqa: E731
        q, k, v = get(0), get(1), get(2)
        b, hq, hkv, s = self.b, self.hq, self.hkv, self.s
        if self.is3d:
            q = q.reshape(b, s, hq, self.d).transpose(0, 2, 1, 3)
            k = k.reshape(b, self.l, hkv, self.d).transpose(0, 2, 1, 3)
            v = v.reshape(b, self.l, hkv, self.dv).transpose(0, 2, 1, 3)
        if self.has_past:
            k = np.concatenate([get(4), k], axis=2)
            v = np.concatenate([get(5), v], axis=2)
        present_k, present_v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        rep = hq // hkv
        kk, vv = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scores = (q.astype(np.float64) @ kk.transpose(0, 1, 3, 2)) * self.scale
        if self.softcap > 0:
            scores = self.softcap * np.tanh(scores / self.softcap)
        bias = self._bias(get(3), get(6))
        with np.errstate(invalid="ignore"):
            t = scores + bias
            m = np.max(t, axis=-1, keepdims=True)
            m = np.where(np.isneginf(m), 0, m)
            e = np.exp(t - m)
            ssum = e.sum(axis=-1, keepdims=True)
            p = e / np.where(ssum == 0, 1, ssum)
        p = np.where(np.isneginf(bias.max(axis=-1, keepdims=True)), 0, p)
        y = p @ vv
        if self.is3d:
            y = y.transpose(0, 2, 1, 3).reshape(b, s, hq * self.dv)
        qk = {0: scores, 1: scores, 2: t, 3: p}[self.qk_mode]
        outs = [y.astype(self.input(0).dtype), present_k.astype(np.float32), present_v.astype(np.float32),
                np.asarray(qk, np.float32)]
        return outs[: max(1, self.num_outputs)]

    # -- device ---------------------------------------------------------------------------------
    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        if self.product is None:
            return self._dispatches(ctx, Ptr(ctx.inputs[0]))
        part_off, x_off = self._product_regions()
        parts, x = Ptr(ctx.workspace, part_off), Ptr(ctx.workspace, x_off)
        c = ctx.inputs[8] if len(ctx.inputs) > 8 else None
        work = self.product.dispatches(ctx.inputs[0], ctx.inputs[7], x, ctx.caps, c=c, ws=parts)
        if work and work[-1].shader == "gemm_reduce" and self._coop_defines(ctx.caps) is not None:
            return [*work[:-1], *self._dispatches(ctx, x, (work[-1].defines["NSPLITS"], parts, c))]
        return [*work, *self._dispatches(ctx, x)]

    def _dispatches(self, ctx: DispatchContext, q: Ptr, partials: tuple[int, Ptr, Any] | None = None) -> list[Dispatch]:
        """The attention's dispatches, Q (or the packed Q/K/V) at ``q``; with ``partials``
        (splits, their pointer, the bias or None) attention_coop.comp adds the packed product's
        split partial sums as it stages Q, K and V."""
        out: list[Dispatch] = []
        want = [k < len(ctx.outputs) and ctx.outputs[k] is not None for k in range(4)]
        k_src, v_src, kv3d = ctx.inputs[1], ctx.inputs[2], self.is3d
        k_ptr, v_ptr = (Ptr(k_src) if k_src is not None else None), (Ptr(v_src) if v_src is not None else None)
        if self.packed is not None:
            size = self.input(0).dtype.itemsize
            k_ptr = ptr_at(q, self.packed[0] * size)
            v_ptr = ptr_at(q, (self.packed[0] + self.packed[1]) * size)
        for pos, dim in ((1, self.d), (2, self.dv)):
            present = ctx.outputs[pos] if want[pos] else None
            if present is None and self.has_past:
                raise UnsupportedOp("Attention: past_key/past_value without the present outputs")
            if present is None:
                continue
            past = ctx.inputs[pos + 3] if self.has_past else ctx.inputs[pos]
            n = self.b * self.hkv * self.t * dim
            defines = {"B": self.b, "H": self.hkv, "PAST": self.past, "L": self.l, "DIM": dim,
                       "NEW3D": int(self.is3d)}
            out.append(Dispatch("kv_concat", [Ptr(past), Ptr(ctx.inputs[pos]), Ptr(present)],
                                groups_1d(n, 64, ctx.caps), defines))
            if self.has_past:
                if pos == 1:
                    k_ptr = Ptr(present)
                else:
                    v_ptr = Ptr(present)
                kv3d = False
        if self.b * self.hq * self.s == 0:
            return out
        ms = self.mask_shape or (1, 1, 1, self.t)
        mlen = ms[3]
        mss = mlen if ms[2] > 1 else 0
        msh = ms[2] * mlen if ms[1] > 1 else 0
        msb = ms[1] * ms[2] * mlen if ms[0] > 1 else 0
        has_mask = self.mask_shape is not None
        defines = {
            "B": self.b, "HQ": self.hq, "HKV": self.hkv, "S": self.s, "T": self.t, "D": self.d, "DV": self.dv,
            "PAST": self.past, "Q3D": int(self.is3d), "KV3D": int(kv3d),
            "HAS_MASK": int(has_mask), "MASK_BOOL": int(has_mask and self.input(3).dtype == np.bool_),
            "MASK_LEN": mlen, "MSB": msb, "MSH": msh, "MSS": mss,
            "CAUSAL": int(self.causal), "NONPAD": int(self.has_nonpad), "WL": self.wl, "WR": self.wr,
            "SOFTCAP": int(self.softcap > 0), "QK_MODE": self.qk_mode if want[3] else -1,
        }
        if self.half:  # float32 keeps its defines (and its cached pipelines) as they were
            defines["HALF"] = 1
            defines["MASK_HALF"] = int(has_mask and self.input(3).dtype == _F16)
        if self.packed is not None:
            defines["QKV_ROW"] = sum(self.packed)
        # each of 64 lanes: its keys' scores (D each), two softmax passes, then a column of the output
        # over every key
        coop = None if want[3] else self._coop_defines(ctx.caps)
        rows = None if want[3] or coop is not None else self._rows_defines(ctx.caps)
        tiled = None if want[3] or rows is not None or coop is not None else self._tile_keys(ctx.caps)
        if coop is not None or rows is not None or tiled is not None:
            args = [q, k_ptr, v_ptr, Ptr(ctx.inputs[3]) if has_mask else q,
                    Ptr(ctx.inputs[6]) if self.has_nonpad else q, Ptr(ctx.outputs[0]), F32(self.scale), F32(self.softcap)]
            if partials is not None and coop is not None:
                assert self.packed is not None
                splits, parts, c = partials
                cols = (0, self.packed[0], self.packed[0] + self.packed[1])
                args[:3] = [ptr_at(parts, 4 * col) for col in cols]
                args += [ptr_at(c, 2 * col) if c is not None else q for col in cols]
                coop = {**coop, "NSPLITS": splits, "PBIAS": int(c is not None)}
            elif partials is not None:
                raise ValueError("Attention: only attention_coop.comp reads a product's partial sums")
            shader, extra = ("attention_coop", coop) if coop is not None else ("attention_rows", rows) \
                if rows is not None else ("attention_tiled", {"KB": tiled})
            groups = (-(-self.s // (rows["WG"] if rows is not None else 16)), self.hq, self.b)
            check_grid(groups, ctx.caps, f"Attention over {self.s} queries")
            out.append(Dispatch(shader, args, groups, {**defines, **extra}))
            return out
        lanes = -(-self.t // 64)
        check_serial(lanes * (self.d + 3) + -(-self.dv // 64) * (self.t + 1), ctx.caps,
                     f"Attention over {self.t} keys")
        args = [q, k_ptr, v_ptr, Ptr(ctx.inputs[3]) if has_mask else q,
                Ptr(ctx.inputs[6]) if self.has_nonpad else q, Ptr(ctx.workspace), Ptr(ctx.outputs[0]),
                Ptr(ctx.outputs[3]) if want[3] else q, F32(self.scale), F32(self.softcap)]
        out.append(Dispatch("attention", args, groups_1d(self.b * self.hq * self.s, 1, ctx.caps), defines))
        return out


__all__ = ["Attention"]

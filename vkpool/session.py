"""The in-process API, shaped like ONNX Runtime's ``InferenceSession``."""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from vkpool.errors import InvalidInput
from vkpool.kernels.base import OpError, UnsupportedOp
from vkpool.kernels.registry import unsupported_in
from vkpool.memory import DeviceOutOfMemory
from vkpool.model import LoadedModel, ModelError, UnboundDims, load_model
from vkpool.pipeline import IDLE, InlineRunner, submit_all
from vkpool.pool import DevicePool, HostMember, Member, VulkanMember

ORT_TYPES = {
    np.dtype(np.float32): "tensor(float)", np.dtype(np.float16): "tensor(float16)",
    np.dtype(np.float64): "tensor(double)", np.dtype(np.int64): "tensor(int64)",
    np.dtype(np.int32): "tensor(int32)", np.dtype(np.int16): "tensor(int16)",
    np.dtype(np.int8): "tensor(int8)", np.dtype(np.uint8): "tensor(uint8)",
    np.dtype(np.bool_): "tensor(bool)",
}


def _refuse_unsupported(op_types: Sequence[tuple[str, str]]) -> None:
    missing = unsupported_in(op_types)
    if missing:
        raise UnsupportedOp(f"the model uses ops vkpool does not support: {', '.join(missing)}. "
                            "`vkpool ops` lists the supported ops.")


@dataclass(frozen=True)
class NodeArg:
    """An input or output of the model, as ONNX Runtime describes it."""

    name: str
    shape: list[int | None]  # None: a dim known only once the model runs (a cut model's outputs)
    dtype: np.dtype

    @property
    def type(self) -> str:
        return ORT_TYPES.get(self.dtype, f"tensor({self.dtype})")


class Session:
    """Loads an ONNX model onto the pool and runs it.

    ``model``: a path or the model's bytes. ``device``: a member id (``"vk0"``, ``"vk0.1"``,
    ``"cpu"``); by default where :func:`vkpool.partition.place_model` puts it, as ``vkpool plan``
    shows: one member whose free budget (every vkpool process counted) holds the model (the first
    Vulkan member, or with every member's speeds measured the fastest: the config's ``placement``),
    and when none does, a plan over the Vulkan members (the ``cpu`` member joins only when
    they cannot hold it together) run by :class:`vkpool.executor.PlanExecutor`; :attr:`placement`
    is the plan that runs. ``devices``: plan over exactly these members (in priority order) even
    when one would do; ``plan``: run this plan, a :class:`~vkpool.partition.plan.Plan` made for
    this model or a mapping op name → member id. ``objective``: the placement's objective
    (``"latency"`` or ``"throughput"``, which plans over the members and may replicate the whole
    model on several).
    ``budgets``: member id → size (``"512MiB"`` or bytes) applied to the pool before placing.
    ``config``: a config path for the pool this session creates; ``pool``: an existing pool to
    share. ``batch``/``dims`` bind symbolic dimensions (the batch dimension defaults to 1).
    ``processes``: run the plan with one worker process per chunk and per replica
    (:mod:`vkpool.processes`), so the members' host work runs in parallel; by default (None)
    that happens when every member is a hardware GPU and the plan spans several devices or
    replicates the model (a plan split over members of one device runs in threads, where its
    chunks hand tensors over on the device: ``docs/execution.md``), True
    asks for it on any Vulkan members (one member included), False keeps everything in this
    process. ``link_on_device``: chunks of a plan in this process that share a device hand
    tensors over on the device, ordered by timeline semaphores (the default), or with False
    through host memory as between devices (13 µs faster for a tiny mlp split on one H200, slower
    or equal for the other workloads measured: ``docs/execution.md``). ``in_place``: worker
    processes whose devices import host memory read and write the tensors crossing between
    chunks in the shared mailboxes themselves instead of copying them (off by default, slower on the
    H200s measured: :class:`vkpool.processes.ProcessExecutor`); refused unless the plan runs in
    worker processes. ``run_slots``: the run slots of a model compiled whole on one Vulkan member
    (1 by default), each with input and output memory of its own; with 2, :meth:`run_many` keeps
    the device busy with one request while the host moves the next one's tensors, and two threads
    calling :meth:`run` overlap on the device (a slot that the budget has no room for is not made).

    A model whose shapes depend on run-time values (NonZero of a computed tensor, TopK with a
    computed k, a Range of computed bounds, ...) is cut there (:mod:`vkpool.dynamic`): the part
    before is recorded once, the rest compiled per distinct value and kept in a cache of
    ``suffix_cache`` entries (:data:`vkpool.dynamic.SUFFIX_CACHE_SIZE` by default).
    ``dynamic`` is then the :class:`~vkpool.dynamic.DynamicModel` (None for a static model).

    ``max_batch``: :meth:`submit` batches requests that arrive together along the model's
    leading (symbolic) batch dimension, up to ``max_batch`` rows per run, the first request
    waiting at most ``max_queue_delay`` seconds for company (:mod:`vkpool.batching`); variants
    at batch sizes 2, 4, ... and ``max_batch`` are compiled here, each holding its own weights and
    counted against the budgets. :meth:`run` still runs one request at once. ``batching``
    gives the batcher's figures.

    A model whose inputs have symbolic dims runs with whatever sizes the feeds give those dims:
    ``batch``/``dims`` choose the shapes compiled at load (when they bind every symbolic dim),
    other shapes are compiled at their first run and kept in a cache of ``shape_cache`` entries
    (:data:`vkpool.dynamic.SHAPE_CACHE_SIZE` by default); ``shapes`` is then the
    :class:`~vkpool.dynamic.ShapeSessions` (None when every input dim is fixed). A dim that
    ``batch``/``dims`` leave unbound is bound by the first run.
    """

    def __init__(
        self,
        model: str | os.PathLike | bytes,
        *,
        device: str | None = None,
        budgets: Mapping[str, int | str] | None = None,
        config: str | os.PathLike | None = None,
        pool: DevicePool | None = None,
        batch: int = 1,
        dims: Mapping[str, int] | None = None,
        devices: Sequence[str] | None = None,
        plan: Any = None,
        objective: str = "latency",
        suffix_cache: int | None = None,
        processes: bool | None = None,
        max_batch: int | None = None,
        max_queue_delay: float = 0.0,
        shape_cache: int | None = None,
        link_on_device: bool = True,
        in_place: bool = False,
        run_slots: int = 1,
    ) -> None:
        if run_slots < 1:
            raise ValueError(f"run_slots must be at least 1, got {run_slots}")
        self._run_slots = run_slots
        self._own_pool = pool is None
        self._source = (model if isinstance(model, (bytes, bytearray)) else os.fspath(model), batch, dict(dims or {}))
        self._processes = processes
        self._handover = {"link_on_device": link_on_device, "in_place": in_place}
        self.pool = pool if pool is not None else DevicePool.from_config(None if config is None else str(config))
        self._reset()
        try:
            for member_id, size in (budgets or {}).items():
                self.pool.set_budget(member_id, size)
            try:
                loaded = load_model(model, batch=batch, dims=dict(dims or {}), partial=True)
            except UnboundDims as exc:
                self._bind_per_run(exc, device, devices)
                loaded = None
            if loaded is None or loaded.symbolic:
                self._keep_shapes(device, devices, objective, suffix_cache, shape_cache)
            if loaded is not None:
                self._setup(loaded, device, devices, plan, objective, suffix_cache)
            if max_batch is not None:
                if batch != 1:
                    raise ValueError("batch= fixes the batch dimension and max_batch= batches requests "
                                     "along it: give one of them")
                if loaded is None:
                    raise ValueError("max_batch= batches along the batch dimension of shapes compiled at load: "
                                     "give dims= for every other symbolic input dim")
                self._batcher = self._make_batcher(
                    model, dict(dims or {}), max_batch, max_queue_delay,
                    dict(device=device, devices=devices, objective=objective, processes=processes, **self._handover))
        except BaseException:
            self.close()
            raise
        finally:
            self._source = None  # the workers have loaded it: do not hold the model's bytes

    @classmethod
    def _part(cls, model: LoadedModel, pool: DevicePool, device: str | None, devices: Sequence[str] | None,
              objective: str, suffix_cache: int | None, link_on_device: bool = True) -> Session:
        """A session on ``model``, a part of a cut model (:mod:`vkpool.dynamic`), on the same pool
        and placed as the whole model's session was asked to be."""
        self = cls.__new__(cls)
        self._own_pool = False
        self._source, self._processes = None, False  # a part is compiled from the loaded graph
        self._handover = {"link_on_device": link_on_device, "in_place": False}
        self._run_slots = 1
        self.pool = pool
        self._reset()
        try:
            self._setup(model, device, devices, None, objective, suffix_cache)
        except BaseException:
            self.close()
            raise
        return self

    def _reset(self) -> None:
        self._batcher: Any = None
        self._chunk: Any = None
        self._executor: Any = None
        self._runner: Any = None  # what runs requests (vkpool.pipeline): every run and submit goes to it
        self._placement: Any = None
        self._placement_members: list[Any] = []
        self.dynamic: Any = None
        self.shapes: Any = None
        self._exact: Any = None  # the inputs' one shape each, for _check_feeds, of this model and shapes
        self._exact_for: Any = None
        self._exact_shapes: Any = None
        self._closed = False
        self._lock = threading.Lock()

    def _setup(self, loaded: LoadedModel, device: str | None, devices: Sequence[str] | None, plan: Any,
               objective: str, suffix_cache: int | None) -> None:
        from vkpool.cut import Graph, find_cut
        from vkpool.dynamic import SUFFIX_CACHE_SIZE, DynamicModel

        self.model: LoadedModel = loaded
        _refuse_unsupported(loaded.op_types())
        if device is not None and (devices is not None or plan is not None):
            raise ValueError("give one of device (one member), devices (a plan over them) or plan")
        if self._processes and devices is None and plan is None:
            raise ValueError("processes=True runs a plan's chunks and replicas in worker processes: "
                             "give devices=[...] (with objective='throughput' for replicas) or plan=")
        graph = Graph.of(loaded)
        split = find_cut(graph)
        if split is None:
            if loaded.unresolved:
                raise ModelError(f"tensor {loaded.unresolved[0]!r}: shape or dtype is still unknown after "
                                 "binding symbolic dims")
            if plan is not None:
                self._compile_plan(plan)
            elif device is not None:
                member = self.pool.member(device)
                self._placement_members = self._planner_members([device])
                self._compile_on(member)
            else:
                self._place(devices, objective)
            return
        if self._processes:
            raise ValueError("the model's shapes depend on run-time values, so it is compiled in parts in this "
                             "process; processes=True cannot apply (leave processes unset)")
        if plan is not None:
            where = "; ".join(dict.fromkeys(p.describe() for p in split.points))
            raise ValueError(f"the model's shapes depend on run-time values ({where}), so it is compiled in "
                             "parts and a plan made for the whole graph cannot apply; give devices=[...] "
                             "to plan each part over those members")
        size = SUFFIX_CACHE_SIZE if suffix_cache is None else int(suffix_cache)
        pool = self.pool  # not self: the parts must not keep this session alive
        link_on_device = self._handover["link_on_device"]

        def compile_static(part: LoadedModel) -> Session:
            return Session._part(part, pool, device, devices, objective, size, link_on_device)

        self.dynamic = DynamicModel(graph, split, compile_static, size)
        self._runner = InlineRunner(self.dynamic.run, self.dynamic.close)
        if self.dynamic.prefix is not None:
            self.member = self.dynamic.prefix.member
        else:
            self.member = self._candidates(device if devices is None else devices[0])[0]

    # -- shapes bound per run --------------------------------------------------------------
    def _bind_per_run(self, unbound: UnboundDims, device: str | None, devices: Sequence[str] | None) -> None:
        """Nothing compiled at load: the inputs' symbolic dims are bound by each run's feeds. An op
        without a kernel that reads the inputs is refused now all the same."""
        _refuse_unsupported(unbound.run_time_ops)
        symbolic = {n: tuple(a for a, d in enumerate(i.shape) if d < 0) for n, i in unbound.inputs}
        self.model = LoadedModel(inputs=unbound.inputs, outputs=unbound.outputs, nodes=[], constants={},
                                 tensors={}, opset=0, symbolic={n: a for n, a in symbolic.items() if a})
        self.member = self._candidates(device if devices is None else devices[0])[0]

    def _keep_shapes(self, device: str | None, devices: Sequence[str] | None, objective: str,
                     suffix_cache: int | None, shape_cache: int | None) -> None:
        from vkpool.dynamic import SHAPE_CACHE_SIZE, ShapeSessions

        assert self._source is not None
        source, batch, dims = self._source
        pool = self.pool  # not self: the sessions per shape must not keep this one alive
        link_on_device = self._handover["link_on_device"]

        def compile_shapes(shapes: dict[str, tuple[int, ...]]) -> Session:
            where = ", ".join(f"{n} {list(s)}" for n, s in shapes.items())
            try:
                part = load_model(source, batch=batch, dims=dims, partial=True, shapes=shapes)
                return Session._part(part, pool, device, devices, objective, suffix_cache, link_on_device)
            except (ModelError, OpError, UnsupportedOp) as exc:
                raise type(exc)(f"the model cannot run with input shapes {where}: {exc}") from exc

        self.shapes = ShapeSessions(compile_shapes, SHAPE_CACHE_SIZE if shape_cache is None else int(shape_cache))

    def _compiled_here(self) -> bool:
        return self._runner is not None

    def _other_shapes(self, feeds: Mapping[str, np.ndarray]) -> bool:
        """Whether ``feeds`` run on a session compiled for their shapes rather than on this one."""
        if self.shapes is None:
            return False
        if not self._compiled_here():
            return True
        return any(feeds[n].shape != info.shape for n, info in self.model.inputs)

    def _latest(self) -> Session | None:
        """Where the last run ran when nothing is compiled here (None before the first run)."""
        return self.shapes.latest if self.shapes is not None and not self._compiled_here() else None

    # -- placement -------------------------------------------------------------------------
    def _make_batcher(self, model: Any, dims: dict[str, int], max_batch: int, max_queue_delay: float,
                      placement: dict[str, Any]) -> Any:
        """A :class:`~vkpool.batching.Batcher` over variants of this model at batch sizes up to
        ``max_batch``; batch 1 is this session itself. Refuses a model without a batch dimension."""
        from vkpool.batching import Batcher, BatchingError, BatchRunner

        at1 = self.model
        try:
            at2 = load_model(model, batch=2, dims=dims, partial=True)
        except ModelError as exc:  # the loader refuses a batch no input can take
            raise BatchingError(f"the model has no batch dimension to batch along ({exc}): export it with a "
                                "symbolic first dim, or leave max_batch unset") from None
        for (name, one), (_, two) in zip(at1.inputs, at2.inputs):
            if not (one.shape[:1] == (1,) and two.shape[:1] == (2,)):
                raise BatchingError(f"input {name!r} has no batch dimension to batch along (its shape is "
                                    f"{list(one.shape)} at batch 1 and {list(two.shape)} at batch 2): "
                                    f"export it with a symbolic first dim, or leave max_batch unset")
        for (name, one), (_, two) in zip(at1.outputs, at2.outputs):
            if not (one.shape[:1] == (1,) and two.shape[:1] == (2,)):
                raise BatchingError(f"output {name!r} does not follow the batch dimension ({list(one.shape)} at "
                                    f"batch 1, {list(two.shape)} at batch 2): its rows cannot be split per request")
        def make_variant(size: int) -> Any:
            if size == 1:  # this session itself, which the batcher must not close
                return SimpleNamespace(run=self.run, staged=self.staged, close=lambda: None)
            return Session(model, pool=self.pool, batch=size, dims=dims, run_slots=self._run_slots, **placement)

        runner = BatchRunner(make_variant, [(n, i.shape, i.dtype) for n, i in at1.inputs],
                             [n for n, _ in at1.outputs], max_batch=max_batch, max_queue_delay=max_queue_delay)
        try:
            runner.compile_all()
        except BaseException:
            runner.close()
            raise
        return Batcher(runner, name=str(model) if not isinstance(model, (bytes, bytearray)) else "model")

    @property
    def batch_runner(self) -> Any:
        """The :class:`~vkpool.batching.BatchRunner` of a session opened with ``max_batch`` (the
        daemon's scheduler batches through it), else None."""
        return None if self._batcher is None else self._batcher.runner

    @property
    def batching(self) -> dict[str, Any] | None:
        """The batcher's figures (:meth:`vkpool.batching.BatchStats.snapshot`), or None without ``max_batch``."""
        return None if self._batcher is None else {
            "max_batch": self._batcher.max_batch, "max_queue_delay": self._batcher.max_queue_delay,
            **self._batcher.batch_stats.snapshot()}

    def _candidates(self, device: str | None) -> list[Member]:
        if device is not None:
            return [self.pool.member(device)]
        members = list(self.pool.vulkan_members)
        members += [m for m in self.pool.members if isinstance(m, HostMember)]
        if not members:
            raise RuntimeError("the pool has no members: check the config's device rules and host.enabled")
        return members

    def _compile_on(self, member: Member) -> None:
        """The whole model as one chunk on ``member``."""
        from vkpool.engine import HostChunk, VulkanChunk

        m = self.model
        used = {n for node in m.nodes for n in node.inputs if n}
        self._chunk_outputs = [name for name, _ in m.outputs if name not in m.constants]
        self._chunk_inputs = [name for name, _ in m.inputs if name in used or name in self._chunk_outputs]
        args = (member, m.nodes, dict(m.tensors), m.constants, self._chunk_inputs, self._chunk_outputs,
                m.opset)
        chunk = self._chunk = (VulkanChunk(*args, slots=self._run_slots) if isinstance(member, VulkanMember)
                               else HostChunk(*args))
        inputs = self._chunk_inputs
        self._runner = InlineRunner(lambda feeds: chunk.run({n: feeds[n] for n in inputs}), chunk.close,
                                    start=lambda feeds: chunk.start({n: feeds[n] for n in inputs}),
                                    finish=chunk.finish, depth=getattr(chunk, "slots", 1),
                                    stage=getattr(chunk, "staged", None))
        self.member = member

    def _planner_members(self, ids: Sequence[str]) -> list[Any]:
        from vkpool.placement import planner_members

        return planner_members(self.pool, ids)

    def _place(self, devices: Sequence[str] | None, objective: str) -> None:
        """Places the model with :func:`vkpool.partition.place_model` (over exactly ``devices``
        when given, else by the pool's policy over every member) and compiles what it chose: the
        whole model on one member as one chunk, else the plan's executor.

        The planner prices memory with its own model of a chunk; the compiled chunk may need a
        little more (inputs and outputs held in their own buffers, arena alignment). When a
        member refuses a chunk, its budget as the planner sees it is cut by what the compile
        lacked below what the refused placement gave it, and the model is placed again.
        """
        from vkpool.config.loader import placement_policy
        from vkpool.partition import place_model
        from vkpool.partition.api import WHOLE
        from vkpool.partition.plan import PartitionUnfeasible, plan_problems

        if devices is not None and not devices:
            raise ValueError("devices must name at least one pool member")
        over_all = devices is not None
        members = self._planner_members(list(devices) if over_all else [m.id for m in self.pool.members])
        for _attempt in range(2 * len(members) + 2):
            try:
                graph, chosen = place_model(self.model, members, objective=objective, plan_over_all=over_all,
                                            policy=placement_policy(self.pool.config))
            except PartitionUnfeasible as exc:
                if over_all:
                    raise
                raise DeviceOutOfMemory("pool", 0, 0, 0, str(exc)) from None
            problems = plan_problems(graph, chosen)
            if problems:
                raise PartitionUnfeasible("; ".join(problems), shortfall_bytes={})
            try:
                if chosen.algorithm == WHOLE:  # one member (of a model with no ops, too): one chunk
                    self._compile_on(self.pool.member(next(iter(chosen.budget_bytes))))
                    self._placement = chosen
                else:
                    self._start_executor(chosen, graph)
                return
            except DeviceOutOfMemory as exc:
                refused = next((k for k, mm in enumerate(members) if mm.id == exc.member), None)
                if refused is None:
                    raise
                planned = chosen.memory_bytes.get(exc.member, members[refused].budget_bytes)
                # place again as if the member had as much less room as the compile lacked
                lacked = max(1, exc.requested - (exc.budget - exc.used))
                members[refused] = members[refused].with_budget(max(0, planned - lacked))
        raise DeviceOutOfMemory("pool", 0, 0, 0, "the compiled chunks exceed the budgets the plans "
                                "were made for, however the plans were cut")

    def _compile_plan(self, plan: Any) -> None:
        """Runs ``plan``: a partition Plan made for this model, or a mapping op name → member id."""
        from vkpool.column_split import blocks_named, split_products
        from vkpool.partition.graph import build_graph
        from vkpool.partition.plan import Plan, build_plan

        if not self.model.column_splits:  # a plan made with blocks names them
            split_products(self.model, blocks_named(self.model, plan.member_of if isinstance(plan, Plan) else plan))
        graph = build_graph(self.model)
        if isinstance(plan, Plan):
            given = plan
        else:
            assignment = dict(plan)
            ids = list(dict.fromkeys(assignment.values()))
            missing = sorted(set(graph.nodes) - set(assignment))
            if missing:
                raise ValueError(f"the plan places no member for op(s) {missing[:5]}")
            given = build_plan(graph, assignment, self._planner_members(ids), algorithm="given")
        unknown = set(given.member_of) ^ set(graph.nodes)
        if unknown:
            raise ValueError(f"the plan was made for another model: ops {sorted(unknown)[:5]} differ")
        self._start_executor(given, graph)

    def _start_executor(self, plan: Any, graph: Any) -> None:
        from vkpool.executor import MemberGroup
        from vkpool.placement import MultiMemberPlan

        self._executor = self._runner = self._run_plan(plan, graph)
        self._placement = plan
        self._chunk_plan = MultiMemberPlan(self._executor.plan, graph, self._executor)
        self.member = MemberGroup([self.pool.member(i) for i in self._executor.members])

    def _run_plan(self, plan: Any, graph: Any) -> Any:
        """The executor of ``plan``: worker processes when ``processes`` asks for them (see the
        class doc), else a :class:`~vkpool.executor.PlanExecutor`."""
        from vkpool.executor import PlanExecutor
        from vkpool.processes import AVAILABLE, ProcessExecutor

        members = [self.pool.member(m) for m in dict.fromkeys([*(c.member for c in plan.chunks), *plan.replicas])]
        chosen = self._processes if self._processes is not None else (
            AVAILABLE and self._source is not None
            and all(isinstance(m, VulkanMember) and m.info.type in ("discrete", "integrated", "virtual")
                    for m in members)
            # a split of one device runs in threads, where its chunks hand tensors over on the device
            and (len({m.info.index for m in members}) > 1 or (len(members) > 1 and bool(plan.replicas))))
        if chosen:
            source, batch, dims = self._source
            return ProcessExecutor(self.pool, self.model, plan, graph, source, batch, dims,
                                   in_place=self._handover["in_place"])
        if self._handover["in_place"]:
            raise ValueError("in_place=True is for a plan run in worker processes, and this one runs in threads "
                             "of this process: give processes=True, or leave in_place unset")
        return PlanExecutor(self.pool, self.model, plan, graph, link_on_device=self._handover["link_on_device"])

    # -- ONNX Runtime-shaped API ----------------------------------------------------------------
    def get_inputs(self, symbolic: bool = False) -> list[NodeArg]:
        """The inputs, with the shapes compiled at load; a dim not bound at load is None, and with
        ``symbolic`` so is every dim a run may give another size."""
        def dims(name: str, shape: tuple[int, ...]) -> list[int | None]:
            free = self.model.symbolic.get(name, ()) if symbolic else ()
            return [None if d < 0 or a in free else d for a, d in enumerate(shape)]

        return [NodeArg(n, dims(n, i.shape), i.dtype) for n, i in self.model.inputs]

    def get_outputs(self) -> list[NodeArg]:
        """The outputs; a dim known only at run time (an output after a cut) is None."""
        return [NodeArg(n, [d if d >= 0 else None for d in i.shape], i.dtype) for n, i in self.model.outputs]

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[np.ndarray]:
        """Runs the model; returns the outputs named (all, in model order, when None)."""
        if self._closed:
            raise RuntimeError("the session is closed")
        feeds = self._check_feeds(input_feed)
        names = self._output_list(output_names)
        if self._other_shapes(feeds):
            produced = self.shapes.run(names, feeds)
        else:
            produced = self._runner.run(feeds)
        return self._select(names, produced)

    def staged(self, block: bool = True) -> Any:
        """For a session that runs the whole model as one chunk on a Vulkan member, or as copies
        that each do (a throughput plan, in threads: the least busy copy): one run slot, held for a
        caller that writes every input straight into ``.inputs`` (the slot's memory, each input's
        whole compiled shape), calls ``.run()`` and reads the outputs it returns (views of the
        slot's memory) until ``.release()`` or the end of a ``with`` block
        (:class:`vkpool.engine.StagedRun`); the batcher fills a batch's rows this way. None for
        any other session (a plan cut in several chunks, worker processes, a cut model, the host
        member, a session that compiles per run the shapes it is given): use :meth:`run`.
        ``block`` False: raises :class:`queue.Empty` at once when no slot is free."""
        if self._closed:
            raise RuntimeError("the session is closed")
        if self.dynamic is not None:
            return None
        if self._executor is not None:
            staged = getattr(self._executor, "staged", None)
            return staged(block) if staged is not None else None
        if self._chunk is None:
            return None
        return self._runner.staged(block)

    def submit(self, input_feed: Mapping[str, Any], output_names: Sequence[str] | None = None) -> Future:
        """Starts a run and returns a future of its outputs (as :meth:`run` returns them).

        On a plan over several members, requests submitted back to back are pipelined: one
        member runs a later request's chunk while another runs an earlier one's. On one
        member, and for a cut model, the run happens before this returns. Feeds that do not
        fit the model are refused here (:class:`~vkpool.errors.InvalidInput`); an error while
        running is the future's.
        """
        if self._closed:
            raise RuntimeError("the session is closed")
        names = self._output_list(output_names)
        if self._batcher is not None:
            return self._batcher.submit(input_feed, lambda produced: self._select(names, produced),
                                        output_names=names)
        feeds = self._check_feeds(input_feed)
        if self._other_shapes(feeds):
            done: Future = Future()
            try:
                done.set_result(self._select(names, self.shapes.run(names, feeds)))
            except Exception as exc:
                done.set_exception(exc)
            return done
        return self._runner.submit(feeds, lambda produced: self._select(names, produced))

    def run_many(self, input_feeds: Iterable[Mapping[str, Any]], output_names: Sequence[str] | None = None,
                 each: Callable[[int, Any], None] | None = None) -> list[list[np.ndarray] | Exception]:
        """Runs several requests back to back and returns, for each, its outputs (as :meth:`run`
        returns them) or the exception it raised: a request that fails, its feeds refused
        included, fails alone. ``each(index, result)`` is called as each request ends.

        On one member (and for a cut model) the requests run in this thread and ``input_feeds``
        is read lazily, a request only when it can start; on a Vulkan member opened with
        ``run_slots=2`` the device runs one request while this thread writes the next one's
        inputs and reads the last one's outputs. Copies of the model run in threads of this
        process (a throughput plan, ``processes=False``) are driven from this thread the same way,
        each request on the next copy in turn (:meth:`vkpool.executor.PlanExecutor.run_many`).
        Elsewhere the requests are submitted together (:meth:`submit`: a plan's members, worker
        processes and the batcher work on them at once) and waited for in order."""
        if self._closed:
            raise RuntimeError("the session is closed")
        names = self._output_list(output_names)
        if self._batcher is not None or not hasattr(self._runner, "run_many"):
            return submit_all(lambda given: self.submit(given, names), input_feeds, each)
        out: list[Any] = []

        def report(index: int, result: Any) -> None:
            out[index] = result
            if each is not None:
                each(index, result)

        ran: list[int] = []  # the index in ``out`` of each request handed to the runner

        def checked() -> Iterator[Any]:
            for given in input_feeds:
                if given is IDLE:
                    yield given
                    continue
                index = len(out)
                out.append(None)
                try:
                    feeds = self._check_feeds(given)
                    if self._other_shapes(feeds):
                        report(index, self._select(names, self.shapes.run(names, feeds)))
                        continue
                except Exception as exc:
                    report(index, exc)
                    continue
                ran.append(index)
                yield feeds

        self._runner.run_many(checked(), lambda produced: self._select(names, produced),
                              lambda k, result: report(ran[k], result))
        return out

    def _output_list(self, output_names: Sequence[str] | None) -> list[str]:
        all_outputs = [n for n, _ in self.model.outputs]
        if output_names is None:
            return all_outputs
        names = list(output_names)
        known = set(all_outputs)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise InvalidInput(f"unknown output(s) {unknown}; the model's outputs are {sorted(known)}")
        return names

    def _select(self, names: list[str], produced: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        out = []
        for name in names:
            if name in produced:
                out.append(produced[name])
            else:
                out.append(np.array(self.model.constants[name], copy=True))
        return out

    def _check_feeds(self, input_feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        # what most calls give: an array of each input's fixed shape and type, and nothing else
        model = self.model
        if self._exact_for is not model or self._exact_shapes is not self.shapes:
            self._exact = self._exact_inputs()
            self._exact_for, self._exact_shapes = model, self.shapes
        exact = self._exact
        if exact is not None and len(input_feed) == len(exact):
            feeds = {}
            for name, dtype, shape in exact:
                value = input_feed.get(name)
                if type(value) is not np.ndarray or value.dtype != dtype or value.shape != shape:
                    break
                feeds[name] = value
            else:
                return feeds
        expected = {n: i for n, i in self.model.inputs}
        extra = sorted(set(input_feed) - set(expected))
        if extra:
            raise InvalidInput(f"unknown input(s) {extra}; the model's inputs are {sorted(expected)}")
        missing = sorted(set(expected) - set(input_feed))
        if missing:
            raise InvalidInput(f"missing input(s) {missing}")
        feeds = {}
        for name, info in expected.items():
            value = np.asarray(input_feed[name])
            if value.dtype != info.dtype:
                raise InvalidInput(f"input {name!r} must be {info.dtype}, got {value.dtype}")
            free = self.model.symbolic.get(name, ()) if self.shapes is not None else ()
            wrong = [a for a, (d, v) in enumerate(zip(info.shape, value.shape)) if a not in free and d != v]
            if value.ndim != len(info.shape) or wrong:
                shape = ["?" if a in free or d < 0 else d for a, d in enumerate(info.shape)]
                where = f" (axis {wrong[0]})" if value.ndim == len(info.shape) else f" (rank {len(shape)})"
                raise InvalidInput(f"input {name!r} must have shape {shape}, got {list(value.shape)}{where}")
            feeds[name] = value
        return feeds

    def _exact_inputs(self) -> tuple[tuple[str, np.dtype, tuple[int, ...]], ...] | None:
        """(name, dtype, shape) of every input when each has one shape only (no dim left
        symbolic or unknown): :meth:`_check_feeds` then accepts arrays of exactly those at once."""
        exact = []
        for name, info in self.model.inputs:
            free = self.model.symbolic.get(name, ()) if self.shapes is not None else ()
            if free or any(d < 0 for d in info.shape):
                return None
            exact.append((name, np.dtype(info.dtype), tuple(int(d) for d in info.shape)))
        return tuple(exact)

    # -- what it holds ----------------------------------------------------------------------------
    @property
    def plan(self) -> Any:
        """Where the model runs: a SingleMemberPlan, the partition Plan as a MultiMemberPlan, or
        for a cut model a :class:`~vkpool.dynamic.CutPlan` (where it is cut, the prefix's plan
        and the plan of the suffix the last run used)."""
        latest = self._latest()
        if latest is not None:
            return latest.plan
        if self.dynamic is not None:
            return self.dynamic.plan
        if self._executor is not None:
            return self._chunk_plan
        if self._chunk is None:
            raise RuntimeError("nothing is compiled yet: the model's symbolic input dims are bound by the first run")
        from vkpool.placement import SingleMemberPlan

        return SingleMemberPlan(self.model, self.member.id, self._chunk.stats, self._chunk.engine,
                                self._chunk.engine_note)

    @property
    def placement(self) -> Any:
        """The partition :class:`~vkpool.partition.plan.Plan` this session runs, as ``vkpool plan``
        shows it: :func:`vkpool.partition.place_model`'s choice, the plan given, or with
        ``device`` the whole model on that member; None for a cut model (each part has its own)."""
        if self.dynamic is not None:
            return None
        if self._placement is None:
            from vkpool.partition.api import WHOLE
            from vkpool.partition.graph import build_graph
            from vkpool.partition.plan import build_plan

            graph = build_graph(self.model)
            self._placement = build_plan(graph, {op: self.member.id for op in graph.graph["order"]},
                                         self._placement_members, algorithm=WHOLE)
        return self._placement

    def memory_by_member(self) -> dict[str, int]:
        if self.shapes is not None and not self._compiled_here():
            latest = self._latest()
            return latest.memory_by_member() if latest is not None else {}
        if self.dynamic is not None:
            return self.dynamic.memory_by_member()
        if self._executor is not None:
            return self._executor.memory_by_member()
        stats = self._chunk.stats
        return {self.member.id: stats.weight_bytes + stats.arena_bytes + stats.io_bytes}

    @property
    def stats(self) -> Any:
        """The compiled chunks' statistics; for a cut model, its prefix's (empty without one)."""
        if self.shapes is not None and not self._compiled_here():
            from vkpool.engine import ChunkStats

            latest = self._latest()
            return latest.stats if latest is not None else ChunkStats()
        if self.dynamic is not None:
            from vkpool.engine import ChunkStats

            return self.dynamic.prefix.stats if self.dynamic.prefix is not None else ChunkStats()
        return self._executor.chunk_stats() if self._executor is not None else self._chunk.stats

    @property
    def runner(self) -> Any:
        """What runs this session's requests (:mod:`vkpool.pipeline`): an
        :class:`~vkpool.pipeline.InlineRunner` (one member, a cut model), or the plan's executor;
        for a model whose symbolic input dims each run binds, the runner of the shapes the last
        run had (None before the first run)."""
        latest = self._latest()
        return latest.runner if latest is not None else self._runner

    @property
    def executor(self) -> Any:
        """The :class:`~vkpool.executor.PlanExecutor` of a plan over several members, else None."""
        return self._executor

    def trace(self) -> list[Any]:
        """Per chunk run of the last requests: request, member, host start/end ``perf_counter_ns``
        (:class:`~vkpool.executor.ChunkEvent`); empty for a session on one member."""
        return self._executor.trace() if self._executor is not None else []

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._batcher is not None:
                self._batcher.close()
                self._batcher.runner.close()
                self._batcher = None
            if self._runner is not None:  # it closes what it runs: the chunk, the plan's, the cut model's parts
                self._runner.close()
                self._runner = self._chunk = self._executor = self.dynamic = None
            if self.shapes is not None:
                self.shapes.close()
                self.shapes = None
            if self._own_pool and getattr(self, "pool", None) is not None:
                self.pool.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

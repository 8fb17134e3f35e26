"""Changing a member's budget while models run on it.

If the pool accepts the new budget as is, nothing else changes. If it refuses (typically
because loaded models use more than the new budget), the models placed on that member are
re-planned under the new budget: their running jobs finish, their sessions are closed, the
budget is set and they are opened again. If any of that fails, the old budget and the old
plans are restored and the change is refused with the reason.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vkpool.daemon.runtime import classify
from vkpool.daemon.protocol import ProtocolViolation
from vkpool.units import format_size

if TYPE_CHECKING:
    from vkpool.daemon.registry import ModelEntry
    from vkpool.daemon.service import Service

log = logging.getLogger("vkpool.daemon")


def change_budget(service: "Service", member: str, nbytes: int) -> dict[str, Any]:
    runtime = service.runtime
    old = runtime.budget_of(member)
    try:
        runtime.set_budget(member, nbytes)
        return {"member": member, "budget_bytes": runtime.budget_of(member), "replanned": []}
    except ValueError as exc:
        first_reason = str(exc)
    affected = [e for e in service.registry.all() if e.memory.get(member)]
    if not affected:
        raise _refused(member, nbytes, first_reason)
    for entry in affected:
        entry.gate.acquire_exclusive()
    try:
        return _replan(service, member, nbytes, old, affected, first_reason)
    finally:
        for entry in affected:
            entry.gate.release_exclusive()


def _replan(service: "Service", member: str, nbytes: int, old: int, affected: list["ModelEntry"],
            first_reason: str) -> dict[str, Any]:
    runtime = service.runtime
    for entry in affected:
        entry.session.close()
    try:
        runtime.set_budget(member, nbytes)
    except ValueError as exc:
        _reopen(service, affected)
        raise _refused(member, nbytes, f"{first_reason}; even with its models unloaded: {exc}") from None
    opened: list[tuple["ModelEntry", Any]] = []
    try:
        for entry in affected:
            opened.append((entry, service.open_session(entry.source, entry.binding, entry.batch_config,
                                                       entry.objective)))
    except Exception as exc:
        reason = classify(exc).message
        for _, session in opened:
            session.close()
        runtime.set_budget(member, old)
        _reopen(service, affected)
        raise _refused(member, nbytes, f"model {entry.name} ({entry.id[:12]}) would not fit: {reason}",
                       model=entry.id) from None
    for entry, session in opened:
        entry.session = session
        entry.refresh()
    log.info("budget of %s set to %s; re-planned %s", member, format_size(nbytes), [e.id[:12] for e in affected])
    return {"member": member, "budget_bytes": runtime.budget_of(member), "replanned": [e.id for e in affected]}


def _reopen(service: "Service", entries: list["ModelEntry"]) -> None:
    for entry in entries:
        try:
            entry.session = service.open_session(entry.source, entry.binding, entry.batch_config, entry.objective)
            entry.refresh()
        except Exception:  # it fitted before under these budgets; a failure here is a bug
            log.exception("could not restore model %s after a refused budget change", entry.id[:12])


def _refused(member: str, nbytes: int, reason: str, **details: Any) -> ProtocolViolation:
    return ProtocolViolation("BudgetRefused", f"budget of {member} cannot be set to {format_size(nbytes)}: "
                             f"{reason}", {"member": member, "requested": nbytes, **details})

"""Events raised by ORM entities, staged in the same transaction when their session flushes.

    class Order(Base, RaisesEvents):
        ...

    outbox.stage_on_flush(Session)          # or a sessionmaker, AsyncSession, async_sessionmaker

    with Session(engine) as session, session.begin():
        order = Order(...)
        order.raise_event(OrderPlaced(order_id=order.id))
        session.add(order)
    # committed: the order row and one outbox row per target of OrderPlaced

The rule: an event an entity raised is staged in the transaction that writes the entity, or
that transaction fails with a ``StagingError`` that says why. Never dropped, never silent.

- Events wait on their entity. Once the entity is in a session (added before or after it
  raised them), the session holds it strongly until they are staged: SQLAlchemy itself holds
  a flushed entity only weakly, so an application that keeps no reference cannot lose them.
- Right after a flush wrote the entities (so new ones have their primary key), every waiting
  event of the session's written entities is staged in the order raised, in one INSERT, with
  the entity's identity as its stream key. A commit flushes first, so an entity whose columns
  did not change still has its events staged.
- A staged event leaves its entity until the transaction ends: a commit ends it for good, a
  rollback (of the transaction, or of the savepoint it was staged in) puts it back on the
  entity, so committing the entity again (a retry) stages it again.
- A session that ``stage_on_flush`` was never given, flushing or committing an entity with
  waiting events, fails with ``StagingError``: the events would otherwise vanish.
- An entity dropped by the application with events still waiting is logged
  (``router.entity.events_unstaged``): nothing wrote it, so nothing could stage them.

This works through listeners on SQLAlchemy's ``Session`` class (every session of the process),
installed when the first ``RaisesEvents`` entity class is defined: a session that holds no
waiting events pays one dictionary lookup per flush and commit.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction, object_session, sessionmaker

from envelopes import StagingError
from router.write.events import Event

__all__ = ["Raised", "RaisesEvents", "stage_on_flush", "waiting", "watch_unstaged"]

log = logging.getLogger(__name__)

Stage = Callable[..., list[str]]
"""``Writer._stage_sync``: ``stage(connection, events, stream_keys=...)``."""

_ATTRIBUTE = "_router_raised_events"  # on an entity: its waiting events (a list, kept in place)
_WATCHED = "_router_raised_watch"  # on an entity: its finalizer, once it has raised
_HELD = "router.raised"  # a session's ``info``: its entities with events waiting, by id
_STAGED = "router.staged"  # a session's ``info``: what it staged in transactions still open
_STAGE = "router.stage"  # a session instance's ``info``: the stager it was given
_order = itertools.count()  # raise order across every entity of a process
_lock = threading.Lock()
# The stager of each session class (a sessionmaker's own class, a tracked subclass...).
_stagers: weakref.WeakKeyDictionary[type, Stage] = weakref.WeakKeyDictionary()
_installed = False


@dataclass(frozen=True, slots=True)
class Raised:
    """One event an entity raised: its place in raise order and its stream key, if given."""

    order: int
    event: Event
    stream_key: str | None


@dataclass(slots=True)
class _Staged:
    """Events staged in one transaction (or savepoint) still open, by entity."""

    transaction: SessionTransaction
    entities: list[tuple[Any, list[Raised]]] = field(default_factory=list)


class RaisesEvents:
    """A mixin for ORM entities that record the events they raise, for ``stage_on_flush``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _install()

    def raise_event(self, event: Event, *, stream_key: str | None = None) -> None:
        """Record ``event``; it is staged at the next flush of this entity's session, on
        ``stream_key`` or else on the entity's identity (its primary key)."""
        if not isinstance(event, Event):
            raise StagingError(f"raise_event() takes a router.Event, got {type(event)!r}")
        state = sa.inspect(self, raiseerr=False)  # None: not SQLAlchemy's (a Django model)
        with _lock:
            waiting(self).append(Raised(next(_order), event, stream_key))
            if state is not None and state.session is not None:
                state.session.info.setdefault(_HELD, {})[id(self)] = self
        watch_unstaged(self)

    @property
    def raised_events(self) -> list[Event]:
        """The events raised and not staged yet, in order."""
        return [raised.event for raised in self.__dict__.get(_ATTRIBUTE, ())]


def waiting(entity: Any) -> list[Raised]:
    """The list of ``entity``'s waiting events, itself (changed in place, never replaced, so
    that ``watch_unstaged``'s finalizer sees what is left)."""
    found: list[Raised] | None = entity.__dict__.get(_ATTRIBUTE)
    if found is None:
        found = entity.__dict__[_ATTRIBUTE] = []
    return found


def take(entity: Any) -> list[Raised]:
    """``entity``'s waiting events, taken off it (call under no lock)."""
    with _lock:
        found = waiting(entity)
        taken = list(found)
        found.clear()
    return taken


def put_back(entity: Any, raised: Iterable[Raised]) -> None:
    """Make ``raised`` wait on ``entity`` again, in raise order with any raised since."""
    with _lock:
        found = waiting(entity)
        found.extend(raised)
        found.sort(key=lambda r: r.order)


def watch_unstaged(entity: Any) -> None:
    """Log, if ``entity`` is dropped with events still waiting: no transaction wrote it (its
    row went in by ``QuerySet.update()`` or raw SQL, say), so they were never staged."""
    if _WATCHED in entity.__dict__:
        return
    label = f"{type(entity).__qualname__} at 0x{id(entity):x}"
    finalizer = weakref.finalize(entity, _report_unstaged, label, waiting(entity))
    finalizer.atexit = False  # a process that ends ends its entities' stories too
    entity.__dict__[_WATCHED] = finalizer


def _report_unstaged(label: str, left: list[Raised]) -> None:
    if left:
        types = ", ".join(r.event.__event__.type for r in left)
        log.error(
            "router.entity.events_unstaged",
            extra={"entity": label, "events": types, "count": len(left)},
        )


def stage_on_flush(sessions: Any, stage: Stage) -> None:
    """Stage on flush in ``sessions`` (see ``Writer.stage_on_flush``)."""
    _install()
    target = _listen_target(sessions)
    if isinstance(target, Session):
        target.info[_STAGE] = stage
    else:
        _stagers[target] = stage


def _listen_target(sessions: Any) -> Session | type[Session]:
    """The session, or the class of the sessions, that ``sessions`` makes: an async session
    flushes its sync session, and an ``async_sessionmaker`` gets a Session class of its own."""
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
    from sqlalchemy.orm import scoped_session

    if isinstance(sessions, scoped_session):  # Flask-SQLAlchemy's db.session
        sessions = sessions.session_factory
    if isinstance(sessions, AsyncSession):
        return sessions.sync_session
    if isinstance(sessions, async_sessionmaker):
        base = sessions.kw.get("sync_session_class", Session)
        if base not in _stagers:  # tracked already: the one class of its own it was given
            base = type(f"Tracked{base.__name__}", (base,), {})
            sessions.configure(sync_session_class=base)
        return base  # type: ignore[no-any-return]
    if isinstance(sessions, sessionmaker):
        return sessions.class_  # a class of its own (sessionmaker's __init__)
    if isinstance(sessions, Session) or (
        isinstance(sessions, type) and issubclass(sessions, Session)
    ):
        return sessions
    raise StagingError(
        "stage_on_flush() takes a SQLAlchemy Session (class or instance), sessionmaker, "
        f"scoped_session, AsyncSession or async_sessionmaker; got {type(sessions).__name__}"
    )


def _stager_of(session: Session) -> Stage | None:
    """The stager ``stage_on_flush`` gave ``session`` or its class, if any."""
    found: Stage | None = session.info.get(_STAGE)
    if found is not None:
        return found
    for cls in type(session).__mro__:
        found = _stagers.get(cls)
        if found is not None:
            return found
    return None


def _install() -> None:
    """Listen on every session of the process, once."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    event.listen(Session, "after_attach", _after_attach)
    event.listen(Session, "after_flush_postexec", lambda session, _: _stage(session))
    event.listen(Session, "before_commit", _before_commit)
    event.listen(Session, "after_commit", _after_commit)
    event.listen(Session, "after_soft_rollback", _after_soft_rollback)
    event.listen(Session, "after_transaction_end", _after_transaction_end)


def _after_attach(session: Session, entity: Any) -> None:
    """An entity that raised before it joined ``session``: held by it from now on."""
    if entity.__dict__.get(_ATTRIBUTE):
        with _lock:
            session.info.setdefault(_HELD, {})[id(entity)] = entity


def _before_commit(session: Session) -> None:
    """Stage what waits on entities the commit's own flush will not touch (unchanged ones)."""
    if _of(session):
        session.flush()  # new and changed entities: staged by its after_flush_postexec
        _stage(session)


def _stage(session: Session) -> None:
    entities = [e for e in _of(session) if sa.inspect(e).has_identity]
    if not entities:
        return
    stage = _stager_of(session)
    if stage is None:
        raise _untracked(session, entities)
    taken = [(entity, take(entity)) for entity in entities]
    with _lock:
        held = session.info.get(_HELD, {})
        for entity in entities:
            held.pop(id(entity), None)
    raised = sorted(
        ((r, entity) for entity, rs in taken for r in rs), key=lambda pair: pair[0].order
    )
    if not raised:
        return
    try:
        stage(
            session,
            [r.event for r, _ in raised],
            stream_keys=[r.stream_key or _identity(entity) for r, entity in raised],
        )
    except BaseException:
        _restore(session, taken)  # refused: the events wait on, and the flush fails
        raise
    transaction = session.get_nested_transaction() or session.get_transaction()
    assert transaction is not None  # a flush runs in one
    session.info.setdefault(_STAGED, []).append(_Staged(transaction, taken))


def _untracked(session: Session, entities: list[Any]) -> StagingError:
    counts = ", ".join(
        f"{type(e).__name__} {_identity(e)!r}: {len(e.__dict__.get(_ATTRIBUTE, ()))}"
        for e in entities[:3]
    )
    return StagingError(
        f"entities with raised events are written by a {type(session).__name__} that "
        f"stage_on_flush() was never given ({counts} event(s) waiting); their events would "
        "be lost. Pass this session, its class or its sessionmaker to "
        "outbox.stage_on_flush() at start, or stage the events with outbox.stage()"
    )


def _after_commit(session: Session) -> None:
    """The root transaction committed: what it staged is staged for good."""
    if session.get_nested_transaction() is None:  # a released savepoint commits nothing yet
        session.info.pop(_STAGED, None)


def _after_soft_rollback(session: Session, previous: SessionTransaction) -> None:
    """A savepoint rolled back: what was staged inside it waits on its entities again."""
    if previous.nested:
        _unstage(session, previous)


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    """The root transaction ended uncommitted (rolled back, closed): everything it staged
    waits on its entities again, for a retry to stage."""
    if transaction.parent is None:
        _unstage(session, None)


def _unstage(session: Session, within: SessionTransaction | None) -> None:
    """Put back what was staged in ``within`` (None: in any transaction) and not committed."""
    staged: list[_Staged] = session.info.get(_STAGED, [])
    if not staged:
        return
    keep = []
    for record in staged:
        if within is None or _inside(record.transaction, within):
            _restore(session, record.entities)
        else:
            keep.append(record)
    session.info[_STAGED] = keep


def _inside(transaction: SessionTransaction | None, outer: SessionTransaction) -> bool:
    while transaction is not None:
        if transaction is outer:
            return True
        transaction = transaction.parent
    return False


def _restore(session: Session, taken: list[tuple[Any, list[Raised]]]) -> None:
    """Make ``taken`` wait on its entities again; the session holds those still in it (one
    a rollback expunged joins a session again by ``add()``, and is held from then)."""
    for entity, raised in taken:
        put_back(entity, raised)
        if object_session(entity) is session:
            with _lock:
                session.info.setdefault(_HELD, {})[id(entity)] = entity


def _of(session: Session) -> list[Any]:
    """The entities of ``session`` with events waiting; forgets those that left it."""
    held: dict[int, Any] | None = session.info.get(_HELD)
    if not held:
        return []
    with _lock:
        for key, entity in list(held.items()):
            if object_session(entity) is not session or not entity.__dict__.get(_ATTRIBUTE):
                del held[key]
        return list(held.values())


def _identity(entity: Any) -> str:
    """The entity's primary key as a stream key (``a/b`` for a composite one)."""
    key = sa.inspect(entity).mapper.primary_key_from_instance(entity)
    return "/".join(str(part) for part in key)

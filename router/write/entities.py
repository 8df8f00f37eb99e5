"""Events raised by ORM entities, staged in the same transaction when their session flushes.

    class Order(Base, RaisesEvents):
        ...

    outbox.stage_on_flush(Session)          # or a sessionmaker, AsyncSession, async_sessionmaker

    with Session(engine) as session, session.begin():
        order = Order(...)
        order.raise_event(OrderPlaced(order_id=order.id))
        session.add(order)
    # committed: the order row and one outbox row per target of OrderPlaced

Events wait on their entity until its session flushes; then, right after the flush wrote the
entities (so new ones have their primary key), every pending event of the session's entities
is staged in the order raised, in one INSERT, with the entity's identity as its stream key.
A commit flushes first, so an entity whose columns did not change still has its events
staged. An event is taken off its entity when staged, so saving the entity again stages
nothing twice; a rollback takes the staged rows with it (the events are not raised again).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session, object_session, sessionmaker

from envelopes import StagingError
from router.write.events import Event

__all__ = ["RaisesEvents", "stage_on_flush", "take_raised"]

Stage = Callable[..., list[str]]
"""``Writer._stage_sync``: ``stage(connection, events, stream_keys=...)``."""

_ATTRIBUTE = "_router_raised_events"
_HELD = "router.raised"  # a session's ``info`` key: its entities with events waiting, by id
_order = itertools.count()  # raise order across every entity of a process
# Entities with events waiting that no session held when they raised them. A session holds
# its new and changed entities strongly, but an unchanged one only weakly: that one is held
# in its session's ``info`` instead, so its events cannot vanish with the application's last
# reference to it before the commit.
# By id: an entity need not be hashable (a model may define __eq__ alone).
_pending: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class _Raised:
    order: int
    event: Event
    stream_key: str | None


class RaisesEvents:
    """A mixin for ORM entities that record the events they raise, for ``stage_on_flush``."""

    def raise_event(self, event: Event, *, stream_key: str | None = None) -> None:
        """Record ``event``; it is staged at the next flush of this entity's session, on
        ``stream_key`` or else on the entity's identity (its primary key)."""
        if not isinstance(event, Event):
            raise StagingError(f"raise_event() takes a router.Event, got {type(event)!r}")
        state = sa.inspect(self, raiseerr=False)  # None: not SQLAlchemy's (a Django model)
        with _lock:
            self.__dict__.setdefault(_ATTRIBUTE, []).append(
                _Raised(next(_order), event, stream_key)
            )
            if state is not None and state.session is not None:
                state.session.info.setdefault(_HELD, {})[id(self)] = self
            elif state is not None:
                _pending[id(self)] = self

    @property
    def raised_events(self) -> list[Event]:
        """The events raised and not staged yet, in order."""
        return [raised.event for raised in self.__dict__.get(_ATTRIBUTE, ())]


def take_raised(entity: RaisesEvents) -> list[tuple[Event, str | None]]:
    """The events ``entity`` raised and their stream keys (None: the entity's own), in raise
    order, taken off it: for an ORM without sessions to listen on (Django's models)."""
    with _lock:
        raised = entity.__dict__.pop(_ATTRIBUTE, [])
    return [(r.event, r.stream_key) for r in raised]


def stage_on_flush(sessions: Any, stage: Stage) -> None:
    """Listen on ``sessions`` (see ``Writer.stage_on_flush``)."""
    target = _listen_target(sessions)
    event.listen(target, "after_flush_postexec", lambda session, _: _stage(session, stage))
    event.listen(target, "before_commit", lambda session: _before_commit(session, stage))


def _listen_target(sessions: Any) -> Any:
    """What SQLAlchemy's events can listen on for ``sessions``: an async session flushes its
    sync session, and an ``async_sessionmaker`` gets a Session class of its own."""
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
    from sqlalchemy.orm import scoped_session

    if isinstance(sessions, scoped_session):  # Flask-SQLAlchemy's db.session
        return sessions.session_factory
    if isinstance(sessions, AsyncSession):
        return sessions.sync_session
    if isinstance(sessions, async_sessionmaker):
        base = sessions.kw.get("sync_session_class", Session)
        tracked = type(f"Tracked{base.__name__}", (base,), {})
        sessions.configure(sync_session_class=tracked)
        return tracked
    if isinstance(sessions, Session | sessionmaker) or (
        isinstance(sessions, type) and issubclass(sessions, Session)
    ):
        return sessions
    raise StagingError(
        "stage_on_flush() takes a SQLAlchemy Session (class or instance), sessionmaker, "
        f"scoped_session, AsyncSession or async_sessionmaker; got {type(sessions).__name__}"
    )


def _before_commit(session: Session, stage: Stage) -> None:
    """Stage what waits on entities the commit's own flush will not touch (unchanged ones)."""
    if _of(session):
        session.flush()  # new and changed entities: staged by its after_flush_postexec
        _stage(session, stage)


def _stage(session: Session, stage: Stage) -> None:
    entities = [e for e in _of(session) if sa.inspect(e).has_identity]
    raised: list[tuple[_Raised, Any]] = []
    with _lock:
        held = session.info.get(_HELD, {})
        for entity in entities:
            raised.extend((r, entity) for r in entity.__dict__.pop(_ATTRIBUTE, ()))
            _pending.pop(id(entity), None)
            held.pop(id(entity), None)
    if not raised:
        return
    raised.sort(key=lambda pair: pair[0].order)
    events = [r.event for r, _ in raised]
    keys = [r.stream_key or _identity(entity) for r, entity in raised]
    stage(session, events, stream_keys=keys)


def _of(session: Session) -> Sequence[Any]:
    """The entities of ``session`` with events waiting."""
    with _lock:
        held = [e for e in session.info.get(_HELD, {}).values() if object_session(e) is session]
        return held + [e for e in _pending.values() if object_session(e) is session]


def _identity(entity: Any) -> str:
    """The entity's primary key as a stream key (``a/b`` for a composite one)."""
    key = sa.inspect(entity).mapper.primary_key_from_instance(entity)
    return "/".join(str(part) for part in key)

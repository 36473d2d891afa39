"""Sessions: a persistent workspace, a stateful interpreter and a safe file API."""

from sandloop.sessions.session import Session, check_path
from sandloop.sessions.store import SessionRecord, SessionStore

__all__ = ["Session", "SessionRecord", "SessionStore", "check_path"]

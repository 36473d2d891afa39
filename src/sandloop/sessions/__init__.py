"""Sessions: a persistent workspace, a stateful interpreter and a safe file API."""

from sandloop.sessions.session import Session
from sandloop.sessions.session_files import check_path
from sandloop.sessions.store import SessionRecord, SessionStore

__all__ = ["Session", "SessionRecord", "SessionStore", "check_path"]

"""Warm pool, admission control and the reaper: speed and safety on one host."""

from sandloop.pool.admission import Admission
from sandloop.pool.dispatcher import Dispatcher
from sandloop.pool.reaper import Reaped, reap
from sandloop.pool.warm import WarmPool

__all__ = ["Admission", "Dispatcher", "Reaped", "WarmPool", "reap"]

"""kunci: the Python client of the kunci lock server.

    import kunci
    client = kunci.Client()                  # $KUNCI_SERVER or 127.0.0.1:5862
    with client.lock("deploy", wait=10, lease=30) as t:
        t.check()                            # raises kunci.LockLost once lost
        write(data, fence=t.token)
    with client.lock("backups", wait=60, limit=3) as t:   # at most 3 at once
        run_backup()
    with client.lock("catalog", wait=10, shared=True):    # many readers...
        read_catalog()                                   # ...or one writer

A server with ``--auth`` or TLS (spec §12)::

    client = kunci.Client("tls://locks.internal:5863", secret=secret,
                          tls=ssl.create_default_context(cafile="ca.pem"))

``kunci.aio.Client`` is the asyncio twin. Every call follows the client
contract of the kunci protocol (spec §8): one deadline per call, a
possibly-sent request is never sent again, and ``Indeterminate`` instead
of a guess. See README.md for every outcome.
"""

from ._errors import (
    Busy,
    Error,
    Indeterminate,
    InvalidArgument,
    LimitMismatch,
    LockLost,
    NotHeld,
    PermissionDenied,
    Timeout,
    Unavailable,
)
from ._common import Grant, Holders, KeyInfo, KeyStatus, Leader, Waiter
from ._protocol import DEFAULT_SERVER, TRANSPORT_DEADLINE, drift_margin
from ._sync import Client, Ticket
from . import aio

__version__ = "0.1.0"

__all__ = [
    "Busy",
    "Client",
    "DEFAULT_SERVER",
    "Error",
    "Grant",
    "Holders",
    "Indeterminate",
    "InvalidArgument",
    "KeyInfo",
    "KeyStatus",
    "Leader",
    "LimitMismatch",
    "LockLost",
    "NotHeld",
    "PermissionDenied",
    "TRANSPORT_DEADLINE",
    "Ticket",
    "Timeout",
    "Unavailable",
    "Waiter",
    "aio",
    "drift_margin",
]

"""The outcomes of a call that are not a result. Each says what the caller
may conclude (see the README's table of outcomes)."""


class Error(Exception):
    """Base class of every kunci outcome that is not a result."""


class Timeout(Error, TimeoutError):
    """The server answered ``T``: the key stayed held for the whole wait
    (with ``wait=0``: it was held at the one attempt). Definitive: nothing
    was acquired and nothing is queued. Also a :class:`TimeoutError`, as
    the standard library's lock waits say it: an ``except TimeoutError``
    around ``asyncio.timeout()`` or ``asyncio.wait_for`` (whose timeouts
    are ``TimeoutError`` from Python 3.11 on) catches it too; catch
    :class:`kunci.Timeout` first to tell the two apart."""


class Busy(Error):
    """The server answered ``B``: no capacity for the request, or it is
    shutting down. Definitive: nothing was acquired or queued."""


class Unavailable(Error):
    """No byte of the request reached a server that executed it by the
    deadline (connections refused or failed, or refused by the server with
    ``X 7``/``X 9`` before it read anything). Definitive: nothing changed.
    ``reason`` names the last failure."""

    def __init__(self, reason: str = "no server could be reached") -> None:
        super().__init__("unavailable: %s; nothing was sent" % reason)
        self.reason = reason

    def __reduce__(self) -> "tuple[type, tuple[str]]":
        # Made again from its reason (a pickle through a process pool), not
        # from its message, which would say it twice.
        return (type(self), (self.reason,))


class Indeterminate(Error):
    """The request may have reached the server, but its answer was not seen
    in time (no answer by the deadline, the connection died, or a grant came
    too late to hand over). For an acquire: do not enter the critical
    section; a grant nobody saw ends with its lease (a late one is released
    by the client at once). For a release or renew: the lease may or may
    not have changed."""


class NotHeld(Error):
    """The server answered ``N``: the token is not the key's active grant
    (its lease ran out, it was released, or it never existed). Nothing
    changed. A holder that gets this has lost the lock."""


class LockLost(Error):
    """A held lock is gone, or may be: a renewal was answered ``N``, or the
    ticket's ``valid_until`` passed without a successful renewal."""


class LimitMismatch(Error):
    """The server answered ``X 10``: the request named a permit limit other
    than the one the key has (set by the first request that named one while
    the key was in use). Definitive: nothing was acquired or queued.
    ``limit`` is the key's limit as the server said it (``None`` if its
    text did not say)."""

    def __init__(self, message: str, limit: "int | None" = None) -> None:
        super().__init__(message)
        self.limit = limit

    def __reduce__(self) -> "tuple[type, tuple[str, int | None]]":
        return (type(self), (str(self), self.limit))


class PermissionDenied(Error):
    """The server refused this client's credentials or this request, and
    executed nothing of it. Either the session was refused: the secret is
    missing, wrong or too short (``X 12`` as the session's first answer),
    or the server refused the client certificate, or its absence (a TLS
    alert); every request of that session ends so, and the call is not
    tried again with the same credentials. Or the request is outside the
    secret's scopes (``X 13``): that request alone, the session goes on.
    Definitive: nothing was acquired, queued, released or renewed."""


class InvalidArgument(Error, ValueError):
    """The input broke a rule of the contract and nothing was sent (or the
    server answered a non-fatal ``X``, meaning the client's checks let
    something through). Nothing changed."""

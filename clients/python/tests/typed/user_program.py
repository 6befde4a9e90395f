"""A program that uses the public API as a user would; the tests check it
with ``mypy --strict --disallow-any-expr``: every value it gets from kunci
has a type a checker trusts (none is ``Any``)."""

import asyncio
from typing import List, Optional

import kunci
import kunci.aio


def token_of(key: str) -> int:
    with kunci.Client("127.0.0.1:5862", transport_timeout=2.0) as client:
        return client.acquire(key, wait=1.5, lease=10).token


def managed(client: kunci.Client) -> float:
    with client.lock("deploy", wait=10, lease=30, limit=3) as ticket:
        ticket.check()
        left: float = ticket.valid_until
        renewed: float = ticket.renew()
        return max(left, renewed)


def released(client: kunci.Client) -> bool:
    ticket: kunci.Ticket = client.acquire("k")
    with ticket as held:
        held.check()
    return ticket.released and not ticket.lost


def looked_at(client: kunci.Client) -> List[str]:
    seen: List[str] = []
    status: Optional[kunci.KeyStatus] = client.query("k")
    if status is not None:
        seen.append("%d %d %.3f" % (status.token, status.waiters, status.lease_left))
    holders: kunci.Holders = client.holders("k")
    for grant in holders.grants:
        seen.append("%d %s %.3f %.3f" % (grant.token, grant.label, grant.lease_left,
                                         grant.held_for))
    for waiter in holders.waiters:
        seen.append("%d %.3f" % (waiter.owner, waiter.wait_left))
    for info in client.keys("jobs/"):
        seen.append("%s %d %d" % (info.key, info.grants, info.limit))
    leader: Optional[kunci.Leader] = client.leader("election")
    if leader is not None and leader.held_for is not None:
        seen.append("%s %d %.1f" % (leader.value, leader.term, leader.held_for))
    seen.append("%.6f" % client.ping())
    return seen


def failed(client: kunci.Client) -> str:
    try:
        client.acquire("k").release()
    except kunci.Timeout as error:
        return str(error)
    except kunci.Unavailable as error:
        return error.reason
    except kunci.LimitMismatch as error:
        return "limit %s" % error.limit
    except kunci.Error as error:
        return str(error)
    return "released"


async def in_asyncio() -> int:
    async with kunci.aio.Client("127.0.0.1:5862", transport_timeout=2.0) as client:
        ticket: kunci.aio.Ticket = await client.acquire("k", wait=1)
        async with ticket as held:
            renewed: float = await held.renew()
            assert renewed > 0
        async with client.lock("deploy", wait=10) as managed_ticket:
            managed_ticket.check()
        async with client.campaign("election", "me") as lead:
            term: int = lead.token
        elected = await client.campaign("election", "me")
        await elected.release()
        async for leader in client.observe("election"):
            if leader is not None:
                return leader.term + term
        return term


def main() -> int:
    return token_of("k") + asyncio.run(in_asyncio())

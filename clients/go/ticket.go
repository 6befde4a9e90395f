package kunci

import (
	"context"
	"errors"
	"sync"
	"time"
)

// Ticket is a granted lock: its key, its fencing token, its lease and
// ValidUntil, an instant before which the server cannot have taken the
// lock back (the instant just before the request that set the lease was
// handed to the socket, plus the lease, minus a drift margin of 10 ms +
// lease/500). Pass Token to the resource the lock guards, which refuses
// older tokens. Safe for concurrent use. Client.Close releases the
// tickets that were neither released nor detached.
type Ticket struct {
	client   *Client
	key      string
	keyBytes []byte
	token    uint64
	limit    uint16
	take     uint16

	mu          sync.Mutex
	lease       time.Duration
	leaseSentAt time.Time
	validUntil  time.Time
	done        bool // released, detached or taken by Close: nothing more to release
	released    bool
	lost        bool
	lostCh      chan struct{} // a managed lock's: closed on loss
	onLost      func()
	keepAlive   *keepAlive
	// label is the grant's label (a campaign's value, as last proclaimed):
	// a managed lock proclaims it again after a restarted server adopted
	// the grant without it (spec §7.5).
	label []byte
}

// Key is the key the ticket holds.
func (t *Ticket) Key() string { return t.key }

// Token is the grant's fencing token.
func (t *Ticket) Token() uint64 { return t.token }

// Limit and Take are the grant's permits (spec §10): Limit 0 is no limit,
// Take 0 all permits (exclusive).
func (t *Ticket) Limit() int { return int(t.limit) }

// Take is the number of permits the grant holds (0: all of them).
func (t *Ticket) Take() int { return int(t.take) }

// Lease is the lease the last successful acquire or renewal asked for.
func (t *Ticket) Lease() time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.lease
}

// ValidUntil is the conservative expiry of the lock (spec §8 rule 9).
func (t *Ticket) ValidUntil() time.Time {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.validUntil
}

// Valid reports whether ValidUntil is ahead and the ticket was neither
// released nor lost.
func (t *Ticket) Valid() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return !t.lost && !t.released && time.Now().Before(t.validUntil)
}

// Renew resets the lease to lease from now (0: the ticket's lease). On
// success ValidUntil moves to this renewal's send instant + lease −
// margin. ErrNotHeld: the lock is lost. ErrIndeterminate: ValidUntil
// keeps the earlier of the two bounds.
func (t *Ticket) Renew(ctx context.Context, lease time.Duration) error {
	t.mu.Lock()
	if lease == 0 {
		lease = t.lease
	}
	lost, released := t.lost, t.released
	t.mu.Unlock()
	if released || lost {
		return t.lostError()
	}
	l, err := checkLease(lease)
	if err != nil {
		return err
	}
	started := time.Now()
	call := t.client.simpleCall(ctx, 'E', t.keyBytes)
	call.token, call.lease = t.token, l
	_, err = t.client.ask(ctx, call, 'E')
	switch {
	case err == nil:
		t.mu.Lock()
		// Renewals may end out of order: the latest sent one counts.
		if !call.sentAt.Before(t.leaseSentAt) {
			t.leaseSentAt, t.lease = call.sentAt, lease
			t.validUntil = validUntil(call.sentAt, lease)
		}
		t.mu.Unlock()
	case errors.Is(err, ErrNotHeld):
		t.declareLost()
	case errors.Is(err, ErrIndeterminate):
		// The renewal may have set a lease from any instant after started.
		t.mu.Lock()
		if bound := validUntil(started, lease); bound.Before(t.validUntil) {
			t.validUntil = bound
		}
		t.mu.Unlock()
	}
	return err
}

// Release releases the lock (R for exactly this token). ErrNotHeld: the
// lease had already run out. After a known loss (or a release) it sends
// nothing and returns ErrLockLost.
func (t *Ticket) Release(ctx context.Context) error {
	t.stopKeepAlive()
	t.mu.Lock()
	if t.released || t.lost {
		t.mu.Unlock()
		return t.lostError()
	}
	t.done, t.released = true, true
	t.mu.Unlock()
	t.client.forget(t)
	call := t.client.simpleCall(ctx, 'R', t.keyBytes)
	call.token = t.token
	_, err := t.client.ask(ctx, call, 'R')
	if errors.Is(err, ErrNotHeld) {
		t.mu.Lock()
		t.lost = true
		t.mu.Unlock()
	}
	return err
}

// Detach keeps the lock held after Client.Close and returns the token; the
// lease still ends unless someone renews it.
func (t *Ticket) Detach() uint64 {
	t.stopKeepAlive()
	t.mu.Lock()
	t.done = true
	t.mu.Unlock()
	t.client.forget(t)
	return t.token
}

func (t *Ticket) lostError() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.released {
		return newError(ErrLockLost, "the lock on %q (token %d) was released", t.key, t.token)
	}
	return newError(ErrLockLost, "the lock on %q (token %d) was lost", t.key, t.token)
}

// declareLost declares the loss once, never after a release: ValidUntil
// no later than now, keep-alive stopped, Lost closed.
func (t *Ticket) declareLost() {
	t.mu.Lock()
	if t.lost || t.released {
		t.mu.Unlock()
		return
	}
	t.lost = true
	if now := time.Now(); now.Before(t.validUntil) {
		t.validUntil = now
	}
	lostCh := t.lostCh
	t.mu.Unlock()
	t.stopKeepAlive()
	t.client.forget(t)
	if lostCh != nil {
		close(lostCh)
	}
}

// declareLostIfExpired declares the loss once ValidUntil has passed;
// whether it has.
func (t *Ticket) declareLostIfExpired() bool {
	t.mu.Lock()
	expired := !time.Now().Before(t.validUntil)
	t.mu.Unlock()
	if expired {
		t.declareLost()
	}
	return expired
}

func (t *Ticket) stopKeepAlive() {
	t.mu.Lock()
	k := t.keepAlive
	t.keepAlive = nil
	t.mu.Unlock()
	if k != nil {
		k.stop()
	}
}

// takeForClose: whether Close releases this ticket (not released,
// detached or lost), marking it released.
func (t *Ticket) takeForClose() bool {
	t.stopKeepAlive()
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done || t.lost {
		return false
	}
	t.done, t.released = true, true
	return true
}

func (c *Client) forget(t *Ticket) {
	c.mu.Lock()
	delete(c.tickets, t)
	c.mu.Unlock()
}

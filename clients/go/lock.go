package kunci

import (
	"context"
	"errors"
	"sync"
	"time"
)

// Lock is a managed lock (spec §8 rule 10): its lease is renewed every
// lease/3 while it is held. It is lost when a renewal is answered N, or
// when ValidUntil passes without a successful renewal; Lost is closed
// then, and renewal stops.
type Lock struct {
	t *Ticket
}

// Lock acquires key as Acquire does (same options) and keeps its lease
// alive until Unlock. A grant that comes with less than two thirds of its
// lease left (after a long wait) is renewed before it is handed over; if
// that renewal finds it gone, Lock returns ErrLockLost and nothing is
// held.
func (c *Client) Lock(ctx context.Context, key string, opts ...Option) (*Lock, error) {
	t, err := c.Acquire(ctx, key, opts...)
	if err != nil {
		return nil, err
	}
	if err := c.handOver(ctx, t); err != nil {
		return nil, err
	}
	return &Lock{t: t}, nil
}

// handOver readies t as a managed lock: renewed first when less than two
// thirds of its lease is left on ValidUntil, then kept alive.
func (c *Client) handOver(ctx context.Context, t *Ticket) error {
	t.mu.Lock()
	t.lostCh = make(chan struct{})
	needsRenewal := time.Until(t.validUntil) < t.lease*2/3
	t.mu.Unlock()
	if needsRenewal {
		if err := t.Renew(ctx, 0); err != nil {
			switch {
			case errors.Is(err, ErrNotHeld):
				return &Error{Kind: ErrLockLost, Detail: "the grant came with less than 2/3 of its lease left and its renewal was answered N; nothing is held", Cause: err}
			case errors.Is(err, ErrPermissionDenied):
				t.declareLost()
				return &Error{Kind: ErrLockLost, Detail: "the renewal before hand-over was refused", Cause: err}
			case t.declareLostIfExpired():
				c.releaseBackground(t.keyBytes, t.token)
				return &Error{Kind: ErrLockLost, Detail: "the grant came after its valid_until and could not be renewed", Cause: err}
			}
			// Still valid: the keep-alive retries at once.
		}
	}
	k := &keepAlive{t: t, stopped: make(chan struct{})}
	t.mu.Lock()
	if t.lost || t.released {
		t.mu.Unlock()
		return t.lostError()
	}
	t.keepAlive = k
	t.mu.Unlock()
	go k.run()
	return nil
}

// Key is the key the lock holds.
func (l *Lock) Key() string { return l.t.key }

// Token is the grant's fencing token.
func (l *Lock) Token() uint64 { return l.t.token }

// ValidUntil is the conservative expiry as of the last renewal.
func (l *Lock) ValidUntil() time.Time { return l.t.ValidUntil() }

// Ticket is the lock's ticket.
func (l *Lock) Ticket() *Ticket { return l.t }

// Lost is closed once the lock is lost (never after Unlock).
func (l *Lock) Lost() <-chan struct{} { return l.t.lostCh }

// Check returns ErrLockLost unless the lock is still held (Valid); call it
// before each step that relies on the lock.
func (l *Lock) Check() error {
	if l.t.Valid() {
		return nil
	}
	l.t.declareLostIfExpired()
	return l.t.lostError()
}

// Unlock stops the keep-alive and releases the lock. After a loss it
// sends nothing and returns ErrLockLost.
func (l *Lock) Unlock(ctx context.Context) error {
	return l.t.Release(ctx)
}

// keepAlive renews one ticket a third into each lease, retrying a renewal
// that ended Unavailable or Indeterminate every 50 ms while ValidUntil is
// ahead, and declares the loss at ValidUntil.
type keepAlive struct {
	t        *Ticket
	stopOnce sync.Once
	stopped  chan struct{}
}

func (k *keepAlive) stop() { k.stopOnce.Do(func() { close(k.stopped) }) }

func (k *keepAlive) run() {
	t := k.t
	var renewal chan error
	retryAt := time.Time{}
	// A renewal that succeeds after one that reached no verdict, or after
	// a session of the client ended, may have adopted the grant on a
	// restarted server: its label is checked (and proclaimed again).
	outage := false
	sessionsEnded := t.client.ended.Load()
	for {
		t.mu.Lock()
		due := t.leaseSentAt.Add(t.lease / 3)
		until := t.validUntil
		t.mu.Unlock()
		if !retryAt.IsZero() {
			due = retryAt
		}
		var dueC <-chan time.Time
		var dueTimer *time.Timer
		if renewal == nil {
			dueTimer = time.NewTimer(time.Until(due))
			dueC = dueTimer.C
		}
		expiry := time.NewTimer(time.Until(until))
		select {
		case <-k.stopped:
		case <-dueC:
			renewal = make(chan error, 1)
			go func(ch chan error) {
				ctx, cancel := context.WithTimeout(context.Background(), transportDeadline)
				defer cancel()
				ch <- t.Renew(ctx, 0)
			}(renewal)
		case err := <-renewal:
			renewal = nil
			retryAt = time.Time{}
			switch {
			case err == nil:
				ended := t.client.ended.Load()
				if outage || ended != sessionsEnded {
					go t.proclaimAgain()
				}
				outage, sessionsEnded = false, ended
			case isRetryable(err):
				outage = true
				if !t.declareLostIfExpired() {
					retryAt = time.Now().Add(renewRetry)
				}
			case errors.Is(err, ErrNotHeld), errors.Is(err, ErrLockLost):
				t.declareLost()
			default:
				// PermissionDenied and the like are definitive: a loss.
				t.declareLost()
			}
		case <-expiry.C:
			t.declareLostIfExpired()
		}
		if dueTimer != nil {
			dueTimer.Stop()
		}
		expiry.Stop()
		select {
		case <-k.stopped:
			return
		default:
		}
		t.mu.Lock()
		lost := t.lost || t.released
		t.mu.Unlock()
		if lost {
			return
		}
	}
}

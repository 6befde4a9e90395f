package kunci

import (
	"context"
	"errors"
	"strings"
	"time"
)

// Leadership is this candidate's lead of an election (spec §13.6): an
// exclusive managed lock on the election's name, labelled with the value.
type Leadership struct {
	lock *Lock
	name string
}

// Campaign campaigns in the election name with value (1..=128 UTF-8
// bytes, no newline): an exclusive acquire of name labelled value, kept
// alive as Lock keeps its lock. It returns once this candidate leads.
// Options: Lease (default 30 s) and Wait, which bounds the campaign
// (ErrTimeout when it runs out; without it, it waits until elected, as
// `kunci elect` does: 255 s at a time, a new place at the queue's tail
// each time, through server restarts and outages, and after
// ErrIndeterminate it first releases its own grant if the server made
// one). ctx bounds it too.
func (c *Client) Campaign(ctx context.Context, name, value string, opts ...Option) (*Leadership, error) {
	label, err := checkText(value, "value", 1, labelLenMax)
	if err != nil {
		return nil, err
	}
	s := applyOptions(opts)
	if s.label != nil || s.limitSet || s.takeSet || s.shared {
		return nil, invalid("Campaign takes Lease and Wait only (its lock is exclusive and labelled with the value)")
	}
	bounded, campaignWait := s.waitSet, s.wait
	if bounded && campaignWait < 0 {
		return nil, invalid("wait must be ≥ 0, got %v", campaignWait)
	}
	s.waitSet, s.wait = false, 0
	args, err := s.acquireArgs()
	if err != nil {
		return nil, err
	}
	key, err := checkKey(name)
	if err != nil {
		return nil, err
	}
	args.label = label
	waitEnd := time.Now().Add(campaignWait)
	pause := retryPauseFirst
	for {
		args.wait = MaxWait
		if bounded {
			args.wait = time.Until(waitEnd)
			if args.wait < 0 {
				args.wait = 0
			}
			if args.wait > MaxWait {
				args.wait = MaxWait
			}
		}
		notices := c.shutdowns.Load()
		call := c.acquireCall(ctx, key, args, c.nextID())
		r, err := c.run(ctx, call)
		var t *Ticket
		if err == nil {
			t, err = c.granted(call, r, false)
		}
		if err == nil {
			if err := c.handOver(ctx, t); err != nil {
				return nil, err
			}
			return &Leadership{lock: &Lock{t: t}, name: name}, nil
		}
		if ctx.Err() != nil {
			return nil, err
		}
		switch {
		case errors.Is(err, ErrTimeout):
			pause = retryPauseFirst
			if bounded && !time.Now().Before(waitEnd) {
				return nil, err
			}
			if d, ok := ctx.Deadline(); ok && time.Until(d) <= transportDeadline {
				// No attempt can wait any more before ctx's deadline.
				return nil, err
			}
			continue
		case errors.Is(err, ErrBusy):
			if !c.shutdownSeen(notices) {
				return nil, err
			}
		case errors.Is(err, ErrIndeterminate):
			if call.sentAt.IsZero() {
				break
			}
			if e := c.releaseOwnGrant(ctx, call); e != nil {
				return nil, err
			}
		case errors.Is(err, ErrUnavailable):
			if strings.Contains(err.Error(), "not trusted") {
				return nil, err // a certificate does not change by waiting
			}
		default:
			return nil, err
		}
		if bounded && !time.Now().Before(waitEnd) {
			return nil, &Error{Kind: ErrTimeout, Detail: "the campaign's wait ran out", Cause: err}
		}
		if !sleepCtx(ctx, jittered(pause)) {
			return nil, &Error{Kind: ErrUnavailable, Detail: "cancelled while waiting to campaign again", Cause: ctx.Err()}
		}
		pause *= 2
		if pause > retryPauseMax {
			pause = retryPauseMax
		}
	}
}

// releaseOwnGrant: after acquire ended Indeterminate, asks who holds its
// key until the server answers and releases the grant of the call's
// owner, if any (rule 11), so that the next attempt never queues behind
// its own unseen grant.
func (c *Client) releaseOwnGrant(ctx context.Context, acquire *call) error {
	pause := retryPauseFirst
	for {
		call := c.simpleCall(ctx, 'H', acquire.key)
		call.owner = c.nextID()
		_, err := c.ask(ctx, call, 'Z')
		if err == nil {
			released := true
			for _, g := range call.grants {
				if g.Owner != acquire.owner || g.Token == 0 {
					continue
				}
				rel := c.simpleCall(ctx, 'R', acquire.key)
				rel.token = g.Token
				if _, err := c.ask(ctx, rel, 'R'); err != nil && !errors.Is(err, ErrNotHeld) {
					released = false
				}
			}
			if released {
				return nil
			}
		} else if errors.Is(err, ErrInvalidArgument) || errors.Is(err, ErrPermissionDenied) {
			return err
		}
		if !sleepCtx(ctx, jittered(pause)) {
			return ctx.Err()
		}
		pause *= 2
		if pause > retryPauseMax {
			pause = retryPauseMax
		}
	}
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// Term is the lead's term: the grant's token, a fencing token for what the
// leader writes.
func (l *Leadership) Term() uint64 { return l.lock.Token() }

// Lost is closed once the lead is lost (never after Resign).
func (l *Leadership) Lost() <-chan struct{} { return l.lock.Lost() }

// Lock is the lead's managed lock.
func (l *Leadership) Lock() *Lock { return l.lock }

// Proclaim changes the leader's value without losing the term (C, spec
// §13.4a); observers see the new value. ErrLockLost when the lead is
// already lost (or the server no longer has the grant).
func (l *Leadership) Proclaim(ctx context.Context, value string) error {
	label, err := checkText(value, "value", 1, labelLenMax)
	if err != nil {
		return err
	}
	t := l.lock.t
	t.mu.Lock()
	gone := t.lost || t.released
	t.mu.Unlock()
	if gone {
		return t.lostError()
	}
	call := t.client.simpleCall(ctx, 'C', t.keyBytes)
	call.token, call.label = t.token, label
	_, err = t.client.ask(ctx, call, 'C')
	if errors.Is(err, ErrNotHeld) {
		t.declareLost()
		return &Error{Kind: ErrLockLost, Detail: "the server no longer has this term's grant", Cause: err}
	}
	if err == nil {
		t.mu.Lock()
		t.label = label
		t.mu.Unlock()
	}
	return err
}

// proclaimAgain: after a renewal that came through an outage or a
// reconnect (a restarted server may have adopted the grant, which it
// keeps without its label after a crash: spec §7.5), reads the key (one O,
// wait 0) and, when its grant shows another label, proclaims the
// ticket's again, once. Only then: a server without C ends the connection
// that carries one. Failures are left to the next renewal.
func (t *Ticket) proclaimAgain() {
	t.mu.Lock()
	label := t.label
	gone := t.lost || t.released
	t.mu.Unlock()
	if len(label) == 0 || gone {
		return
	}
	c := t.client
	ctx, cancel := context.WithTimeout(context.Background(), transportDeadline)
	defer cancel()
	r, err := c.ask(ctx, c.observeCall(ctx, t.keyBytes, 0, 0), 'V')
	if err != nil || r.f.b != t.token || r.f.text == string(label) {
		return
	}
	call := c.simpleCall(ctx, 'C', t.keyBytes)
	call.token, call.label = t.token, label
	_, _ = c.ask(ctx, call, 'C')
}

// Resign ends the lead (releases its grant). Resigning a lead that is
// already lost returns nil, as etcd's Resign.
func (l *Leadership) Resign(ctx context.Context) error {
	err := l.lock.Unlock(ctx)
	if errors.Is(err, ErrLockLost) || errors.Is(err, ErrNotHeld) {
		return nil
	}
	return err
}

func (c *Client) observeCall(ctx context.Context, key []byte, since uint64, wait uint8) *call {
	_, d := deadlines(ctx, time.Now(), time.Duration(wait)*time.Second)
	call := newCall('O', key, d)
	call.owner, call.token, call.waitS = c.nextID(), since, wait
	return call
}

// Leader is who leads the election name now (one O with wait 0): nil, nil
// while nobody does.
func (c *Client) Leader(ctx context.Context, name string) (*Leader, error) {
	key, err := checkKey(name)
	if err != nil {
		return nil, err
	}
	r, err := c.ask(ctx, c.observeCall(ctx, key, 0, 0), 'V')
	if err != nil {
		return nil, err
	}
	return leaderOf(r.f), nil
}

// Observe follows the election name (spec §13.6): the current leader (nil
// when nobody leads) first, then one value per change of leader, a new
// value of the same term (a proclaim) included. Through restarts and
// outages it asks again quietly (pauses doubling up to 2 s) and sends a
// state only when it differs from the last one sent; a change shorter
// than one round trip may be missed; terms only increase. The channel is
// closed when ctx ends, or on ErrInvalidArgument or ErrPermissionDenied.
func (c *Client) Observe(ctx context.Context, name string) <-chan *Leader {
	ch := make(chan *Leader)
	key, err := checkKey(name)
	if err != nil {
		close(ch)
		return ch
	}
	go c.follow(ctx, key, ch)
	return ch
}

func (c *Client) follow(ctx context.Context, key []byte, ch chan<- *Leader) {
	defer close(ch)
	var since uint64
	first := true
	reported := false
	var last *Leader
	pause := retryPauseFirst
	for ctx.Err() == nil {
		var wait uint8
		if !first {
			wait = waitMaxSecond
		}
		r, err := c.ask(ctx, c.observeCall(ctx, key, since, wait), 'V')
		if err != nil {
			if errors.Is(err, ErrInvalidArgument) || errors.Is(err, ErrPermissionDenied) || errors.Is(err, ErrClosed) {
				return
			}
			if !sleepCtx(ctx, jittered(pause)) {
				return
			}
			pause *= 2
			if pause > retryPauseMax {
				pause = retryPauseMax
			}
			continue
		}
		pause = retryPauseFirst
		first = false
		since = r.f.b
		leader := leaderOf(r.f)
		if reported {
			if leader != nil && leader.Term == 0 && last != nil {
				continue // a crash grace: the leader followed is kept
			}
			if sameLeader(leader, last) {
				continue
			}
			if leader != nil && last != nil && leader.Term < last.Term {
				continue
			}
		}
		select {
		case ch <- leader:
			reported, last = true, leader
		case <-ctx.Done():
			return
		}
	}
}

func sameLeader(a, b *Leader) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Term == b.Term && a.Value == b.Value
}

package kunci

import (
	"context"
	"errors"
	"strings"
	"time"
)

// deadlines are a call's D and, for a wait, Dw (spec §8 rule 2): D =
// start + wait + 5 s, or the context's deadline when that comes first;
// Dw = start + wait, brought forward so that it stays 5 s before D (so
// that a T still arrives before a context's earlier deadline).
func deadlines(ctx context.Context, start time.Time, wait time.Duration) (dw, d time.Time) {
	dw = start.Add(wait)
	d = dw.Add(transportDeadline)
	if cd, ok := ctx.Deadline(); ok && cd.Before(d) {
		d = cd
		if latest := d.Add(-transportDeadline); latest.Before(dw) {
			dw = latest
		}
	}
	return dw, d
}

func (c *Client) acquireCall(ctx context.Context, key []byte, a acquireArgs, owner uint64) *call {
	dw, d := deadlines(ctx, time.Now(), a.wait)
	call := newCall('A', key, d)
	call.owner = owner
	call.lease = a.lease
	call.waitSet = a.wait > 0
	call.waitUntil = dw
	call.limit, call.take, call.label = a.limit, a.take, a.label
	return call
}

func checkedAcquire(key string, opts []Option) ([]byte, acquireArgs, error) {
	s := applyOptions(opts)
	args, err := s.acquireArgs()
	if err != nil {
		return nil, args, err
	}
	k, err := checkKey(key)
	return k, args, err
}

// Acquire takes the lock on key. Options: Wait (default 0: one try; at
// most 255 s, fractions allowed), Lease (whole seconds, default 30 s),
// Label, and for permits (spec §10) Limit, Take or Shared. It returns a
// Ticket, or an error that is ErrTimeout, ErrBusy, ErrUnavailable,
// ErrIndeterminate, ErrLimitMismatch, ErrPermissionDenied or
// ErrInvalidArgument (errors.Is). It returns by start + wait + 5 s, or by
// ctx's deadline when that comes first; cancelling ctx withdraws a wait
// (a grant that comes anyway is released).
func (c *Client) Acquire(ctx context.Context, key string, opts ...Option) (*Ticket, error) {
	k, args, err := checkedAcquire(key, opts)
	if err != nil {
		return nil, err
	}
	call := c.acquireCall(ctx, k, args, c.nextID())
	r, err := c.run(ctx, call)
	if err != nil {
		return nil, err
	}
	return c.granted(call, r, true)
}

// granted is the ticket an acquire's result hands over, or its error.
// After Indeterminate with the request possibly sent, cleanUp has the
// client look for a grant and release it (rule 11); a grant noticed at
// or after D is released and the call is indeterminate (rule 7).
func (c *Client) granted(call *call, r result, cleanUp bool) (*Ticket, error) {
	if r.kind != 'A' {
		if cleanUp && r.kind == resIndeterminate && !call.sentAt.IsZero() && r.cause == nil {
			c.cleanUpAfter(call)
		}
		return nil, errorOf(call, r)
	}
	token := r.f.b
	if c.handOverHook != nil {
		c.handOverHook()
	}
	if !time.Now().Before(call.deadline) {
		c.releaseBackground(call.key, token)
		return nil, newError(ErrIndeterminate, "the grant came after the call's deadline and was released")
	}
	lease := time.Duration(call.lease) * time.Second
	t := &Ticket{client: c, keyBytes: call.key, key: string(call.key), token: token,
		limit: call.limit, take: call.take, lease: lease, leaseSentAt: call.sentAt,
		validUntil: validUntil(call.sentAt, lease), label: call.label}
	c.mu.Lock()
	if !c.closing {
		c.tickets[t] = struct{}{}
	}
	c.mu.Unlock()
	return t, nil
}

func (c *Client) simpleCall(ctx context.Context, op byte, key []byte) *call {
	_, d := deadlines(ctx, time.Now(), 0)
	return newCall(op, key, d)
}

// ask runs call and gives its answer's result, or the error.
func (c *Client) ask(ctx context.Context, call *call, want byte) (result, error) {
	r, err := c.run(ctx, call)
	if err != nil {
		return r, err
	}
	if r.kind != want {
		return r, errorOf(call, r)
	}
	return r, nil
}

// Release releases grant token of key (R for exactly that token).
// ErrNotHeld: that token is not the key's active grant.
func (c *Client) Release(ctx context.Context, key string, token uint64) error {
	k, err := checkKey(key)
	if err != nil {
		return err
	}
	call := c.simpleCall(ctx, 'R', k)
	call.token = token
	_, err = c.ask(ctx, call, 'R')
	return err
}

// Renew resets grant token's lease to lease from now (E); it returns the
// new conservative expiry.
func (c *Client) Renew(ctx context.Context, key string, token uint64, lease time.Duration) (time.Time, error) {
	k, err := checkKey(key)
	if err != nil {
		return time.Time{}, err
	}
	l, err := checkLease(lease)
	if err != nil {
		return time.Time{}, err
	}
	call := c.simpleCall(ctx, 'E', k)
	call.token, call.lease = token, l
	if _, err := c.ask(ctx, call, 'E'); err != nil {
		return time.Time{}, err
	}
	return validUntil(call.sentAt, lease), nil
}

// Query is who holds key now (Q): nil when it is free.
func (c *Client) Query(ctx context.Context, key string) (*KeyStatus, error) {
	k, err := checkKey(key)
	if err != nil {
		return nil, err
	}
	r, err := c.ask(ctx, c.simpleCall(ctx, 'Q', k), 'Q')
	if err != nil {
		return nil, err
	}
	f := r.f
	if f.a == 0 && f.b == 0 && f.n1 == 0 && f.n2 == 0 {
		return nil, nil
	}
	return &KeyStatus{Token: f.a, Owner: f.b, LeaseLeft: ms(f.n1), Waiters: f.n2}, nil
}

// Holders is every grant and waiter of key now (spec §11.2).
func (c *Client) Holders(ctx context.Context, key string) (*Holders, error) {
	k, err := checkKey(key)
	if err != nil {
		return nil, err
	}
	call := c.simpleCall(ctx, 'H', k)
	call.owner = c.nextID()
	r, err := c.ask(ctx, call, 'Z')
	if err != nil {
		return nil, err
	}
	return &Holders{Grants: call.grants, Waiters: call.waiters, LeftOut: r.f.b}, nil
}

// ListPage is one page of the keys that start with prefix (spec §11.3):
// up to count (1..=1000) keys and the cursor to go on with (0 at the
// end). Start with cursor 0. A page may be short, even empty, before the
// end.
func (c *Client) ListPage(ctx context.Context, prefix string, cursor uint64, count int) ([]KeyInfo, uint64, error) {
	p, err := checkText(prefix, "prefix", 0, keyLenMax)
	if err != nil {
		return nil, 0, err
	}
	if count < 1 || count > listCountMax {
		return nil, 0, invalid("count must be 1..=%d, got %d", listCountMax, count)
	}
	call := c.simpleCall(ctx, 'L', p)
	call.owner, call.cursor, call.count = c.nextID(), cursor, uint16(count)
	r, err := c.ask(ctx, call, 'Z')
	if err != nil {
		return nil, 0, err
	}
	return call.keys, r.f.b, nil
}

// List calls fn with every key of the server's table that starts with
// prefix, asking for 1000 at a time and following the cursor to the end;
// it stops at fn's first error and returns it. A key in the table for the
// whole listing comes at least once; one may come twice when the table
// grew meanwhile.
func (c *Client) List(ctx context.Context, prefix string, fn func(KeyInfo) error) error {
	var cursor uint64
	for {
		keys, next, err := c.ListPage(ctx, prefix, cursor, listCountMax)
		if err != nil {
			return err
		}
		for _, k := range keys {
			if err := fn(k); err != nil {
				return err
			}
		}
		if next == 0 {
			return nil
		}
		cursor = next
	}
}

// Ping is the round trip of one P.
func (c *Client) Ping(ctx context.Context) (time.Duration, error) {
	call := c.simpleCall(ctx, 'P', nil)
	call.nonce = c.nextID()
	r, err := c.ask(ctx, call, 'P')
	if err != nil {
		return 0, err
	}
	return r.at.Sub(call.sentAt), nil
}

// Info is the server's counters (the I line), name to value.
func (c *Client) Info(ctx context.Context) (map[string]string, error) {
	r, err := c.ask(ctx, c.simpleCall(ctx, 'I', nil), 'I')
	if err != nil {
		return nil, err
	}
	info := make(map[string]string)
	for _, pair := range strings.Fields(r.f.text) {
		if i := strings.IndexByte(pair, '='); i > 0 {
			info[pair[:i]] = pair[i+1:]
		}
	}
	return info, nil
}

// isRetryable: an outcome that asking again later may change.
func isRetryable(err error) bool {
	return errors.Is(err, ErrUnavailable) || errors.Is(err, ErrIndeterminate)
}

package kunci

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// Rule 3: the wire wait is ceil((Dw − now) / 1 s) when the request goes
// out, 0 for an original wait of 0 and once Dw has passed.
func TestWireWait(t *testing.T) {
	t.Parallel()
	now := time.Now()
	cases := []struct {
		set  bool
		left time.Duration
		want uint8
	}{
		{false, 10 * time.Second, 0},
		{true, 2500 * time.Millisecond, 3},
		{true, 3 * time.Second, 3},
		{true, time.Nanosecond, 1},
		{true, 0, 0},
		{true, -time.Second, 0},
		{true, 300 * time.Second, 255},
	}
	for _, tc := range cases {
		if got := wireWait(tc.set, now.Add(tc.left), now); got != tc.want {
			t.Errorf("wireWait(%v, %v) = %d, want %d", tc.set, tc.left, got, tc.want)
		}
	}
}

// The wait byte on the wire is computed when the request is written.
func TestWireWaitOnTheWire(t *testing.T) {
	t.Parallel()
	got := make(chan []byte, 1)
	addr := fakeServer(t, func(req []byte) []byte {
		got <- req
		return append(append([]byte{'T'}, req[3:11]...), '\n') // T owner
	})
	c := dial(t, addr)
	_, err := c.Acquire(bg(), "k", Wait(2500*time.Millisecond), Lease(7*time.Second))
	if !errors.Is(err, ErrTimeout) {
		t.Fatalf("%v, want ErrTimeout", err)
	}
	req := <-got
	if req[0] != 'A' || req[1] != 3 || req[2] != 7 || string(req[11:]) != "k\n" {
		t.Fatalf("request %q", req)
	}
}

// Rule 5 and rule 11: a request possibly sent and unanswered by D is
// ErrIndeterminate, never sent again; the client then finds the grant the
// server made for it and releases it, long before its lease would end.
func TestNoAnswerByTheDeadlineIsIndeterminateNeverResentAndCleanedUp(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	p := newProxy(t, srv.address)
	observer := dial(t, srv.address)
	c := dial(t, p.address)
	p.dropDownNew.Store(true)
	start := time.Now()
	go func() {
		// Later connections (the clean-up's) get their answers.
		waitFor(t, 3*time.Second, "the acquire to be sent", func() bool { return acquireFrames(p.upBytes()) == 1 })
		p.dropDownNew.Store(false)
	}()
	_, err := c.Acquire(bg(), "k", Lease(60*time.Second))
	took := time.Since(start)
	if !errors.Is(err, ErrIndeterminate) {
		t.Fatalf("%v, want ErrIndeterminate", err)
	}
	if took < transportDeadline || took > transportDeadline+2*time.Second {
		t.Fatalf("indeterminate after %v, want D = 5 s", took)
	}
	waitFor(t, 3*time.Second, "the clean-up to release the grant", func() bool {
		st, err := observer.Query(bg(), "k")
		return err == nil && st == nil
	})
	if got := mustInfo(t, observer, "released"); got != "1" {
		t.Fatalf("released=%s", got)
	}
	if n := acquireFrames(p.upBytes()); n != 1 {
		t.Fatalf("%d A frames went out, want exactly 1 (never resent)", n)
	}
	if got := mustInfo(t, observer, "grants"); got != "1" {
		t.Fatalf("grants=%s", got)
	}
}

// Rule 5: a session that dies after the request went out ends the call
// ErrIndeterminate at once; the request is not sent again elsewhere.
func TestSessionDyingAfterTheRequestIsIndeterminateAtOnce(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	p := newProxy(t, srv.address)
	c := dial(t, p.address)
	if _, err := c.Ping(bg()); err != nil {
		t.Fatal(err)
	}
	p.dropUp.Store(true)
	go func() {
		waitFor(t, 3*time.Second, "the acquire to be sent", func() bool { return acquireFrames(p.upBytes()) == 1 })
		p.cut()
	}()
	start := time.Now()
	_, err := c.Acquire(bg(), "k")
	if !errors.Is(err, ErrIndeterminate) {
		t.Fatalf("%v, want ErrIndeterminate", err)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Fatalf("took %v", took)
	}
	time.Sleep(300 * time.Millisecond)
	if n := acquireFrames(p.upBytes()); n != 1 {
		t.Fatalf("%d A frames went out, want 1", n)
	}
}

// Rule 7: a grant noticed at the hand-over gate after D is not handed
// over: that exact token is released and the call is indeterminate; the
// session stays open.
func TestGrantNoticedAfterTheDeadlineIsReleased(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	c := dial(t, srv.address)
	var armed atomic.Bool
	c.handOverHook = func() {
		if armed.CompareAndSwap(true, false) {
			time.Sleep(transportDeadline + 200*time.Millisecond)
		}
	}
	if _, err := c.Ping(bg()); err != nil {
		t.Fatal(err)
	}
	armed.Store(true)
	_, err := c.Acquire(bg(), "k")
	if !errors.Is(err, ErrIndeterminate) {
		t.Fatalf("%v, want ErrIndeterminate", err)
	}
	waitFor(t, 2*time.Second, "the late grant's release", func() bool {
		st, err := c.Query(bg(), "k")
		return err == nil && st == nil
	})
	if g, r, conns := mustInfo(t, c, "grants"), mustInfo(t, c, "released"), mustInfo(t, c, "connections"); g != "1" || r != "1" || conns != "1" {
		t.Fatalf("grants=%s released=%s connections=%s", g, r, conns)
	}
}

// Rule 5 then 7: the reader stalls (a pause) with the grant in hand; at D
// the call ends ErrIndeterminate, and the grant taken in afterwards is
// released, not lost (by the session, which takes in what arrived before
// it closes: rule 11's clean-up is off here).
func TestGrantReadWhileTheDeadlinePassesIsReleased(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	observer := dial(t, srv.address)
	c := dial(t, srv.address)
	c.noCleanUp = true
	var armed atomic.Bool
	c.readHook = func() {
		if armed.CompareAndSwap(true, false) {
			time.Sleep(transportDeadline + 300*time.Millisecond)
		}
	}
	if _, err := c.Ping(bg()); err != nil {
		t.Fatal(err)
	}
	armed.Store(true)
	start := time.Now()
	_, err := c.Acquire(bg(), "k", Lease(60*time.Second))
	if !errors.Is(err, ErrIndeterminate) {
		t.Fatalf("%v, want ErrIndeterminate", err)
	}
	if took := time.Since(start); took < transportDeadline || took > transportDeadline+2*time.Second {
		t.Fatalf("took %v", took)
	}
	waitFor(t, 3*time.Second, "the grant's release", func() bool {
		st, err := observer.Query(bg(), "k")
		return err == nil && st == nil
	})
	if r := mustInfo(t, observer, "released"); r != "1" {
		t.Fatalf("released=%s", r)
	}
}

// Rule 4: a request certainly not sent moves to the next address; X 7 as
// a session's first frame means nothing on it was executed.
func TestNotSentRequestMovesToTheNextAddress(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	c := dial(t, deadAddress(t)+","+srv.address)
	tk, err := c.Acquire(bg(), "k")
	if err != nil {
		t.Fatal(err)
	}
	p := newProxy(t, srv.address)
	p.acceptMode.Store("x7")
	c2 := dial(t, p.address+","+srv.address)
	tk2, err := c2.Acquire(bg(), "k2")
	if err != nil {
		t.Fatalf("after X 7: %v", err)
	}
	if tk2.Token() <= tk.Token() {
		t.Fatal("tokens do not increase")
	}
}

// Rule 4: X 9 from every address ends the call ErrUnavailable at once,
// naming the reason.
func TestNotAllowedEverywhereIsUnavailableAtOnce(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	p := newProxy(t, srv.address)
	p.acceptMode.Store("x9")
	c := dial(t, p.address)
	start := time.Now()
	_, err := c.Acquire(bg(), "k")
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "X 9") {
		t.Fatalf("%v, want ErrUnavailable naming X 9", err)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Fatalf("took %v", took)
	}
}

// Rule 4: nothing listening is ErrUnavailable at D; a context's earlier
// deadline is D.
func TestUnavailableAtTheDeadline(t *testing.T) {
	t.Parallel()
	c := dial(t, deadAddress(t))
	ctx, cancel := context.WithTimeout(bg(), 700*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := c.Acquire(ctx, "k")
	took := time.Since(start)
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("%v, want ErrUnavailable", err)
	}
	if took < 700*time.Millisecond || took > 3*time.Second {
		t.Fatalf("took %v, want the context's deadline", took)
	}
}

// A renewal without an answer: ErrIndeterminate, and valid_until keeps
// the earlier of the two bounds.
func TestIndeterminateRenewalKeepsTheEarlierBound(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	p := newProxy(t, srv.address)
	c := dial(t, p.address)
	tk, err := c.Acquire(bg(), "k", Lease(60*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	p.dropDown.Store(true)
	ctx, cancel := context.WithTimeout(bg(), 500*time.Millisecond)
	defer cancel()
	started := time.Now()
	err = tk.Renew(ctx, 2*time.Second)
	ended := time.Now()
	if !errors.Is(err, ErrIndeterminate) {
		t.Fatalf("%v, want ErrIndeterminate", err)
	}
	vu := tk.ValidUntil()
	margin := driftMargin(2 * time.Second)
	if vu.Before(started.Add(2*time.Second-margin)) || vu.After(ended.Add(2*time.Second-margin)) {
		t.Fatalf("valid_until %v after the renewal's start, want 2 s − %v", vu.Sub(started), margin)
	}
}

// An answer that matches no request ends the session: ErrIndeterminate.
func TestUncorrelatedAnswerEndsTheSession(t *testing.T) {
	t.Parallel()
	addr := fakeServer(t, func(req []byte) []byte {
		return []byte{'T', 0, 0, 0, 0, 0, 0, 0, 9, '\n'}
	})
	c := dial(t, addr)
	if _, err := c.Acquire(bg(), "k"); !errors.Is(err, ErrIndeterminate) || !strings.Contains(err.Error(), "matches no request") {
		t.Fatalf("%v, want ErrIndeterminate", err)
	}
	addr = fakeServer(t, func(req []byte) []byte { return []byte("?garbage\n") })
	c = dial(t, addr)
	if _, err := c.Ping(bg()); !errors.Is(err, ErrIndeterminate) {
		t.Fatalf("%v, want ErrIndeterminate", err)
	}
}

// Cancelling a waiting acquire withdraws its wait at once.
func TestCancelledWaitIsWithdrawn(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	holderClient := dial(t, srv.address)
	if _, err := holderClient.Acquire(bg(), "k"); err != nil {
		t.Fatal(err)
	}
	c := dial(t, srv.address)
	ctx, cancel := context.WithCancel(bg())
	go func() {
		waitFor(t, 2*time.Second, "the waiter", func() bool {
			st, _ := holderClient.Query(bg(), "k")
			return st != nil && st.Waiters == 1
		})
		cancel()
	}()
	start := time.Now()
	_, err := c.Acquire(ctx, "k", Wait(30*time.Second))
	if !errors.Is(err, context.Canceled) || !errors.Is(err, ErrIndeterminate) {
		t.Fatalf("%v, want context.Canceled", err)
	}
	if took := time.Since(start); took > 2500*time.Millisecond {
		t.Fatalf("took %v", took)
	}
	waitFor(t, time.Second, "the wait to be withdrawn", func() bool {
		st, _ := holderClient.Query(bg(), "k")
		return st != nil && st.Waiters == 0
	})
}

// B is definitive.
func TestBusyIsDefinitive(t *testing.T) {
	t.Parallel()
	srv := startServer(t, "--max-keys", "1")
	c := dial(t, srv.address)
	if _, err := c.Acquire(bg(), "a"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Acquire(bg(), "b"); !errors.Is(err, ErrBusy) {
		t.Fatalf("%v, want ErrBusy", err)
	}
}

// Close releases the tickets not released or detached, within 0.5 s.
func TestCloseReleasesTickets(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	observer := dial(t, srv.address)
	c, err := Dial(srv.address)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"a", "b"} {
		if _, err := c.Acquire(bg(), k); err != nil {
			t.Fatal(err)
		}
	}
	kept, err := c.Acquire(bg(), "kept")
	if err != nil {
		t.Fatal(err)
	}
	kept.Detach()
	start := time.Now()
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > time.Second {
		t.Fatalf("Close took %v", took)
	}
	for _, k := range []string{"a", "b"} {
		if st, _ := observer.Query(bg(), k); st != nil {
			t.Fatalf("%s still held", k)
		}
	}
	if st, _ := observer.Query(bg(), "kept"); st == nil || st.Token != kept.Token() {
		t.Fatal("the detached ticket was released")
	}
	if _, err := c.Acquire(bg(), "x"); !errors.Is(err, ErrClosed) {
		t.Fatalf("after Close: %v", err)
	}
}

package kunci

import (
	"errors"
	"strconv"
	"testing"
	"time"
)

// Rule 10: a managed lock is renewed every lease/3 while held.
func TestLockIsKeptAlive(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	c := dial(t, srv.address)
	l, err := c.Lock(bg(), "k", Lease(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(2500 * time.Millisecond)
	select {
	case <-l.Lost():
		t.Fatal("lost while renewed")
	default:
	}
	if err := l.Check(); err != nil {
		t.Fatal(err)
	}
	st, err := c.Query(bg(), "k")
	if err != nil || st == nil || st.Token != l.Token() {
		t.Fatalf("query %+v %v", st, err)
	}
	if ext, _ := strconv.Atoi(mustInfo(t, c, "extended")); ext < 5 {
		t.Fatalf("extended=%d after 2.5 s of a 1 s lease, want ≥ 5 (every lease/3)", ext)
	}
	if err := l.Unlock(bg()); err != nil {
		t.Fatal(err)
	}
	if st, _ := c.Query(bg(), "k"); st != nil {
		t.Fatal("still held after Unlock")
	}
}

// Rule 10: a renewal answered N is a loss: Lost closes, renewal stops, and
// Unlock sends nothing and says ErrLockLost.
func TestLockLostWhenRenewalIsAnsweredN(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	c := dial(t, srv.address)
	other := dial(t, srv.address)
	l, err := c.Lock(bg(), "k", Lease(3*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if err := other.Release(bg(), "k", l.Token()); err != nil {
		t.Fatal(err)
	}
	select {
	case <-l.Lost():
	case <-time.After(3 * time.Second):
		t.Fatal("loss not reported")
	}
	if err := l.Check(); !errors.Is(err, ErrLockLost) {
		t.Fatalf("Check: %v", err)
	}
	if err := l.Unlock(bg()); !errors.Is(err, ErrLockLost) {
		t.Fatalf("Unlock: %v, want ErrLockLost", err)
	}
	if got := mustInfo(t, c, "not_held"); got != "1" {
		t.Fatalf("not_held=%s (Unlock after the loss sent something)", got)
	}
}

// Rule 10: when renewals go unanswered, the loss is declared at
// valid_until, never before.
func TestLockLostAtValidUntilWithoutRenewal(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	p := newProxy(t, srv.address)
	c := dial(t, p.address)
	l, err := c.Lock(bg(), "k", Lease(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	vu := l.ValidUntil()
	p.dropUp.Store(true)
	select {
	case <-l.Lost():
		if now := time.Now(); now.Before(vu) {
			t.Fatalf("lost %v before valid_until", vu.Sub(now))
		} else if now.Sub(vu) > 2*time.Second {
			t.Fatalf("lost %v after valid_until", now.Sub(vu))
		}
	case <-time.After(4 * time.Second):
		t.Fatal("loss not reported")
	}
}

// Rule 10: a grant that comes after a wait with less than two thirds of
// its lease left is renewed before it is handed over.
func TestLateGrantIsRenewedBeforeHandOver(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	c := dial(t, srv.address)
	holder, err := c.Acquire(bg(), "k")
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(1500 * time.Millisecond)
		_ = holder.Release(bg())
	}()
	l, err := c.Lock(bg(), "k", Wait(10*time.Second), Lease(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Unlock(bg())
	// Counted from the acquire's send, valid_until had passed at the
	// grant: the renewal before the hand-over moved it a lease ahead.
	if left := time.Until(l.ValidUntil()); left <= 0 {
		t.Fatalf("handed over %v past valid_until", -left)
	}
	if ext, _ := strconv.Atoi(mustInfo(t, c, "extended")); ext < 1 {
		t.Fatalf("extended=%d, want the renewal before hand-over", ext)
	}
}

// Rule 10: if the renewal before hand-over is answered N, the call ends
// ErrLockLost and nothing is handed over.
func TestLateGrantWhoseRenewalIsNIsNotHandedOver(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	p := newProxy(t, srv.address)
	c := dial(t, p.address)
	if _, err := c.Ping(bg()); err != nil {
		t.Fatal(err)
	}
	// The grant (lease 1 s) reaches the client 1.3 s late: the server has
	// taken it back by the renewal.
	p.downDelay.Store(int64(1300 * time.Millisecond))
	_, err := c.Lock(bg(), "k", Lease(time.Second))
	if !errors.Is(err, ErrLockLost) {
		t.Fatalf("%v, want ErrLockLost", err)
	}
}

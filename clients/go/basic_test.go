package kunci

import (
	"errors"
	"strconv"
	"testing"
	"time"
)

func TestAcquireReleaseQueryInfoPing(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	c := dial(t, srv.address)
	before := time.Now()
	tk, err := c.Acquire(bg(), "k", Lease(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if tk.Token() == 0 || tk.Key() != "k" {
		t.Fatalf("ticket %+v", tk)
	}
	// valid_until: the send instant + lease − (10 ms + lease/500).
	vu := tk.ValidUntil()
	if vu.Before(before.Add(10*time.Second-30*time.Millisecond)) || vu.After(time.Now().Add(10*time.Second-30*time.Millisecond)) {
		t.Fatalf("valid_until %v not send instant + 10 s − 30 ms", vu.Sub(before))
	}
	st, err := c.Query(bg(), "k")
	if err != nil || st == nil || st.Token != tk.Token() || st.Waiters != 0 {
		t.Fatalf("query: %+v %v", st, err)
	}
	if st.LeaseLeft <= 9*time.Second || st.LeaseLeft > 10*time.Second {
		t.Fatalf("lease left %v", st.LeaseLeft)
	}
	if _, err := c.Acquire(bg(), "k"); !errors.Is(err, ErrTimeout) {
		t.Fatalf("second acquire: %v, want ErrTimeout", err)
	}
	if err := tk.Release(bg()); err != nil {
		t.Fatal(err)
	}
	if err := tk.Release(bg()); !errors.Is(err, ErrLockLost) {
		t.Fatalf("second release: %v, want ErrLockLost (nothing sent)", err)
	}
	if st, err := c.Query(bg(), "k"); err != nil || st != nil {
		t.Fatalf("query after release: %+v %v", st, err)
	}
	if got := mustInfo(t, c, "released"); got != "1" {
		t.Fatalf("released=%s", got)
	}
	if rtt, err := c.Ping(bg()); err != nil || rtt <= 0 || rtt > time.Second {
		t.Fatalf("ping %v %v", rtt, err)
	}
	if err := c.Release(bg(), "k", tk.Token()); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("release of a released token: %v, want ErrNotHeld", err)
	}
}

func TestTokensIncreaseAndRenewMovesValidUntil(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	c := dial(t, srv.address)
	a, err := c.Acquire(bg(), "a")
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.Acquire(bg(), "b")
	if err != nil {
		t.Fatal(err)
	}
	if b.Token() <= a.Token() {
		t.Fatalf("tokens %d then %d", a.Token(), b.Token())
	}
	time.Sleep(20 * time.Millisecond)
	sent := time.Now()
	if err := a.Renew(bg(), 5*time.Second); err != nil {
		t.Fatal(err)
	}
	vu := a.ValidUntil()
	if vu.Before(sent.Add(5*time.Second-20*time.Millisecond)) || vu.After(time.Now().Add(5*time.Second-20*time.Millisecond)) {
		t.Fatalf("valid_until after renew: %v from the send", vu.Sub(sent))
	}
	if a.Lease() != 5*time.Second {
		t.Fatalf("lease %v", a.Lease())
	}
}

func TestInvalidInputSendsNothing(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	p := newProxy(t, srv.address)
	c := dial(t, p.address)
	long := make([]byte, 256)
	for i := range long {
		long[i] = 'k'
	}
	cases := []struct {
		key  string
		opts []Option
	}{
		{"", nil},
		{string(long), nil},
		{"a\nb", nil},
		{"\xff", nil},
		{"k", []Option{Lease(0)}},
		{"k", []Option{Lease(1500 * time.Millisecond)}},
		{"k", []Option{Lease(256 * time.Second)}},
		{"k", []Option{Wait(256 * time.Second)}},
		{"k", []Option{Wait(-time.Second)}},
		{"k", []Option{Take(2)}},
		{"k", []Option{Limit(0)}},
		{"k", []Option{Limit(2), Take(3)}},
		{"k", []Option{Shared(), Limit(3)}},
		{"k", []Option{Label(string(long[:129]))}},
		{"k", []Option{Label("a\nb")}},
		{"k", []Option{Secret("x")}},
	}
	for i, tc := range cases {
		if _, err := c.Acquire(bg(), tc.key, tc.opts...); !errors.Is(err, ErrInvalidArgument) {
			t.Fatalf("case %d: %v, want ErrInvalidArgument", i, err)
		}
	}
	if _, _, err := c.ListPage(bg(), "", 0, 1001); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("list count 1001: %v", err)
	}
	if p.accepted.Load() != 0 || len(p.upBytes()) != 0 {
		t.Fatalf("something was sent: %q", p.upBytes())
	}
	if _, err := Dial("a:b:c"); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("Dial of a bad address: %v", err)
	}
	if _, err := Dial("", Wait(time.Second)); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("Dial with a call option: %v", err)
	}
}

func TestWaiterGetsTheKeyOnRelease(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	c := dial(t, srv.address)
	holder, err := c.Acquire(bg(), "k")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *Ticket, 1)
	errs := make(chan error, 1)
	go func() {
		tk, err := c.Acquire(bg(), "k", Wait(10*time.Second))
		got <- tk
		errs <- err
	}()
	waitFor(t, 2*time.Second, "a waiter", func() bool {
		st, _ := c.Query(bg(), "k")
		return st != nil && st.Waiters == 1
	})
	if err := holder.Release(bg()); err != nil {
		t.Fatal(err)
	}
	tk := <-got
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	if tk.Token() <= holder.Token() {
		t.Fatalf("waiter's token %d not above %d", tk.Token(), holder.Token())
	}
}

func TestTimeoutIsDefinitiveAtTheWireWait(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	c := dial(t, srv.address)
	if _, err := c.Acquire(bg(), "k"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err := c.Acquire(bg(), "k", Wait(1200*time.Millisecond))
	took := time.Since(start)
	if !errors.Is(err, ErrTimeout) {
		t.Fatalf("%v, want ErrTimeout", err)
	}
	// The wire wait is ceil(1.2 s) = 2 s: never earlier.
	if took < 2*time.Second || took > 5*time.Second {
		t.Fatalf("timeout after %v", took)
	}
	if got := mustInfo(t, c, "waiters"); got != "0" {
		t.Fatalf("waiters=%s", got)
	}
	_ = strconv.Itoa
}

package kunci

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func nextLeader(t *testing.T, ch <-chan *Leader) *Leader {
	t.Helper()
	select {
	case l, ok := <-ch:
		if !ok {
			t.Fatal("Observe's channel closed")
		}
		return l
	case <-time.After(5 * time.Second):
		t.Fatal("no report from Observe")
	}
	return nil
}

func TestElection(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	c := dial(t, srv.address)
	if l, err := c.Leader(bg(), "e"); err != nil || l != nil {
		t.Fatalf("leader of nobody: %+v %v", l, err)
	}
	ctx, cancel := context.WithCancel(bg())
	defer cancel()
	watch := c.Observe(ctx, "e")
	if l := nextLeader(t, watch); l != nil {
		t.Fatalf("first report %+v, want nil", l)
	}
	a, err := c.Campaign(bg(), "e", "alpha", Lease(3*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	l := nextLeader(t, watch)
	if l == nil || l.Value != "alpha" || l.Term != a.Term() {
		t.Fatalf("report %+v, want alpha term %d", l, a.Term())
	}
	got, err := c.Leader(bg(), "e")
	if err != nil || got == nil || got.Value != "alpha" || got.Term != a.Term() || got.HeldFor < 0 || got.HeldFor > 5*time.Second {
		t.Fatalf("Leader %+v %v", got, err)
	}
	// A second candidate waits; a bounded campaign runs out.
	if _, err := c.Campaign(bg(), "e", "late", Wait(300*time.Millisecond)); !errors.Is(err, ErrTimeout) {
		t.Fatalf("bounded campaign: %v, want ErrTimeout", err)
	}
	elected := make(chan *Leadership, 1)
	go func() {
		b, err := c.Campaign(bg(), "e", "beta", Lease(3*time.Second))
		if err != nil {
			t.Error(err)
		}
		elected <- b
	}()
	time.Sleep(4 * time.Second) // longer than the lease: kept alive
	select {
	case <-a.Lost():
		t.Fatal("the leader lost its lead while renewed")
	case <-elected:
		t.Fatal("beta elected while alpha leads")
	default:
	}
	if err := a.Resign(bg()); err != nil {
		t.Fatal(err)
	}
	b := <-elected
	if b == nil {
		t.FailNow()
	}
	defer b.Resign(bg())
	if b.Term() <= a.Term() {
		t.Fatalf("term %d after %d", b.Term(), a.Term())
	}
	l = nextLeader(t, watch)
	if l == nil || l.Value != "beta" || l.Term != b.Term() {
		t.Fatalf("report %+v, want beta", l)
	}
	// Resigning a lost lead returns quietly.
	if err := a.Resign(bg()); err != nil {
		t.Fatalf("second resign: %v", err)
	}
	cancel()
	for range watch {
	}
}

// Proclaim (spec §13.4a) changes the value without losing the term;
// observers see it. It needs a server that knows C.
func TestProclaim(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	c := dial(t, srv.address)
	lead, err := c.Campaign(bg(), "p", "one")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(bg())
	defer cancel()
	watch := c.Observe(ctx, "p")
	if l := nextLeader(t, watch); l == nil || l.Value != "one" {
		t.Fatalf("first report %+v", l)
	}
	if err := lead.Proclaim(bg(), "two"); err != nil {
		if strings.Contains(err.Error(), "server error 1:") {
			t.Fatalf("the server at %s does not know C (proclaim, spec §13.4a): %v", kunciBin(t), err)
		}
		t.Fatal(err)
	}
	l := nextLeader(t, watch)
	if l == nil || l.Value != "two" || l.Term != lead.Term() {
		t.Fatalf("after Proclaim: %+v, want two, term %d", l, lead.Term())
	}
	if got, err := c.Leader(bg(), "p"); err != nil || got.Value != "two" || got.Term != lead.Term() {
		t.Fatalf("Leader %+v %v", got, err)
	}
	if err := lead.Resign(bg()); err != nil {
		t.Fatal(err)
	}
	if err := lead.Proclaim(bg(), "three"); !errors.Is(err, ErrLockLost) {
		t.Fatalf("Proclaim after Resign: %v, want ErrLockLost", err)
	}
}

// Observe goes on quietly through a server restart and reports the state
// it finds.
func TestObserveFollowsThroughAnOutage(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	p := newProxy(t, srv.address)
	c := dial(t, p.address)
	holder := dial(t, srv.address)
	ctx, cancel := context.WithCancel(bg())
	defer cancel()
	watch := c.Observe(ctx, "o")
	if l := nextLeader(t, watch); l != nil {
		t.Fatalf("%+v", l)
	}
	p.cut()
	lead, err := holder.Campaign(bg(), "o", "after")
	if err != nil {
		t.Fatal(err)
	}
	defer lead.Resign(bg())
	if l := nextLeader(t, watch); l == nil || l.Value != "after" || l.Term != lead.Term() {
		t.Fatalf("%+v", l)
	}
}

// Spec §13.6 (v5): during the grace after a server's crash the leader is
// not "none" but unknown (term 0), for Leader and for an observer that
// has reported nothing yet.
func TestLeaderDuringACrashGrace(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	addr := "unix:" + filepath.Join(dir, "kunci.sock") // the same address after a restart
	srv := startServer(t, "--state-dir", dir, "--listen", addr)
	c := dial(t, addr)
	// The candidate's grant, not kept alive (a kept-alive lead would adopt
	// its grant back at once).
	if _, err := c.Acquire(bg(), "g", Label("v"), Lease(10*time.Second)); err != nil {
		t.Fatal(err)
	}
	srv.crash()
	startServer(t, "--state-dir", dir, "--listen", addr)
	fresh := dial(t, addr)
	l, err := fresh.Leader(bg(), "g")
	if err != nil || l == nil || l.Term != 0 || l.Value != "" || l.HeldFor != -1 {
		t.Fatalf("Leader during the grace: %+v %v, want the unknown leader", l, err)
	}
	ctx, cancel := context.WithCancel(bg())
	defer cancel()
	if l := nextLeader(t, fresh.Observe(ctx, "g")); l == nil || l.Term != 0 {
		t.Fatalf("Observe during the grace: %+v, want the unknown leader", l)
	}
}

// A campaign waits through a server restart (spec §9's --wait inf): the
// B of a server shutting down, and the outage after it, are waited
// through; it leads once the key is free on the restarted server.
func TestCampaignWaitsThroughARestart(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	addr := "unix:" + filepath.Join(dir, "kunci.sock") // the same address after a restart
	srv := startServer(t, "--state-dir", dir, "--listen", addr)
	holder := dial(t, addr)
	held, err := holder.Acquire(bg(), "e", Label("first"))
	if err != nil {
		t.Fatal(err)
	}
	c := dial(t, addr)
	elected := make(chan *Leadership, 1)
	go func() {
		lead, err := c.Campaign(bg(), "e", "second")
		if err != nil {
			t.Error(err)
		}
		elected <- lead
	}()
	waitFor(t, 3*time.Second, "the candidate to queue", func() bool {
		st, _ := holder.Query(bg(), "e")
		return st != nil && st.Waiters == 1
	})
	srv.stop() // answers the waiter B, then X 8
	time.Sleep(300 * time.Millisecond)
	startServer(t, "--state-dir", dir, "--listen", addr) // the held grant is restored
	waitFor(t, 5*time.Second, "the candidate to queue again", func() bool {
		st, _ := holder.Query(bg(), "e")
		return st != nil && st.Waiters == 1 && st.Token == held.Token()
	})
	select {
	case <-elected:
		t.Fatal("elected while the key is held")
	default:
	}
	if err := held.Release(bg()); err != nil {
		t.Fatal(err)
	}
	select {
	case lead := <-elected:
		if lead == nil || lead.Term() <= held.Token() {
			t.Fatalf("lead %+v", lead)
		}
		_ = lead.Resign(bg())
	case <-time.After(5 * time.Second):
		t.Fatal("not elected after the release")
	}
}

// A campaign whose grant a server restarted after a crash adopted (its
// keep-alive renews it during the grace; the server keeps it without its
// label, spec §7.5) proclaims its value — the latest proclaimed — again
// at once: the leader is known by its value again, with the same term.
func TestCampaignProclaimsItsValueAgainAfterAnAdoption(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	addr := "unix:" + filepath.Join(dir, "kunci.sock") // the same address after a restart
	srv := startServer(t, "--state-dir", dir, "--listen", addr)
	c := dial(t, addr)
	lead, err := c.Campaign(bg(), "adopted", "host a", Lease(6*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if err := lead.Proclaim(bg(), "host b"); err != nil {
		t.Fatal(err)
	}
	srv.crash()
	startServer(t, "--state-dir", dir, "--listen", addr)
	fresh := dial(t, addr)
	var last *Leader
	waitFor(t, 6*time.Second, "the value proclaimed again", func() bool {
		l, err := fresh.Leader(bg(), "adopted")
		last = l
		return err == nil && l != nil && l.Value != ""
	})
	if last.Value != "host b" || last.Term != lead.Term() {
		t.Fatalf("leader %+v, want host b with term %d", last, lead.Term())
	}
	select {
	case <-lead.Lost():
		t.Fatal("the lead was lost")
	default:
	}
	if err := lead.Resign(bg()); err != nil {
		t.Fatal(err)
	}
}

package kunci

import (
	"errors"
	"fmt"
	"sort"
	"testing"
	"time"
)

func TestSemaphoreAndLimitMismatch(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	c := dial(t, srv.address)
	a, err := c.Acquire(bg(), "sem", Limit(2), Label("first"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.Acquire(bg(), "sem", Limit(2))
	if err != nil {
		t.Fatal(err)
	}
	if a.Limit() != 2 || a.Take() != 1 || b.Token() <= a.Token() {
		t.Fatalf("tickets %d/%d, tokens %d %d", a.Limit(), a.Take(), a.Token(), b.Token())
	}
	if _, err := c.Acquire(bg(), "sem", Limit(2)); !errors.Is(err, ErrTimeout) {
		t.Fatalf("third permit: %v, want ErrTimeout", err)
	}
	_, err = c.Acquire(bg(), "sem", Limit(3))
	var lm *LimitMismatchError
	if !errors.Is(err, ErrLimitMismatch) || !errors.As(err, &lm) || lm.KeyLimit != 2 {
		t.Fatalf("%v, want ErrLimitMismatch with the key's limit 2", err)
	}
	h, err := c.Holders(bg(), "sem")
	if err != nil {
		t.Fatal(err)
	}
	if len(h.Grants) != 2 || h.Grants[0].Token != a.Token() || h.Grants[0].Label != "first" ||
		h.Grants[0].Take != 1 || h.Grants[1].Token != b.Token() || len(h.Waiters) != 0 || h.LeftOut != 0 {
		t.Fatalf("holders %+v", h)
	}
	if err := a.Release(bg()); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Acquire(bg(), "sem", Limit(2), Take(2)); !errors.Is(err, ErrTimeout) {
		t.Fatalf("take 2 with one permit free: %v", err)
	}
}

func TestSharedAndExclusive(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	c := dial(t, srv.address)
	r1, err := c.Acquire(bg(), "rw", Shared())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Acquire(bg(), "rw", Shared()); err != nil {
		t.Fatal(err)
	}
	if r1.Limit() != SharedLimit || r1.Take() != 1 {
		t.Fatalf("shared is %d/%d", r1.Limit(), r1.Take())
	}
	if _, err := c.Acquire(bg(), "rw"); !errors.Is(err, ErrTimeout) {
		t.Fatalf("exclusive beside readers: %v", err)
	}
	// A writer that waits is granted once the readers are gone, and
	// nobody overtakes it.
	done := make(chan error, 1)
	go func() {
		_, err := c.Acquire(bg(), "rw", Wait(5*time.Second), Label("writer"))
		done <- err
	}()
	waitFor(t, 2*time.Second, "the writer to queue", func() bool {
		h, _ := c.Holders(bg(), "rw")
		return h != nil && len(h.Waiters) == 1 && h.Waiters[0].Label == "writer" && h.Waiters[0].Take == 0
	})
	if _, err := c.Acquire(bg(), "rw", Shared()); !errors.Is(err, ErrTimeout) {
		t.Fatalf("reader overtook a queued writer: %v", err)
	}
}

func TestListFollowsTheCursor(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	c := dial(t, srv.address)
	for i := 0; i < 30; i++ {
		if _, err := c.Acquire(bg(), fmt.Sprintf("p-%02d", i)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Acquire(bg(), "other"); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	if err := c.List(bg(), "p-", func(k KeyInfo) error {
		if k.Grants != 1 || k.Waiters != 0 {
			return fmt.Errorf("key %+v", k)
		}
		seen[k.Key] = true
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var keys []string
	for k := range seen {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	if len(keys) != 30 || keys[0] != "p-00" || keys[29] != "p-29" {
		t.Fatalf("listed %v", keys)
	}
	// Pages of 7: every key comes, through the cursor.
	count, cursor := 0, uint64(0)
	for {
		page, next, err := c.ListPage(bg(), "p-", cursor, 7)
		if err != nil {
			t.Fatal(err)
		}
		if len(page) > 7 {
			t.Fatalf("page of %d", len(page))
		}
		count += len(page)
		if next == 0 {
			break
		}
		cursor = next
	}
	if count < 30 {
		t.Fatalf("pages gave %d keys", count)
	}
	stop := errors.New("stop")
	if err := c.List(bg(), "", func(KeyInfo) error { return stop }); err != stop {
		t.Fatalf("List did not return fn's error: %v", err)
	}
}

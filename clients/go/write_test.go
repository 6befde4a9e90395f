package kunci

import (
	"errors"
	"net"
	"testing"
	"time"
)

// shortConn takes limit bytes, then fails every write.
type shortConn struct {
	net.Conn
	limit   int
	written []byte
}

func (c *shortConn) Write(b []byte) (int, error) {
	if len(b) <= c.limit {
		c.limit -= len(b)
		c.written = append(c.written, b...)
		return len(b), nil
	}
	n := c.limit
	c.limit = 0
	c.written = append(c.written, b[:n]...)
	return n, errors.New("connection reset by peer")
}
func (c *shortConn) Close() error                       { return nil }
func (c *shortConn) SetWriteDeadline(t time.Time) error { return nil }

// Rules 4 and 5 on a write that failed part-way through a burst of
// pipelined frames: a frame with any byte taken by the socket is
// possibly sent (ErrIndeterminate, never moved); a frame none of whose
// bytes went out is certainly not sent and moves on.
func TestPartWrittenBurst(t *testing.T) {
	t.Parallel()
	client, err := Dial("127.0.0.1:1")
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	ping := func() *call {
		c := newCall('P', nil, time.Now().Add(time.Minute))
		c.nonce = client.nextID()
		return c
	}
	whole, part, none := ping(), ping(), ping()
	conn := &shortConn{limit: 10 + 3} // a P frame is 10 bytes
	s := newSession(client, 0, conn, false, false)
	s.flushing = true // another goroutine is writing: the frames queue
	for _, c := range []*call{whole, part, none} {
		if !s.write(c) {
			t.Fatal("not queued")
		}
	}
	s.flush(4)
	if r := <-none.done; r.kind != resMoved {
		t.Fatalf("the unsent frame: %q, want moved", r.kind)
	}
	for _, c := range []*call{whole, part} {
		if r := <-c.done; r.kind != resIndeterminate {
			t.Fatalf("a frame with bytes out: %q, want indeterminate", r.kind)
		}
	}
	if len(conn.written) != 13 || s.alive.Load() {
		t.Fatalf("wrote %d bytes, alive %v", len(conn.written), s.alive.Load())
	}
	// A session that ended before its write sends nothing: moved.
	late := ping()
	if s.write(late) {
		t.Fatal("queued on an ended session")
	}
}

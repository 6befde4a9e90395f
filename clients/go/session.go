package kunci

import (
	"errors"
	"fmt"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// session is one connection to one address. Callers write their own
// requests (so the wire wait and the send instant are taken just before
// the bytes go to the socket); one reader goroutine hands each answer to
// the call it correlates with: acquires by owner, the others by
// token/nonce/id in request order (spec §2.3).
type session struct {
	client *Client
	index  int
	conn   net.Conn
	tls    bool
	alive  atomic.Bool
	// draining: the session takes in what arrives for drainWait, then
	// ends (a call's D passed unanswered: rule 5).
	draining atomic.Bool

	// Under mu: frames queued for the goroutine that is writing.
	out        []byte
	outCalls   []queued
	spare      []byte
	spareCalls []queued
	flushing   bool

	mu             sync.Mutex
	acquires       map[uint64]*call
	others         []*call
	frames         int
	authenticating bool
	refused        string // a first-frame X 7 / X 9: nothing was executed
	refusedCode    byte
	denied         string // the credentials were refused: nothing executed
	shuttingDown   bool
	failure        string
	drainReason    string
}

// drainWait is how long a session whose call reached D unanswered still
// takes in answers before it closes, so that an answer already on its way
// is handled by rules 6–7 instead of being lost (rule 5).
const drainWait = 5 * time.Millisecond

// usable: alive and not draining.
func (s *session) usable() bool { return s.alive.Load() && !s.draining.Load() }

// closeAfterDrainLocked ends the session drainWait from now, after it
// has taken in what arrived.
func (s *session) closeAfterDrainLocked(reason string) {
	if !s.alive.Load() || s.draining.Load() {
		return
	}
	s.draining.Store(true)
	s.drainReason = reason
	_ = s.conn.SetReadDeadline(time.Now().Add(drainWait))
}

func newSession(client *Client, index int, conn net.Conn, isTLS, authenticating bool) *session {
	s := &session{client: client, index: index, conn: conn, tls: isTLS,
		acquires: make(map[uint64]*call), authenticating: authenticating}
	s.alive.Store(true)
	return s
}

func (s *session) addLocked(c *call) {
	if c.isAcquire() {
		s.acquires[c.owner] = c
	} else {
		s.others = append(s.others, c)
	}
}

func (s *session) hasLocked(c *call) bool {
	if c.isAcquire() {
		return s.acquires[c.owner] == c
	}
	for _, o := range s.others {
		if o == c {
			return true
		}
	}
	return false
}

func (s *session) removeLocked(c *call) bool {
	if c.isAcquire() {
		if s.acquires[c.owner] == c {
			delete(s.acquires, c.owner)
			return true
		}
		return false
	}
	for i, o := range s.others {
		if o == c {
			s.others = append(s.others[:i], s.others[i+1:]...)
			return true
		}
	}
	return false
}

func (s *session) pendingLocked() int { return len(s.acquires) + len(s.others) }

// takeOther takes out the first other request that matches.
func (s *session) takeOther(match func(*call) bool) *call {
	for i, o := range s.others {
		if match(o) {
			s.others = append(s.others[:i], s.others[i+1:]...)
			return o
		}
	}
	return nil
}

func (s *session) findListing(id uint64) *call {
	for _, o := range s.others {
		if (o.op == 'H' || o.op == 'L') && o.owner == id {
			return o
		}
	}
	return nil
}

// write queues c on this session and sees it written: by this goroutine
// when no other is writing (one system call, no hand-off), else by the
// goroutine that is, together with every frame queued meanwhile (a
// pipelined burst goes out in one write). False: the session was not
// usable and nothing was queued. A call whose bytes the socket took none
// of gets a moved result (certainly not sent: rule 4).
func (s *session) write(c *call) bool {
	s.mu.Lock()
	if !s.usable() {
		s.mu.Unlock()
		return false
	}
	s.addLocked(c)
	c.writing = true
	// The send instant and the wire wait are taken as the frame is queued,
	// just before the write that carries it: the send instant is never
	// later than the first byte's (valid_until stays conservative).
	now := time.Now()
	c.sentAt = now
	s.out = c.encode(s.out, now)
	s.outCalls = append(s.outCalls, queued{c, len(s.out)})
	if s.flushing {
		s.mu.Unlock()
		return true
	}
	s.flushing = true
	s.mu.Unlock()
	// Goroutines that are ready to run (woken by the answers of one read)
	// queue their frames behind this one first: one write carries them.
	runtime.Gosched()
	s.flush(4)
	return true
}

// queued is a call in the output buffer and where its frame ends.
type queued struct {
	c   *call
	end int
}

// flush writes the queued frames until none is left; after rounds
// writes it hands the rest to a goroutine of its own, so that a caller
// never writes for others for long.
func (s *session) flush(rounds int) {
	for round := 0; ; round++ {
		s.mu.Lock()
		if len(s.out) == 0 {
			s.flushing = false
			s.mu.Unlock()
			return
		}
		if round == rounds {
			s.mu.Unlock()
			go s.flush(-1)
			return
		}
		buf, calls := s.out, s.outCalls
		s.out, s.outCalls = s.spare[:0], s.spareCalls[:0]
		deadline := calls[0].c.deadline
		for _, q := range calls[1:] {
			if q.c.deadline.Before(deadline) {
				deadline = q.c.deadline
			}
		}
		dead := !s.alive.Load()
		s.mu.Unlock()
		var n int
		var err error
		if dead {
			err = errors.New("the session had ended")
		} else {
			_ = s.conn.SetWriteDeadline(deadline)
			n, err = s.conn.Write(buf)
		}
		s.mu.Lock()
		s.settleWriteLocked(calls, n, err, dead)
		for i := range calls {
			calls[i] = queued{}
		}
		s.spare, s.spareCalls = buf[:0], calls[:0]
		s.mu.Unlock()
	}
}

// settleWriteLocked: the write of calls' frames took n bytes and ended
// with err. A call none of whose bytes went out (and, over TLS, only when
// nothing was written at all) is certainly not sent: it moves on. The
// rest are possibly sent: they wait for their answers, or get the closed
// result if the session ended.
func (s *session) settleWriteLocked(calls []queued, n int, err error, dead bool) {
	start := 0
	for _, q := range calls {
		q.c.writing = false
		notSent := err != nil && (dead || (!s.tls && n <= start))
		if notSent && s.removeLocked(q.c) {
			q.c.done <- result{kind: resMoved, reason: "not sent: " + err.Error()}
		}
		start = q.end
	}
	if err != nil && !dead {
		var timeout net.Error
		if !(n == 0 && !s.tls && errors.As(err, &timeout) && timeout.Timeout()) {
			// A write that timed out with nothing taken leaves the session
			// as it was; any other failure ends it.
			s.failLocked("cannot write: " + err.Error())
		}
	}
	if !s.alive.Load() {
		res := s.closedResultLocked()
		for _, q := range calls {
			if s.removeLocked(q.c) && !q.c.abandoned {
				q.c.done <- res
			}
		}
	}
}

// closedResultLocked is the result of a possibly-sent call whose session
// ended unanswered.
func (s *session) closedResultLocked() result {
	if s.denied != "" {
		return result{kind: resDenied, reason: s.denied}
	}
	if s.refused != "" {
		return result{kind: resMoved, reason: s.refused, code: s.refusedCode}
	}
	return result{kind: resIndeterminate, reason: s.failure}
}

// fail ends the session: every pending call that is not being written
// gets the closed result (a writer settles its own call).
func (s *session) fail(reason string) {
	s.mu.Lock()
	s.failLocked(reason)
	s.mu.Unlock()
}

func (s *session) failLocked(reason string) {
	if !s.alive.Load() {
		return
	}
	s.alive.Store(false)
	s.failure = reason
	_ = s.conn.Close()
	res := s.closedResultLocked()
	var cleanUps []*call
	settle := func(c *call) bool {
		if c.writing {
			return false
		}
		if c.abandoned {
			if c.withdrawn && res.kind == resIndeterminate {
				cleanUps = append(cleanUps, c)
			}
			return true
		}
		c.done <- res
		return true
	}
	for owner, c := range s.acquires {
		if settle(c) {
			delete(s.acquires, owner)
		}
	}
	kept := s.others[:0]
	for _, c := range s.others {
		if !settle(c) {
			kept = append(kept, c)
		}
	}
	s.others = kept
	go s.client.sessionEnded(s, reason, s.denied, s.shuttingDown, cleanUps)
}

// readLoop reads answers until the session ends.
func (s *session) readLoop() {
	buf := make([]byte, 0, 64*1024)
	chunk := make([]byte, 64*1024)
	for {
		n, err := s.conn.Read(chunk)
		if n > 0 {
			if hook := s.client.readHook; hook != nil {
				hook()
			}
			buf = append(buf, chunk[:n]...)
			now := time.Now()
			s.mu.Lock()
			used := 0
			for s.alive.Load() {
				f, size, derr := decodeFrame(buf[used:])
				if derr != nil {
					s.failLocked(derr.Error())
					break
				}
				if size == 0 {
					break
				}
				used += size
				if why := s.handleLocked(f, now); why != "" {
					s.failLocked(why)
				}
			}
			alive := s.alive.Load()
			s.mu.Unlock()
			if !alive {
				return
			}
			buf = buf[:copy(buf, buf[used:])]
		}
		if err != nil {
			s.mu.Lock()
			if s.draining.Load() {
				s.failLocked(s.drainReason)
				s.mu.Unlock()
				return
			}
			if s.tls {
				if refusal := tlsRefusal(err); refusal != "" && s.denied == "" {
					s.denied = refusal
				}
			}
			s.failLocked("the connection ended: " + err.Error())
			s.mu.Unlock()
			return
		}
	}
}

func refusalReason(code byte) string {
	if code == errConnectionLimit {
		return "the server refused the connection: connection limit reached (X 7)"
	}
	return "the server refused the connection: peer not allowed (X 9)"
}

// handleLocked takes one answer; a reason when it must end the session.
func (s *session) handleLocked(f frame, now time.Time) string {
	first := s.frames == 0
	s.frames++
	if f.op == 'X' && first && (f.code == errConnectionLimit || f.code == errNotAllowed) {
		s.refused, s.refusedCode = refusalReason(f.code), f.code
		return s.refused
	}
	if f.op == 'X' && first && f.code == errNotAuthenticated {
		if s.authenticating {
			s.denied = "the server refused the secret (X 12: " + f.text + ")"
		} else {
			s.denied = "the server requires a secret and this client has none (X 12: " + f.text + ")"
		}
		return s.denied
	}
	if f.op == 'X' && first && f.code == errUnknownOp && s.authenticating {
		s.denied = "the server does not know U, so it cannot check the secret (X 1: " + f.text + ")"
		return s.denied
	}
	if f.op == 'X' && !nonFatal(f.code) {
		if f.code == errShuttingDown {
			s.shuttingDown = true
		}
		return fmt.Sprintf("server error %d: %s", f.code, f.text)
	}
	if s.authenticating {
		if f.op != 'U' {
			return fmt.Sprintf("answer %q came before the answer to U", f.op)
		}
		s.authenticating = false
		return ""
	}
	var c *call
	switch f.op {
	case 'A', 'T', 'B':
		c = s.acquires[f.a]
		delete(s.acquires, f.a)
	case 'R', 'E':
		c = s.takeOther(func(o *call) bool { return o.op == f.op && o.token == f.a })
	case 'C':
		c = s.takeOther(func(o *call) bool { return o.op == 'C' && o.token == f.a })
	case 'N':
		c = s.takeOther(func(o *call) bool {
			return (o.op == 'R' || o.op == 'E' || o.op == 'C') && o.token == f.a
		})
	case 'Q', 'I':
		c = s.takeOther(func(o *call) bool { return o.op == f.op })
	case 'P':
		c = s.takeOther(func(o *call) bool { return o.op == 'P' && o.nonce == f.a })
	case 'V':
		c = s.takeOther(func(o *call) bool { return o.op == 'O' && o.owner == f.a })
	case 'X':
		if a := s.acquires[f.a]; a != nil {
			c = a
			delete(s.acquires, f.a)
		} else {
			c = s.takeOther(func(o *call) bool { return o.answersError(f.a) })
		}
	case 'G', 'W', 'K':
		return s.gatherLocked(f)
	case 'Z':
		c = s.findListing(f.a)
		if c == nil {
			return fmt.Sprintf("end of a list %d matches no request", f.a)
		}
		got := len(c.grants) + len(c.waiters) + len(c.keys)
		if int(f.n1) != got {
			return fmt.Sprintf("end of a list counts %d frames, %d came", f.n1, got)
		}
		s.removeLocked(c)
	}
	if c == nil {
		return fmt.Sprintf("answer %q matches no request", f.op)
	}
	s.client.markAnswered(s.index)
	s.deliverLocked(c, f, now)
	return ""
}

func (s *session) gatherLocked(f frame) string {
	c := s.findListing(f.a)
	if c == nil {
		return fmt.Sprintf("answer %q matches no request", f.op)
	}
	switch {
	case f.op == 'K' && c.op == 'L':
		if len(c.keys) >= int(c.count) {
			return fmt.Sprintf("more keys than the %d asked for", c.count)
		}
		c.keys = append(c.keys, KeyInfo{Key: f.text, Grants: f.n1, Waiters: f.n2, Limit: f.small})
	case f.op == 'G' && c.op == 'H':
		if len(c.waiters) > 0 || len(c.grants) >= holdersMax {
			return fmt.Sprintf("a grant after a waiter, or more than %d", holdersMax)
		}
		c.grants = append(c.grants, Grant{Token: f.b, Owner: f.c, Take: f.small,
			LeaseLeft: ms(f.n1), HeldFor: ms(f.n2), Label: f.text})
	case f.op == 'W' && c.op == 'H':
		if len(c.waiters) >= holdersMax {
			return fmt.Sprintf("more than %d waiters", holdersMax)
		}
		c.waiters = append(c.waiters, Waiter{Owner: f.b, Take: f.small, WaitLeft: ms(f.n1), Label: f.text})
	default:
		return fmt.Sprintf("answer %q does not answer %q", f.op, c.op)
	}
	return ""
}

// deliverLocked hands the answer f to c (already taken out). A grant
// nobody may take (an abandoned acquire, or one noticed at or after D:
// rule 7) is released at once.
func (s *session) deliverLocked(c *call, f frame, now time.Time) {
	if f.op == 'A' {
		if c.abandoned {
			s.client.releaseBackground(c.key, f.b)
			return
		}
		if !now.Before(c.deadline) {
			s.client.releaseBackground(c.key, f.b)
			c.done <- result{kind: resIndeterminate, reason: "the grant came after the call's deadline and was released"}
			return
		}
	}
	if f.op == 'Z' && c.cleanUpFor != 0 {
		for _, g := range c.grants {
			if g.Owner == c.cleanUpFor && g.Token != 0 {
				s.client.releaseBackground(c.key, g.Token)
			}
		}
	}
	if c.abandoned {
		return
	}
	c.done <- result{kind: f.op, f: f, at: now}
}

// tlsRefusal says why, when err is the TLS alert by which the server
// refused this client's certificate or its absence; else "".
func tlsRefusal(err error) string {
	text := err.Error()
	if !strings.Contains(text, "remote error: tls:") {
		return ""
	}
	for _, alert := range []string{"certificate required", "bad certificate", "unknown certificate authority",
		"unknown certificate", "unsupported certificate", "expired certificate", "revoked certificate", "access denied"} {
		if strings.Contains(text, alert) {
			return "the server refused this client's certificate, or its absence (" + text + ")"
		}
	}
	return ""
}

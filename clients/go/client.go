// Package kunci is the Go client of the kunci lock server: locks with
// fencing tokens and leases, semaphores and shared locks, managed
// keep-alive, leader election, secrets and TLS. It keeps the official
// client contract (spec §8): one deadline per call, a request that may
// have been sent is never sent again, ErrIndeterminate when its answer is
// not seen in time, late grants released, keep-alive. Standard library
// only.
package kunci

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

const (
	defaultConnectTimeout = time.Second
	// closeFlush bounds the releases Close sends (as rule 9's flush at
	// exit).
	closeFlush = 500 * time.Millisecond
	// renewRetry: how soon a keep-alive retries a renewal that ended
	// Unavailable or Indeterminate while valid_until is ahead.
	renewRetry = 50 * time.Millisecond
	// retryPauseFirst and retryPauseMax: the pauses of Campaign and
	// Observe after an outage, doubling; each is taken ±25 % (jittered).
	retryPauseFirst = 100 * time.Millisecond
	retryPauseMax   = 2 * time.Second
	// shutdownNoticeWait: how long after a B the X 8 of a server shutting
	// down may still come.
	shutdownNoticeWait = 200 * time.Millisecond
)

// Client is a handle to one lock service, reachable at one or more
// addresses. It is safe for concurrent use: calls from many goroutines
// share (and pipeline over) one connection. Nothing is connected until a
// call needs it.
type Client struct {
	addrs          []address
	tlsConfs       []*tls.Config
	authFrame      []byte
	connectTimeout time.Duration
	idBase         uint64
	idNext         atomic.Uint64

	mu          sync.Mutex
	sessions    []*session
	failures    []int
	retryAt     []time.Time
	lastFailure []string
	preferred   int
	denials     int
	denial      string
	closing     bool
	closed      bool
	tickets     map[*Ticket]struct{}
	connecting  []chan struct{}

	shutdowns atomic.Int64
	// ended counts sessions that ended: a keep-alive that sees it change
	// between two renewals may have renewed on a restarted server.
	ended    atomic.Int64
	closedCh chan struct{}

	bgMu     sync.Mutex
	bgQueue  []keyToken
	bgSignal chan struct{}
	bgDone   chan struct{}
	bgWG     sync.WaitGroup

	// Test hooks, set before the first call: run by a session's reader
	// after each read, and by an acquire before its hand-over gate (a
	// pause there stands for a GC pause or a stopped process).
	readHook, handOverHook func()
	// Test knob: no clean-up after an indeterminate acquire (rule 11), so
	// that a test sees what else released a grant.
	noCleanUp bool
}

type keyToken struct {
	key   []byte
	token uint64
}

// Dial makes a client of the service at addr: "HOST:PORT",
// "tls://HOST:PORT" or "unix:PATH", or several of them comma-separated
// (addresses of the same service); "" means $KUNCI_SERVER, else
// 127.0.0.1:5862. It connects lazily: a server that cannot be reached is
// an error of the first call (ErrUnavailable). Invalid options are
// ErrInvalidArgument at once.
func Dial(addr string, opts ...Option) (*Client, error) {
	s := applyOptions(opts)
	if len(s.callOnly) > 0 {
		return nil, invalid("%s is an option of a call, not of Dial", strings.Join(s.callOnly, ", "))
	}
	addrs, err := resolveAddresses(addr)
	if err != nil {
		return nil, err
	}
	secret, err := s.secretOf()
	if err != nil {
		return nil, err
	}
	c := &Client{
		addrs:          addrs,
		connectTimeout: defaultConnectTimeout,
		sessions:       make([]*session, len(addrs)),
		failures:       make([]int, len(addrs)),
		retryAt:        make([]time.Time, len(addrs)),
		lastFailure:    make([]string, len(addrs)),
		tlsConfs:       make([]*tls.Config, len(addrs)),
		connecting:     make([]chan struct{}, len(addrs)),
		tickets:        make(map[*Ticket]struct{}),
		closedCh:       make(chan struct{}),
		bgSignal:       make(chan struct{}, 1),
		bgDone:         make(chan struct{}),
	}
	if s.connectTimeout != 0 {
		if s.connectTimeout < 0 {
			return nil, invalid("ConnectTimeout must be > 0")
		}
		c.connectTimeout = s.connectTimeout
	}
	if secret != nil {
		c.authFrame = append(append([]byte{'U'}, secret...), '\n')
	}
	var system *tls.Config
	for i, a := range addrs {
		c.connecting[i] = make(chan struct{}, 1)
		switch {
		case a.kind == "unix":
		case s.tlsSet && s.tls != nil:
			c.tlsConfs[i] = s.tls
		case a.kind == "tls":
			if system == nil {
				if system, err = defaultTLS(); err != nil {
					return nil, err
				}
			}
			c.tlsConfs[i] = system
		}
		if secret != nil && !s.allowPlaintextSecret && os.Getenv("KUNCI_ALLOW_PLAINTEXT_SECRET") != "1" &&
			a.kind != "unix" && c.tlsConfs[i] == nil && !isLoopbackHost(a.host) {
			return nil, invalid("a secret goes only over TLS, to a loopback address or over a unix socket, "+
				"and %s is none of them: use tls://, or allow the secret in clear with "+
				"AllowPlaintextSecret() or KUNCI_ALLOW_PLAINTEXT_SECRET=1", a)
		}
	}
	var seed [8]byte
	if _, err := rand.Read(seed[:]); err != nil {
		return nil, fmt.Errorf("kunci: no randomness for owner ids: %w", err)
	}
	c.idBase = binary.BigEndian.Uint64(seed[:])
	c.bgWG.Add(1)
	go c.backgroundReleases()
	return c, nil
}

// nextID is an owner id (or nonce, or request id) unique within the
// client, never 0.
func (c *Client) nextID() uint64 {
	for {
		if id := c.idBase + c.idNext.Add(1); id != 0 {
			return id
		}
	}
}

// Close ends the client: the tickets it handed out that were neither
// released, detached nor lost are released in one bounded flush (at most
// 0.5 s in all, as spec §8 rule 9's flush at exit), keep-alives stop,
// and every connection closes; calls still in progress end
// ErrIndeterminate (or ErrUnavailable when nothing was sent).
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closing {
		c.mu.Unlock()
		return nil
	}
	c.closing = true
	var tickets []*Ticket
	for t := range c.tickets {
		tickets = append(tickets, t)
	}
	c.mu.Unlock()

	ctx, cancel := context.WithTimeout(context.Background(), closeFlush)
	var wg sync.WaitGroup
	for _, t := range tickets {
		if !t.takeForClose() {
			continue
		}
		wg.Add(1)
		go func(t *Ticket) {
			defer wg.Done()
			call := newCall('R', t.keyBytes, time.Now().Add(closeFlush))
			call.token = t.token
			_, _ = c.run(ctx, call)
		}(t)
	}
	wg.Wait()
	cancel()

	c.mu.Lock()
	c.closed = true
	sessions := append([]*session(nil), c.sessions...)
	c.mu.Unlock()
	close(c.closedCh)
	for _, s := range sessions {
		if s != nil {
			s.fail("the client was closed")
		}
	}
	c.bgWG.Wait()
	return nil
}

// ------------------------------------------------------------- the calls

// run runs call to its result: it moves the call while it is certainly
// not sent (rule 4) and never sends it again once possibly sent (rule 5).
func (c *Client) run(ctx context.Context, call *call) (result, error) {
	for {
		s, err := c.sessionFor(ctx, call)
		if err != nil {
			return result{}, err
		}
		if !s.write(call) {
			continue
		}
		r := c.await(ctx, s, call)
		if r.kind == resMoved {
			if call.tried == nil {
				call.tried, call.refusals = map[int]bool{}, map[int]bool{}
			}
			call.reason = r.reason
			call.tried[s.index] = true
			if r.code == errNotAllowed {
				call.refusals[s.index] = true
			}
			continue
		}
		return r, nil
	}
}

// await waits for the answer to call, written on s, until D (rule 5) or
// until ctx is cancelled.
func (c *Client) await(ctx context.Context, s *session, call *call) result {
	timer := time.NewTimer(time.Until(call.deadline))
	defer timer.Stop()
	select {
	case r := <-call.done:
		return r
	case <-timer.C:
		return c.atDeadline(s, call)
	case <-ctx.Done():
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			// The context's deadline is D when it comes first.
			return c.atDeadline(s, call)
		}
		return c.abandon(ctx, s, call)
	}
}

// atDeadline: D has passed. Unless its answer came meanwhile, exactly the
// call's session is closed and the call is indeterminate (rule 5).
func (c *Client) atDeadline(s *session, call *call) result {
	s.mu.Lock()
	if s.hasLocked(call) {
		// Nobody takes its answer now; a grant that comes while the
		// session takes in what arrived is released (rule 7).
		call.abandoned = true
		s.closeAfterDrainLocked("no answer by the deadline")
		s.mu.Unlock()
		return result{kind: resIndeterminate, reason: "no answer by the deadline"}
	}
	s.mu.Unlock()
	return <-call.done
}

// abandon: the caller cancelled the call after its request was possibly
// sent. Nobody takes its outcome: a late grant is released when it comes.
// An acquire that may be queued is withdrawn at once by closing its
// session when no other call waits on it (the server drops a closed
// connection's waiters); a grant made before that is looked for and
// released (rule 11).
func (c *Client) abandon(ctx context.Context, s *session, call *call) result {
	s.mu.Lock()
	if !s.hasLocked(call) {
		s.mu.Unlock()
		r := <-call.done
		if r.kind == 'A' {
			// Granted just now: the caller has gone, so it is released.
			c.releaseBackground(call.key, r.f.b)
			return result{kind: resIndeterminate, reason: "cancelled after the request was sent", cause: ctx.Err()}
		}
		return r
	}
	call.abandoned = true
	call.withdrawn = call.isAcquire()
	if call.isAcquire() && call.waitSet && s.pendingLocked() == 1 {
		s.failLocked("a cancelled acquire withdrew its wait")
	}
	s.mu.Unlock()
	return result{kind: resIndeterminate, reason: "cancelled after the request was sent", cause: ctx.Err()}
}

// sessionFor gives a connected session for call, or the definitive error
// once its deadline has passed, every address refused it, or the
// client's credentials were refused since it began.
func (c *Client) sessionFor(ctx context.Context, call *call) (*session, error) {
	for {
		now := time.Now()
		c.mu.Lock()
		if c.closed {
			c.mu.Unlock()
			return nil, &Error{Kind: ErrUnavailable, Detail: "nothing was sent", Cause: ErrClosed}
		}
		if call.denials < 0 {
			call.denials = c.denials
		} else if call.denials != c.denials {
			reason := c.denial
			c.mu.Unlock()
			return nil, newError(ErrPermissionDenied, "%s; nothing was executed", reason)
		}
		if !now.Before(call.deadline) {
			c.mu.Unlock()
			return nil, c.unavailable(call)
		}
		if err := ctx.Err(); err != nil && !errors.Is(err, context.DeadlineExceeded) {
			c.mu.Unlock()
			return nil, &Error{Kind: ErrUnavailable, Detail: "cancelled before anything was sent", Cause: err}
		}
		count := len(c.addrs)
		for i := 0; i < count; i++ {
			if s := c.sessions[(c.preferred+i)%count]; s != nil && s.usable() {
				c.mu.Unlock()
				return s, nil
			}
		}
		var allowed, ready []int
		next := call.deadline
		for i := 0; i < count; i++ {
			index := (c.preferred + i) % count
			if call.refusals[index] {
				continue
			}
			allowed = append(allowed, index)
			if call.reason == "" && c.lastFailure[index] != "" {
				call.reason = c.lastFailure[index]
			}
			if !c.retryAt[index].After(now) {
				ready = append(ready, index)
			} else if c.retryAt[index].Before(next) {
				next = c.retryAt[index]
			}
		}
		c.mu.Unlock()
		if len(allowed) == 0 {
			// X 9 does not change within a call (rule 4).
			return nil, c.unavailable(call)
		}
		// Addresses this call failed on go last.
		var fresh, again []int
		for _, i := range ready {
			if call.tried[i] {
				again = append(again, i)
			} else {
				fresh = append(fresh, i)
			}
		}
		for _, index := range append(fresh, again...) {
			if s := c.open(ctx, index, call); s != nil {
				return s, nil
			}
		}
		if len(ready) == 0 {
			pause := time.NewTimer(time.Until(next))
			select {
			case <-pause.C:
			case <-ctx.Done():
			case <-c.closedCh:
			}
			pause.Stop()
		}
	}
}

func (c *Client) unavailable(call *call) error {
	reason := call.reason
	if reason == "" {
		reason = "no server could be reached by the deadline"
	}
	return newError(ErrUnavailable, "%s; nothing was sent", reason)
}

// retryDelay: after its first failure an address is tried again at once;
// after n in a row, after 10 ms × 2^(n−2), at most 500 ms.
func retryDelay(failures int) time.Duration {
	if failures <= 1 {
		return 0
	}
	shift := failures - 2
	if shift > 16 {
		shift = 16
	}
	d := 10 * time.Millisecond << shift
	if d > 500*time.Millisecond {
		d = 500 * time.Millisecond
	}
	return d
}

func (c *Client) noteFailureLocked(index int, reason string) {
	c.failures[index]++
	c.retryAt[index] = time.Now().Add(retryDelay(c.failures[index]))
	c.lastFailure[index] = reason
}

func (c *Client) markAnswered(index int) {
	c.mu.Lock()
	c.failures[index] = 0
	c.mu.Unlock()
}

// open connects to address index for call (one connection attempt per
// address at a time); nil when it failed.
func (c *Client) open(ctx context.Context, index int, call *call) *session {
	slot := c.connecting[index]
	wait := time.NewTimer(time.Until(call.deadline))
	defer wait.Stop()
	select {
	case slot <- struct{}{}:
	case <-wait.C:
		return nil
	case <-ctx.Done():
		return nil
	}
	defer func() { <-slot }()
	c.mu.Lock()
	if s := c.sessions[index]; s != nil && s.usable() {
		c.mu.Unlock()
		return s
	}
	if c.retryAt[index].After(time.Now()) || c.closed {
		c.mu.Unlock()
		return nil
	}
	c.mu.Unlock()
	timeout := c.connectTimeout
	if left := time.Until(call.deadline); left < timeout {
		timeout = left
	}
	if timeout <= 0 {
		return nil
	}
	a := c.addrs[index]
	dctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	conn, isTLS, err := c.connect(dctx, index)
	if err != nil {
		reason := fmt.Sprintf("cannot connect to %s: %v", a, err)
		c.mu.Lock()
		var unknownAuthority x509.UnknownAuthorityError
		var hostname x509.HostnameError
		var invalidCert x509.CertificateInvalidError
		if refusal := tlsRefusal(err); refusal != "" {
			reason = fmt.Sprintf("%s: %s", a, refusal)
			c.denials++
			c.denial = reason
		} else if errors.As(err, &unknownAuthority) || errors.As(err, &hostname) || errors.As(err, &invalidCert) {
			// The certificate and the trust do not change within a call.
			reason = fmt.Sprintf("cannot connect to %s: the server's certificate is not trusted: %v", a, err)
			if call.refusals == nil {
				call.tried, call.refusals = map[int]bool{}, map[int]bool{}
			}
			call.refusals[index] = true
		}
		c.noteFailureLocked(index, reason)
		c.mu.Unlock()
		call.reason = reason
		if call.tried == nil {
			call.tried, call.refusals = map[int]bool{}, map[int]bool{}
		}
		call.tried[index] = true
		return nil
	}
	s := newSession(c, index, conn, isTLS, c.authFrame != nil)
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		_ = conn.Close()
		return nil
	}
	c.sessions[index] = s
	c.preferred = index
	c.mu.Unlock()
	go s.readLoop()
	return s
}

// connect opens a connection to address index, its TLS handshake done and
// the session's U written.
func (c *Client) connect(ctx context.Context, index int) (net.Conn, bool, error) {
	a := c.addrs[index]
	var d net.Dialer
	network := "tcp"
	if a.kind == "unix" {
		network = "unix"
	}
	conn, err := d.DialContext(ctx, network, a.dialTarget())
	if err != nil {
		return nil, false, err
	}
	isTLS := false
	if conf := c.tlsConfs[index]; conf != nil {
		conf = conf.Clone()
		if conf.ServerName == "" {
			conf.ServerName = a.host
		}
		tconn := tls.Client(conn, conf)
		if err := tconn.HandshakeContext(ctx); err != nil {
			_ = conn.Close()
			return nil, false, err
		}
		conn, isTLS = tconn, true
	}
	if c.authFrame != nil {
		deadline, _ := ctx.Deadline()
		_ = conn.SetWriteDeadline(deadline)
		if _, err := conn.Write(c.authFrame); err != nil {
			_ = conn.Close()
			return nil, false, err
		}
	}
	return conn, isTLS, nil
}

// sessionEnded is told by a session that it ended.
func (c *Client) sessionEnded(s *session, reason, denied string, shuttingDown bool, cleanUps []*call) {
	c.mu.Lock()
	if c.sessions[s.index] == s {
		c.sessions[s.index] = nil
	}
	if denied != "" {
		c.denials++
		c.denial = denied
	}
	c.noteFailureLocked(s.index, reason)
	closed := c.closed
	c.mu.Unlock()
	c.ended.Add(1)
	if shuttingDown {
		c.shutdowns.Add(1)
	}
	if !closed {
		for _, call := range cleanUps {
			c.cleanUpAfter(call)
		}
	}
}

// ----------------------------------------------------- background work

// releaseBackground schedules a release of exactly token that nobody
// waits for (a late grant's, an abandoned acquire's). Never blocks.
func (c *Client) releaseBackground(key []byte, token uint64) {
	c.bgMu.Lock()
	c.bgQueue = append(c.bgQueue, keyToken{key, token})
	c.bgMu.Unlock()
	select {
	case c.bgSignal <- struct{}{}:
	default:
	}
}

func (c *Client) backgroundReleases() {
	defer c.bgWG.Done()
	var sends sync.WaitGroup
	defer sends.Wait()
	for {
		select {
		case <-c.bgSignal:
		case <-c.closedCh:
			return
		}
		c.bgMu.Lock()
		queue := c.bgQueue
		c.bgQueue = nil
		c.bgMu.Unlock()
		for _, kt := range queue {
			sends.Add(1)
			go func(kt keyToken) {
				defer sends.Done()
				call := newCall('R', kt.key, time.Now().Add(transportDeadline))
				call.token = kt.token
				_, _ = c.run(context.Background(), call)
			}(kt)
		}
	}
}

// cleanUpAfter: an acquire ended Indeterminate with its request possibly
// sent. In the background, asks who holds the key and releases the grant
// of the call's owner if the server made one (rule 11). The H's id is
// that owner, which no other request uses.
func (c *Client) cleanUpAfter(acquire *call) {
	if c.noCleanUp {
		return
	}
	call := newCall('H', acquire.key, time.Now().Add(transportDeadline))
	call.owner = acquire.owner
	call.cleanUpFor = acquire.owner
	go func() { _, _ = c.run(context.Background(), call) }()
}

// shutdownSeen: whether a server said it shuts down (X 8) since the count
// was notices, waiting up to shutdownNoticeWait for it.
func (c *Client) shutdownSeen(notices int64) bool {
	giveUp := time.Now().Add(shutdownNoticeWait)
	for c.shutdowns.Load() == notices {
		if time.Now().After(giveUp) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}

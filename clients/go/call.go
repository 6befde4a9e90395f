package kunci

import (
	"encoding/binary"
	"time"
)

// Result kinds of an attempt that are not an answer's op.
const (
	resMoved         = 'm' // executed by nobody: may move to another session (rule 4)
	resDenied        = 'd' // the credentials were refused: nothing executed
	resIndeterminate = '?' // possibly sent, no answer (rule 5)
)

// result is how one attempt of a call ended.
type result struct {
	kind   byte // the answer's op, or one of the res kinds
	f      frame
	reason string
	code   byte // resMoved: the X code that refused the session, if any
	at     time.Time
	cause  error // a cancelled call: the context's error
}

// call is one request of one API call, through all its attempts: the same
// owner and the same deadlines (spec §8 rule 2).
type call struct {
	op        byte
	key       []byte // the key, or L's prefix
	owner     uint64 // A/S: the owner; H, L, O: the id
	token     uint64 // R, E, C: the token; O: since
	nonce     uint64
	lease     uint8
	waitSet   bool // A with a wait > 0: the wire wait counts down to waitUntil
	waitUntil time.Time
	waitS     uint8 // O's wait
	limit     uint16
	take      uint16
	label     []byte
	cursor    uint64
	count     uint16
	deadline  time.Time // D
	// cleanUpFor: an H sent after an acquire by this owner ended
	// Indeterminate (rule 11): its grants are released.
	cleanUpFor uint64

	// Under the session's lock.
	sentAt    time.Time
	writing   bool
	abandoned bool
	withdrawn bool // a cancelled acquire: its grant is looked for if its session ends
	grants    []Grant
	waiters   []Waiter
	keys      []KeyInfo

	done chan result

	// Rule 4's bookkeeping across attempts (the calling goroutine's).
	refusals map[int]bool
	tried    map[int]bool
	reason   string
	denials  int
}

func newCall(op byte, key []byte, deadline time.Time) *call {
	return &call{op: op, key: key, deadline: deadline, done: make(chan result, 1), denials: -1}
}

func (c *call) isAcquire() bool { return c.op == 'A' }

// encode appends the frame to b, the wire wait computed at now (rule 3).
func (c *call) encode(b []byte, now time.Time) []byte {
	be := binary.BigEndian
	switch c.op {
	case 'A':
		return encodeAcquire(b, wireWait(c.waitSet, c.waitUntil, now), c.lease, c.owner, c.limit, c.take, c.key, c.label)
	case 'R':
		b = append(b, 'R')
		b = be.AppendUint64(b, c.token)
	case 'E':
		b = append(b, 'E', c.lease)
		b = be.AppendUint64(b, c.token)
	case 'Q':
		b = append(b, 'Q')
	case 'P':
		b = append(b, 'P')
		b = be.AppendUint64(b, c.nonce)
	case 'I':
		b = append(b, 'I')
	case 'H':
		b = append(b, 'H')
		b = be.AppendUint64(b, c.owner)
	case 'L':
		b = append(b, 'L')
		b = be.AppendUint64(b, c.owner)
		b = be.AppendUint64(b, c.cursor)
		b = be.AppendUint16(b, c.count)
	case 'O':
		b = append(b, 'O', c.waitS)
		b = be.AppendUint64(b, c.owner)
		b = be.AppendUint64(b, c.token)
	case 'C':
		b = append(b, 'C')
		b = be.AppendUint64(b, c.token)
		b = append(b, uint8(len(c.key)))
		b = append(b, c.key...)
		b = append(b, c.label...)
		return append(b, '\n')
	}
	b = append(b, c.key...)
	return append(b, '\n')
}

// answersError: whether an X with this id is this request's (spec §6).
func (c *call) answersError(id uint64) bool {
	switch c.op {
	case 'R', 'E':
		return c.token == id
	case 'C':
		return c.token == id || id == 0
	case 'P':
		return c.nonce == id
	case 'H', 'L', 'O':
		return c.owner == id
	}
	return id == 0
}

package kunci

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"
	"unicode/utf8"
)

// The numbers of the contract (spec §2, §8).
const (
	// transportDeadline is how long past its wait (or its start, for calls
	// that do not wait) a call may take: spec §8 rule 2's D.
	transportDeadline = 5 * time.Second
	// MaxWait is the longest wait one request may carry.
	MaxWait = 255 * time.Second
	// MaxLease is the longest lease; the shortest is one second.
	MaxLease = 255 * time.Second
	// DefaultLease is the lease of Acquire, Lock and Campaign without Lease.
	DefaultLease = 30 * time.Second
	// DefaultServer is the address used when neither Dial nor KUNCI_SERVER
	// names one.
	DefaultServer = "127.0.0.1:5862"
	// SharedLimit is the limit of a shared lock (spec §10 rule 6).
	SharedLimit = 65535

	keyLenMax     = 255
	labelLenMax   = 128
	secretLenMin  = 32
	secretLenMax  = 255
	listCountMax  = 1000
	holdersMax    = 1000
	textMax       = 4096
	waitMaxSecond = 255
)

// Error codes (spec §6).
const (
	errUnknownOp        = 1
	errConnectionLimit  = 7
	errShuttingDown     = 8
	errNotAllowed       = 9
	errLimitMismatch    = 10
	errNotAuthenticated = 12
	errNotPermitted     = 13
	errTooManyWatches   = 14
)

func nonFatal(code byte) bool {
	switch code {
	case 3, 4, 5, 6, 10, 11, 13, 14:
		return true
	}
	return false
}

// driftMargin is taken off a lease for the server's clock running faster
// than ours: 10 ms plus 0.2 % of the lease, as the Rust and Python
// clients.
func driftMargin(lease time.Duration) time.Duration {
	return 10*time.Millisecond + lease/500
}

// validUntil is the conservative expiry of a lease whose request was
// handed to the socket just after sentAt (spec §8 rule 9).
func validUntil(sentAt time.Time, lease time.Duration) time.Time {
	return sentAt.Add(lease - driftMargin(lease))
}

// wireWait is the wait written at now (spec §8 rule 3): an original zero
// wait (waitSet false) stays 0; otherwise the seconds left to Dw rounded
// up, or 0 once Dw has passed.
func wireWait(waitSet bool, waitUntil, now time.Time) uint8 {
	if !waitSet {
		return 0
	}
	left := waitUntil.Sub(now)
	if left <= 0 {
		return 0
	}
	seconds := (left + time.Second - 1) / time.Second
	if seconds > waitMaxSecond {
		return waitMaxSecond
	}
	return uint8(seconds)
}

func checkKey(key string) ([]byte, error) {
	return checkText(key, "key", 1, keyLenMax)
}

func checkText(value, what string, min, max int) ([]byte, error) {
	if !utf8.ValidString(value) {
		return nil, invalid("%s is not valid UTF-8", what)
	}
	if len(value) < min {
		return nil, invalid("%s is empty", what)
	}
	if len(value) > max {
		return nil, invalid("%s is longer than %d bytes (%d)", what, max, len(value))
	}
	if bytes.IndexByte([]byte(value), '\n') >= 0 {
		return nil, invalid("%s contains a newline", what)
	}
	return []byte(value), nil
}

func checkLease(lease time.Duration) (uint8, error) {
	if lease%time.Second != 0 || lease < time.Second || lease > MaxLease {
		return 0, invalid("lease must be a whole number of seconds in 1..=255, got %v", lease)
	}
	return uint8(lease / time.Second), nil
}

func checkWait(wait time.Duration) error {
	if wait < 0 || wait > MaxWait {
		return invalid("wait must be 0..=255 s, got %v", wait)
	}
	return nil
}

func checkSecret(secret string) ([]byte, error) {
	data := []byte(secret)
	if len(data) > 0 && data[len(data)-1] == '\n' {
		data = data[:len(data)-1]
	}
	if len(data) < secretLenMin {
		return nil, invalid("secret is shorter than %d bytes (%d): a server refuses it", secretLenMin, len(data))
	}
	if len(data) > secretLenMax {
		return nil, invalid("secret is longer than %d bytes (%d)", secretLenMax, len(data))
	}
	if bytes.IndexByte(data, '\n') >= 0 {
		return nil, invalid("secret contains a newline")
	}
	return data, nil
}

// ---------------------------------------------------------------- requests

func appendU64(b []byte, v uint64) []byte {
	return binary.BigEndian.AppendUint64(b, v)
}

func encodeAcquire(b []byte, wait, lease uint8, owner uint64, limit, take uint16, key, label []byte) []byte {
	if limit == 0 && take == 0 && len(label) == 0 {
		b = append(b, 'A', wait, lease)
		b = appendU64(b, owner)
	} else {
		b = append(b, 'S', wait, lease)
		b = appendU64(b, owner)
		b = binary.BigEndian.AppendUint16(b, limit)
		b = binary.BigEndian.AppendUint16(b, take)
		b = append(b, uint8(len(key)))
	}
	b = append(b, key...)
	b = append(b, label...)
	return append(b, '\n')
}

// ---------------------------------------------------------------- answers

// frame is one decoded answer (spec §2.2); which fields mean something
// depends on op.
type frame struct {
	op      byte
	a, b, c uint64 // owner/token/nonce/id; second and third u64
	n1, n2  uint32 // lease_ms, held_ms / waiters / grants / count...
	n3      uint32
	code    byte
	small   uint16 // take, limit, grants
	text    string
}

var headerLen = [256]int8{
	'A': 16, 'T': 8, 'B': 8, 'R': 8, 'E': 8, 'N': 8, 'Q': 24, 'P': 8, 'C': 8,
	'I': 0, 'X': 9, 'G': 34, 'W': 22, 'K': 18, 'Z': 20, 'U': 0, 'V': 30,
}

func isTextOp(op byte) bool {
	switch op {
	case 'I', 'X', 'G', 'W', 'K', 'U', 'V':
		return true
	}
	return false
}

func knownOp(op byte) bool {
	switch op {
	case 'A', 'T', 'B', 'R', 'E', 'N', 'Q', 'P', 'C', 'I', 'X', 'G', 'W', 'K', 'Z', 'U', 'V':
		return true
	}
	return false
}

var errProtocol = errors.New("protocol error")

// decodeFrame decodes the frame at the start of buf: the frame and its
// length, or 0 when buf does not hold a whole frame yet, or an error for
// bytes that cannot be a frame (the session must end).
func decodeFrame(buf []byte) (frame, int, error) {
	var f frame
	if len(buf) == 0 {
		return f, 0, nil
	}
	op := buf[0]
	if !knownOp(op) {
		return f, 0, fmt.Errorf("%w: unknown answer op byte 0x%02x", errProtocol, op)
	}
	f.op = op
	tail := 1 + int(headerLen[op])
	if len(buf) < tail+1 {
		return f, 0, nil
	}
	h := buf[1:tail]
	be := binary.BigEndian
	end := tail
	if isTextOp(op) {
		i := bytes.IndexByte(buf[tail:], '\n')
		if i < 0 {
			if len(buf)-tail > textMax {
				return f, 0, fmt.Errorf("%w: answer text longer than %d bytes", errProtocol, textMax)
			}
			return f, 0, nil
		}
		end = tail + i
		f.text = string(buf[tail:end])
	} else if buf[tail] != '\n' {
		return f, 0, fmt.Errorf("%w: answer %q is not followed by a newline", errProtocol, op)
	}
	switch op {
	case 'A':
		f.a, f.b = be.Uint64(h), be.Uint64(h[8:])
	case 'T', 'B', 'R', 'E', 'N', 'P', 'C':
		f.a = be.Uint64(h)
	case 'Q': // token owner lease_ms waiters
		f.a, f.b, f.n1, f.n2 = be.Uint64(h), be.Uint64(h[8:]), be.Uint32(h[16:]), be.Uint32(h[20:])
	case 'X':
		f.code, f.a = h[0], be.Uint64(h[1:])
	case 'G': // id token owner lease_ms held_ms take label
		f.a, f.b, f.c = be.Uint64(h), be.Uint64(h[8:]), be.Uint64(h[16:])
		f.n1, f.n2, f.small = be.Uint32(h[24:]), be.Uint32(h[28:]), be.Uint16(h[32:])
	case 'W': // id owner wait_ms take label
		f.a, f.b, f.n1, f.small = be.Uint64(h), be.Uint64(h[8:]), be.Uint32(h[16:]), be.Uint16(h[20:])
	case 'K': // id grants waiters limit key
		f.a, f.n1, f.n2, f.small = be.Uint64(h), be.Uint32(h[8:]), be.Uint32(h[12:]), be.Uint16(h[16:])
	case 'Z': // id count next
		f.a, f.n1, f.b = be.Uint64(h), be.Uint32(h[8:]), be.Uint64(h[12:])
	case 'V': // id token lease_ms held_ms grants waiters label
		f.a, f.b, f.n1, f.n2 = be.Uint64(h), be.Uint64(h[8:]), be.Uint32(h[16:]), be.Uint32(h[20:])
		f.small, f.n3 = be.Uint16(h[24:]), be.Uint32(h[26:])
	}
	return f, end + 1, nil
}

// keyLimitOfMismatch is the key's limit the text of an X 10 names, or 0.
func keyLimitOfMismatch(text string) int {
	const prefix = "limit mismatch: key limit "
	if len(text) <= len(prefix) || text[:len(prefix)] != prefix {
		return 0
	}
	n, err := strconv.Atoi(text[len(prefix):])
	if err != nil || n < 1 || n > math.MaxUint16 {
		return 0
	}
	return n
}

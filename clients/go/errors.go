package kunci

import (
	"errors"
	"fmt"
)

// The outcomes of a call that are not a result, for errors.Is. Every error
// a call returns wraps exactly one of them and says what the caller may
// conclude (see the README's table of outcomes).
var (
	// ErrTimeout: the server answered T: the key stayed held for the whole
	// wait (with wait 0: it was held at the one attempt). Definitive:
	// nothing was acquired and nothing is queued.
	ErrTimeout = errors.New("timeout: the key stayed held for the whole wait")
	// ErrBusy: the server answered B (no capacity, or shutting down), or
	// refused a watch (X 14). Definitive: nothing was acquired or queued.
	ErrBusy = errors.New("busy: the server has no capacity for the request, or is shutting down")
	// ErrUnavailable: no byte of the request reached a server that executed
	// it by the deadline. Definitive: nothing changed.
	ErrUnavailable = errors.New("unavailable")
	// ErrIndeterminate: the request may have reached the server, but its
	// answer was not seen in time. After an acquire: do not enter the
	// critical section (a grant nobody saw is released or ends with its
	// lease). After a release or renew: the lease may or may not have
	// changed.
	ErrIndeterminate = errors.New("indeterminate: the request may have reached the server but no answer came in time")
	// ErrNotHeld: the server answered N: the token is not the key's active
	// grant. Nothing changed.
	ErrNotHeld = errors.New("not held")
	// ErrLockLost: a held lock is gone, or may be: a renewal was answered
	// N, or valid_until passed without a successful renewal.
	ErrLockLost = errors.New("lock lost")
	// ErrPermissionDenied: the server refused this client's credentials
	// (X 12, a refused client certificate) or the request is outside the
	// secret's scopes (X 13). Definitive: nothing was executed.
	ErrPermissionDenied = errors.New("permission denied")
	// ErrInvalidArgument: the input broke a rule of the contract and
	// nothing was sent (or the server answered a non-fatal X that the
	// client's checks should have caught). Nothing changed.
	ErrInvalidArgument = errors.New("invalid argument")
	// ErrLimitMismatch: the server answered X 10: the request named a
	// permit limit other than the key's. Definitive: nothing acquired or
	// queued. A *LimitMismatchError carries the key's limit.
	ErrLimitMismatch = errors.New("limit mismatch")
	// ErrClosed: the client was closed before or during the call.
	ErrClosed = errors.New("kunci: the client is closed")
)

// Error is the error every call returns: one of the Err values (Kind),
// with what happened. errors.Is matches its Kind, and its Cause (such as
// context.Canceled) when it has one.
type Error struct {
	Kind   error
	Detail string
	Cause  error
}

func (e *Error) Error() string {
	text := "kunci: " + e.Kind.Error()
	if e.Detail != "" {
		text += ": " + e.Detail
	}
	if e.Cause != nil {
		text += " (" + e.Cause.Error() + ")"
	}
	return text
}

// Unwrap gives the kind of outcome.
func (e *Error) Unwrap() error { return e.Kind }

// Is matches the cause as well as the kind.
func (e *Error) Is(target error) bool {
	return target == e.Kind || (e.Cause != nil && errors.Is(e.Cause, target))
}

func newError(kind error, format string, args ...interface{}) *Error {
	return &Error{Kind: kind, Detail: fmt.Sprintf(format, args...)}
}

func invalid(format string, args ...interface{}) error {
	return newError(ErrInvalidArgument, format, args...)
}

// LimitMismatchError is the ErrLimitMismatch outcome with the key's limit
// as the server named it (KeyLimit 0 when its text did not say).
type LimitMismatchError struct {
	KeyLimit int
	Detail   string
}

func (e *LimitMismatchError) Error() string {
	return "kunci: " + ErrLimitMismatch.Error() + ": " + e.Detail
}

// Unwrap gives ErrLimitMismatch.
func (e *LimitMismatchError) Unwrap() error { return ErrLimitMismatch }

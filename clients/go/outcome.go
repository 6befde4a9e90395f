package kunci

import "fmt"

// errorOf is the error for an attempt's result that is not the answer
// its call wanted.
func errorOf(c *call, r result) error {
	switch r.kind {
	case 'T':
		return &Error{Kind: ErrTimeout}
	case 'B':
		return &Error{Kind: ErrBusy}
	case 'N':
		return newError(ErrNotHeld, "token %d is not the key's active grant", c.token)
	case 'X':
		code, text := r.f.code, r.f.text
		switch code {
		case errTooManyWatches:
			return newError(ErrBusy, "the server holds as many watches as it allows (X 14: %s); nothing is held", text)
		case errNotPermitted:
			return newError(ErrPermissionDenied, "the secret's scopes do not cover this request (X 13: %s); nothing changed", text)
		case errLimitMismatch:
			keyLimit := keyLimitOfMismatch(text)
			has := "no known limit"
			if keyLimit != 0 {
				has = fmt.Sprintf("limit %d", keyLimit)
			}
			return &LimitMismatchError{KeyLimit: keyLimit, Detail: fmt.Sprintf(
				"key %q has %s, this request named limit %d; nothing was acquired", c.key, has, c.limit)}
		}
		return newError(ErrInvalidArgument, "the server refused the request: %s (X %d)", text, code)
	case resMoved:
		return newError(ErrUnavailable, "%s; nothing was sent", r.reason)
	case resDenied:
		return newError(ErrPermissionDenied, "%s; nothing was executed", r.reason)
	case resIndeterminate:
		return &Error{Kind: ErrIndeterminate, Detail: r.reason, Cause: r.cause}
	}
	return newError(ErrIndeterminate, "unexpected answer %q", r.kind)
}

package kunci

import (
	"crypto/tls"
	"os"
	"strings"
	"time"
)

// Option configures Dial (Secret, SecretFile, TLS, AllowPlaintextSecret,
// ConnectTimeout) or one call (Wait, Lease, Label, Limit, Take, Shared).
// An option given where it means nothing is ErrInvalidArgument.
type Option func(*settings)

type settings struct {
	// Dial.
	secret, secretFile   *string
	tls                  *tls.Config
	tlsSet               bool
	allowPlaintextSecret bool
	connectTimeout       time.Duration
	dialOnly             []string

	// Calls.
	wait, lease       time.Duration
	waitSet, leaseSet bool
	label             *string
	limit, take       int
	limitSet, takeSet bool
	shared            bool
	callOnly          []string
}

func dialOption(name string, f func(*settings)) Option {
	return func(s *settings) { s.dialOnly = append(s.dialOnly, name); f(s) }
}

func callOption(name string, f func(*settings)) Option {
	return func(s *settings) { s.callOnly = append(s.callOnly, name); f(s) }
}

// Secret is sent as U before anything else on every connection (spec §12),
// for a server with --auth. One trailing newline is dropped; at least 32
// bytes. Default: $KUNCI_SECRET. It goes only over TLS, to a loopback
// address or over a unix socket, unless AllowPlaintextSecret.
func Secret(secret string) Option {
	return dialOption("Secret", func(s *settings) { s.secret = &secret })
}

// SecretFile reads the secret from a file (it wins over $KUNCI_SECRET).
func SecretFile(path string) Option {
	return dialOption("SecretFile", func(s *settings) { s.secretFile = &path })
}

// TLS speaks TLS with config to every TCP address (a private CA in
// RootCAs, a client certificate in Certificates); the server's name is
// checked against its certificate (ServerName defaults to the address's
// host). tls:// addresses speak TLS without it, trusting $KUNCI_TLS_CA or
// the system's roots.
func TLS(config *tls.Config) Option {
	return dialOption("TLS", func(s *settings) { s.tls, s.tlsSet = config, true })
}

// AllowPlaintextSecret lets a secret go in clear to an address that is
// neither loopback nor a unix socket (as KUNCI_ALLOW_PLAINTEXT_SECRET=1).
func AllowPlaintextSecret() Option {
	return dialOption("AllowPlaintextSecret", func(s *settings) { s.allowPlaintextSecret = true })
}

// ConnectTimeout bounds each connection attempt (default 1 s); a call's
// own deadline bounds it too.
func ConnectTimeout(d time.Duration) Option {
	return dialOption("ConnectTimeout", func(s *settings) { s.connectTimeout = d })
}

// Wait is how long an acquire may wait in the key's queue: 0 (the
// default) is one try; at most 255 s, fractions allowed. For Campaign it
// bounds the whole campaign (default: until elected).
func Wait(d time.Duration) Option {
	return callOption("Wait", func(s *settings) { s.wait, s.waitSet = d, true })
}

// Lease is the grant's lease, whole seconds in 1..=255 (default 30 s).
func Lease(d time.Duration) Option {
	return callOption("Lease", func(s *settings) { s.lease, s.leaseSet = d, true })
}

// Label says who asks (up to 128 UTF-8 bytes, no newline); the server
// keeps it with the waiter and the grant (spec §11).
func Label(label string) Option {
	return callOption("Label", func(s *settings) { s.label = &label })
}

// Limit makes the key a semaphore of n permits (1..=65535); the acquire
// takes one unless Take says more (spec §10).
func Limit(n int) Option {
	return callOption("Limit", func(s *settings) { s.limit, s.limitSet = n, true })
}

// Take is how many of Limit's permits the acquire takes.
func Take(n int) Option {
	return callOption("Take", func(s *settings) { s.take, s.takeSet = n, true })
}

// Shared is a shared lock: limit 65535, take 1 (many shared holders, or
// one exclusive).
func Shared() Option {
	return callOption("Shared", func(s *settings) { s.shared = true })
}

func applyOptions(opts []Option) *settings {
	s := &settings{}
	for _, opt := range opts {
		if opt != nil {
			opt(s)
		}
	}
	return s
}

// acquireArgs are an acquire's checked options.
type acquireArgs struct {
	wait        time.Duration
	lease       uint8
	limit, take uint16
	label       []byte
}

func (s *settings) acquireArgs() (acquireArgs, error) {
	var a acquireArgs
	if len(s.dialOnly) > 0 {
		return a, invalid("%s is an option of Dial, not of a call", strings.Join(s.dialOnly, ", "))
	}
	if err := checkWait(s.wait); err != nil {
		return a, err
	}
	a.wait = s.wait
	lease := DefaultLease
	if s.leaseSet {
		lease = s.lease
	}
	l, err := checkLease(lease)
	if err != nil {
		return a, err
	}
	a.lease = l
	if s.label != nil {
		label, err := checkText(*s.label, "label", 0, labelLenMax)
		if err != nil {
			return a, err
		}
		a.label = label
	}
	switch {
	case s.shared:
		if s.limitSet || s.takeSet {
			return a, invalid("Shared is limit %d take 1: it takes no Limit or Take", SharedLimit)
		}
		a.limit, a.take = SharedLimit, 1
	case !s.limitSet:
		if s.takeSet {
			return a, invalid("Take needs a Limit (take permits out of how many?)")
		}
	default:
		if s.limit < 1 || s.limit > 65535 {
			return a, invalid("Limit must be 1..=65535, got %d", s.limit)
		}
		take := 1
		if s.takeSet {
			take = s.take
			if take < 1 || take > 65535 {
				return a, invalid("Take must be 1..=65535, got %d", take)
			}
			if take > s.limit {
				return a, invalid("Take %d is more than the Limit %d", take, s.limit)
			}
		}
		a.limit, a.take = uint16(s.limit), uint16(take)
	}
	return a, nil
}

// secretOf is the secret to send: Secret, else SecretFile, else
// $KUNCI_SECRET, else none.
func (s *settings) secretOf() ([]byte, error) {
	if s.secret != nil && s.secretFile != nil {
		return nil, invalid("give Secret or SecretFile, not both")
	}
	if s.secret != nil {
		return checkSecret(*s.secret)
	}
	if s.secretFile != nil {
		data, err := os.ReadFile(*s.secretFile)
		if err != nil {
			return nil, invalid("SecretFile %q: %v", *s.secretFile, err)
		}
		return checkSecret(string(data))
	}
	if env := os.Getenv("KUNCI_SECRET"); env != "" {
		secret, err := checkSecret(env)
		if err != nil {
			return nil, invalid("KUNCI_SECRET: %s", err.(*Error).Detail)
		}
		return secret, nil
	}
	return nil, nil
}

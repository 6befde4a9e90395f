package kunci

import "time"

// KeyStatus is what Query returns for a key that is not free: the active
// grant's Token (0 while no grant is known, as during the grace after an
// unclean restart), the Owner id of the request that was granted, the
// lease left and the number of queued waiters. Out of date as soon as it
// arrives: never use it as a lock.
type KeyStatus struct {
	Token     uint64
	Owner     uint64
	LeaseLeft time.Duration
	Waiters   uint32
}

// Grant is one grant of a key (spec §11.2): its fencing Token (0 is the
// unknown grant of a crash grace), the Owner id of the request, the
// permits it holds (Take; 0 is all), its lease left, how long it has been
// held and its Label.
type Grant struct {
	Token     uint64
	Owner     uint64
	Take      uint16
	LeaseLeft time.Duration
	HeldFor   time.Duration
	Label     string
}

// Waiter is one waiter of a key: its Owner id, the permits it asks for
// (Take; 0 is all), the time left until its wait runs out and its Label.
type Waiter struct {
	Owner    uint64
	Take     uint16
	WaitLeft time.Duration
	Label    string
}

// Holders is what Holders found: the key's grants in token order, its
// waiters in queue order, and how many the server left out (it lists at
// most 1000 of each). A snapshot: never use it as a lock.
type Holders struct {
	Grants  []Grant
	Waiters []Waiter
	LeftOut uint64
}

// KeyInfo is one key of the server's table (spec §11.3).
type KeyInfo struct {
	Key     string
	Grants  uint32
	Waiters uint32
	Limit   uint16 // 0 when no request named one
}

// Leader is who leads an election (spec §13.6): the Value it campaigned
// (or last proclaimed) with, its Term (the grant's token: a fencing token
// for what it writes) and how long it has led. During the grace after a
// server's crash the leader is not known: Term 0, Value "" and HeldFor
// -1.
type Leader struct {
	Value   string
	Term    uint64
	HeldFor time.Duration
}

func ms(n uint32) time.Duration { return time.Duration(n) * time.Millisecond }

// leaderOf is the leader a V frame shows, or nil when nobody leads.
func leaderOf(f frame) *Leader {
	if f.b == 0 {
		if f.small > 0 {
			// A crash grace (spec §7.2): somebody may lead, unknown.
			return &Leader{HeldFor: -1}
		}
		return nil
	}
	return &Leader{Value: f.text, Term: f.b, HeldFor: ms(f.n2)}
}

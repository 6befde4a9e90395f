package kunci

import (
	"math/rand"
	"os"
	"sync"
	"time"
)

// retryJitter is the jitter of a retry pause (spec §13.6, v5): each pause
// of Campaign, Observe and the clean-up after ErrIndeterminate is taken
// uniformly from ±25 % of its nominal length, so that the clients of a
// server that restarts do not all come back in the same millisecond.
const retryJitter = 0.25

var (
	jitterMu sync.Mutex
	// Its own source: before Go 1.20 the package's default source starts
	// from the same seed in every process, which is what jitter must avoid.
	jitterRand = rand.New(rand.NewSource(time.Now().UnixNano() ^ int64(os.Getpid())<<32))
)

// jittered is d ± retryJitter, uniformly.
func jittered(d time.Duration) time.Duration {
	jitterMu.Lock()
	f := jitterRand.Float64()
	jitterMu.Unlock()
	return time.Duration(float64(d) * (1 - retryJitter + 2*retryJitter*f))
}

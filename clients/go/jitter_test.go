package kunci

import (
	"testing"
	"time"
)

func TestRetryPausesAreJitteredByAQuarter(t *testing.T) {
	pause := 100 * time.Millisecond
	low, high := 75*time.Millisecond, 125*time.Millisecond
	hits := make([]int, 5)
	seen := map[time.Duration]bool{}
	for i := 0; i < 10000; i++ {
		d := jittered(pause)
		if d < low || d > high {
			t.Fatalf("jittered(%v) = %v, outside [%v, %v]", pause, d, low, high)
		}
		fifth := int((d - low) / (10 * time.Millisecond))
		if fifth == 5 {
			fifth = 4
		}
		hits[fifth]++
		seen[d] = true
	}
	for fifth, n := range hits {
		if n < 1500 || n > 2500 {
			t.Errorf("fifth %d of the range got %d of 10000 draws", fifth, n)
		}
	}
	if len(seen) < 9000 {
		t.Errorf("only %d distinct pauses in 10000", len(seen))
	}
	if d := jittered(retryPauseMax); d < 1500*time.Millisecond || d > 2500*time.Millisecond {
		t.Errorf("the capped pause became %v", d)
	}
}

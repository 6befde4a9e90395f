// Command pairs is `kunci bench pairs` through the Go client: each
// in-flight slot acquires (wait 0) a random key among -keys and releases
// it with its token as soon as the grant arrives. -c clients (one
// connection each) with -p goroutines each: -p 1 is one request in
// flight per connection; a larger -p pipelines that many calls over the
// client's one connection. It prints requests/s (both requests of a pair
// count) and latency percentiles over every request.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand"
	"os"
	"runtime/pprof"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"kunci"
)

func main() {
	server := flag.String("server", "", "address (default $KUNCI_SERVER, else 127.0.0.1:5862)")
	clients := flag.Int("c", 50, "clients, one connection each")
	perClient := flag.Int("p", 1, "goroutines per client (requests in flight per connection)")
	keys := flag.Int("keys", 1000000, "key space")
	duration := flag.Duration("duration", 10*time.Second, "measured time")
	warmup := flag.Duration("warmup", 2*time.Second, "time run before measuring")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the measured time to this file")
	flag.Parse()

	var measuring atomic.Bool
	var requests, misses atomic.Int64
	var failures atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	latencies := make([][]time.Duration, *clients**perClient)
	ctx := context.Background()
	for i := 0; i < *clients; i++ {
		c, err := kunci.Dial(*server)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		defer c.Close()
		for j := 0; j < *perClient; j++ {
			slot := i**perClient + j
			wg.Add(1)
			go func(c *kunci.Client, slot int) {
				defer wg.Done()
				rng := rand.New(rand.NewSource(int64(slot) + time.Now().UnixNano()))
				var own []time.Duration
				for {
					select {
					case <-stop:
						latencies[slot] = own
						return
					default:
					}
					key := fmt.Sprintf("pair-%d", rng.Intn(*keys))
					start := time.Now()
					t, err := c.Acquire(ctx, key, kunci.Lease(10*time.Second))
					acquired := time.Now()
					on := measuring.Load()
					if on {
						own = append(own, acquired.Sub(start))
						requests.Add(1)
					}
					if errors.Is(err, kunci.ErrTimeout) {
						misses.Add(1)
						continue
					}
					if err != nil {
						failures.Add(1)
						fmt.Fprintln(os.Stderr, "acquire:", err)
						continue
					}
					if err := t.Release(ctx); err != nil {
						failures.Add(1)
						fmt.Fprintln(os.Stderr, "release:", err)
					}
					if on {
						own = append(own, time.Since(acquired))
						requests.Add(1)
					}
				}
			}(c, slot)
		}
	}
	time.Sleep(*warmup)
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
	}
	measuring.Store(true)
	start := time.Now()
	time.Sleep(*duration)
	measuring.Store(false)
	if *cpuProfile != "" {
		pprof.StopCPUProfile()
	}
	elapsed := time.Since(start)
	close(stop)
	wg.Wait()
	var all []time.Duration
	for _, l := range latencies {
		all = append(all, l...)
	}
	sort.Slice(all, func(i, j int) bool { return all[i] < all[j] })
	pct := func(p float64) time.Duration {
		if len(all) == 0 {
			return 0
		}
		return all[int(p*float64(len(all)-1))]
	}
	us := func(d time.Duration) int64 { return d.Microseconds() }
	fmt.Printf("go pairs C=%d P=%d: %.0f req/s (%d requests in %.1f s, %d misses, %d errors); latency µs p50 %d p99 %d p99.9 %d\n",
		*clients, *perClient, float64(requests.Load())/elapsed.Seconds(), requests.Load(), elapsed.Seconds(),
		misses.Load(), failures.Load(), us(pct(0.5)), us(pct(0.99)), us(pct(0.999)))
	if failures.Load() > 0 {
		os.Exit(1)
	}
}

package main // a cron job that runs on one host at a time, its lock renewed while it runs

import (
	"context"
	"errors"
	"log"
	"time"

	"kunci"
)

func main() {
	c, err := kunci.Dial("") // $KUNCI_SERVER, else 127.0.0.1:5862
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	lock, err := c.Lock(ctx, "nightly-backup", kunci.Wait(10*time.Second), kunci.Lease(30*time.Second))
	if errors.Is(err, kunci.ErrTimeout) {
		log.Print("another run holds the lock: skipping")
		return
	} else if err != nil {
		log.Fatal(err) // ErrIndeterminate too: never run without the lock
	}
	defer lock.Unlock(ctx)
	log.Printf("backing up with fencing token %d", lock.Token()) // the store refuses older tokens
}

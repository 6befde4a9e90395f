package main // a leader-elected worker: it works while it leads, then campaigns again

import (
	"context"
	"kunci"
	"log"
	"os"
	"os/signal"
)

func main() {
	ctx, _ := signal.NotifyContext(context.Background(), os.Interrupt) // ends with the program
	c, err := kunci.Dial("")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close() // resigns a lead still held
	host, _ := os.Hostname()
	for ctx.Err() == nil {
		lead, err := c.Campaign(ctx, "report-worker", host) // returns once leading
		if err != nil {
			log.Fatal(err) // outages are waited through: this is ctx's end, or a refusal
		}
		log.Printf("leading, term %d", lead.Term()) // pass the term to what it writes
		select {
		case <-lead.Lost():
		case <-ctx.Done():
		}
	}
}

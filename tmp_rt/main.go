package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/redis/rueidis"
)

func main() {
	ctx := context.Background()
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{"127.0.0.1:16411"}, DisableCache: true})
	if err != nil {
		panic(err)
	}
	defer c.Close()
	ping := c.B().Ping().Build().Pin()
	bench := func(name string, f func()) {
		const n = 5000
		start := time.Now()
		for range n {
			f()
		}
		fmt.Printf("%s: %.1f µs/op\n", name, float64(time.Since(start).Microseconds())/n)
	}
	for range 2 {
		bench("sync (fresh pipe)", func() { c.Do(ctx, ping) })
	}
	// force background mode: overlap calls
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() { defer wg.Done(); c.Do(ctx, ping) }()
	}
	wg.Wait()
	for range 2 {
		bench("pipelined", func() { c.Do(ctx, ping) })
		bench("pipelined, goroutine hop", func() {
			ch := make(chan struct{})
			go func() { c.Do(ctx, ping); close(ch) }()
			<-ch
		})
	}
	d, cancel := c.Dedicate()
	defer cancel()
	for range 2 {
		bench("dedicated", func() { d.Do(ctx, ping) })
		bench("dedicated, goroutine hop", func() {
			ch := make(chan struct{})
			go func() { d.Do(ctx, ping); close(ch) }()
			<-ch
		})
	}
}

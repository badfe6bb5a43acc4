package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"
)

// Scenario D, handoff latency: one holder and one waiter, each in its own client
// (two Contender instances, so two connections, as two processes would have). The
// holder takes the lock, the waiter starts Lock, the holder keeps the lock a random
// 2-12 ms (so the release falls at a random point of a polling waiter's sleep), then
// releases. A sample is the time from the holder's Unlock returning to the waiter's
// Lock returning. Samples are spread over the repetitions; the percentiles are
// taken over all of them. A cell takes its share of the samples and goes on until
// it has also run for the profile's DDuration: the p99 of a contender that hands
// off fast rests on more than its two or three slowest samples.

// DRun is one repetition of scenario D for one contender.
type DRun struct {
	Contender string `json:"contender"`
	Rep       int    `json:"rep"`
	// SamplesUs are the handoff latencies in microseconds, in the order taken.
	SamplesUs []float64 `json:"samples_us"`
	Latency   Latency   `json:"latency"`
	// Violations counts waiters whose Lock returned before the holder started its
	// release.
	Violations int    `json:"violations"`
	Errors     int    `json:"errors"`
	FirstError string `json:"first_error,omitempty"`
}

// dParkMin and dParkSpread set how long the holder keeps the lock after the waiter
// started: dParkMin plus a uniform random part below dParkSpread.
const (
	dParkMin    = 2 * time.Millisecond
	dParkSpread = 10 * time.Millisecond
	// dSampleTimeout bounds each Lock and Unlock of the scenario.
	dSampleTimeout = 2 * time.Second
)

// runD runs one repetition of scenario D, taking at least n samples and going on
// until minDur has passed.
func (r *runner) runD(ctx context.Context, kind contenderKind, rep, n int, minDur time.Duration) (DRun, error) {
	run := DRun{Contender: kind.name, Rep: rep}
	hc, err := kind.open(r.addr)
	if err != nil {
		return run, fmt.Errorf("%s: open: %w", kind.name, err)
	}
	defer hc.Close()
	wc, err := kind.open(r.addr)
	if err != nil {
		return run, fmt.Errorf("%s: open: %w", kind.name, err)
	}
	defer wc.Close()
	name := fmt.Sprintf("bench:D:%s:r%d", kind.name, rep)
	holder, waiter := hc.NewLocker(name), wc.NewLocker(name)
	var errs errorLog
	var samples []time.Duration
	start := time.Now()
	for i := 0; i < n || time.Since(start) < minDur; i++ {
		if ctx.Err() != nil {
			return run, ctx.Err()
		}
		sample, violated, err := handoffOnce(ctx, holder, waiter)
		if err != nil {
			errs.add(err)
			continue
		}
		if violated {
			run.Violations++
		}
		samples = append(samples, sample)
		run.SamplesUs = append(run.SamplesUs, micros(sample))
	}
	run.Latency = latencyOf(samples)
	run.Errors = int(errs.n.Load())
	run.FirstError = errs.first
	return run, nil
}

// handoffOnce takes one sample: the time from the holder's Unlock returning to the
// waiter's Lock returning, and whether the waiter got in before the release began.
func handoffOnce(ctx context.Context, holder, waiter Locker) (time.Duration, bool, error) {
	lctx, cancel := context.WithTimeout(ctx, dSampleTimeout)
	defer cancel()
	if err := holder.Lock(lctx); err != nil {
		return 0, false, fmt.Errorf("holder lock: %w", err)
	}
	type acquired struct {
		at  time.Time
		err error
	}
	got := make(chan acquired, 1)
	go func() {
		err := waiter.Lock(lctx)
		got <- acquired{time.Now(), err}
	}()
	time.Sleep(dParkMin + rand.N(dParkSpread))
	releaseStart := time.Now()
	if err := holder.Unlock(lctx); err != nil {
		<-got // the waiter gets the lock once its lease runs out, or gives up
		return 0, false, fmt.Errorf("holder unlock: %w", err)
	}
	released := time.Now()
	a := <-got
	if a.err != nil {
		return 0, false, fmt.Errorf("waiter lock: %w", a.err)
	}
	err := waiter.Unlock(lctx)
	if err != nil {
		err = fmt.Errorf("waiter unlock: %w", err)
	}
	return a.at.Sub(released), a.at.Before(releaseStart), err
}

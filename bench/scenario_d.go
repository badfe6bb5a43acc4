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
// taken over all of them. A repetition's cell takes its share of the samples and
// goes on until it has also run for the profile's DDuration: the p99 of a
// contender that hands off fast rests on more than its two or three slowest
// samples.
//
// A repetition takes its cells in DRounds rounds: in each, every contender takes
// its share of the cell's samples and of its duration in turn, the order rotated
// each round. A p99 is a handful of samples, which a burst of the machine's noise
// lasting a few hundred milliseconds can supply; back to back, such a burst fell
// on one contender's cell. Taken in rounds, every contender's samples are spread
// over the same stretch of time, in slices, so a burst costs each contender a
// slice at most and the ratios of the p99s compare the locks more than the
// moments their cells ran. Every contender's two clients stay open for the whole
// repetition.

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

// runDRep runs one repetition of scenario D for the contenders of order that take
// part in it, in the profile's rounds (see the top of this file): each round
// runs one step per contender through cell, which reports progress and failures.
// A contender whose clients do not open fails its first step, and its steps in
// the later rounds only report that. When every round has run (ctx has not ended), the
// repetition's DRuns are appended to the results in order's order, for the
// contenders that opened.
func (r *runner) runDRep(ctx context.Context, order []contenderKind, rep int, cell func(k contenderKind, label string, f func() error)) {
	var kinds []contenderKind
	for _, k := range order {
		if k.runsIn("D") {
			kinds = append(kinds, k)
		}
	}
	rounds, n, dur := r.prof.dRound()
	cells := make([]*dCell, len(kinds))
	failed := make([]bool, len(kinds))
	defer func() {
		for _, d := range cells {
			if d != nil {
				d.close()
			}
		}
	}()
	for round := range rounds {
		for j := range kinds {
			i := (j + round) % len(kinds) // kinds rotated by round
			k := kinds[i]
			label := fmt.Sprintf("D handoff latency  round %d/%d  %s", round+1, rounds, k.name)
			if failed[i] {
				cell(k, label+" (did not open)", func() error { return nil })
				continue
			}
			cell(k, label, func() error {
				if cells[i] == nil {
					d, err := r.openD(k, rep)
					if err != nil {
						failed[i] = true
						return err
					}
					cells[i] = d
				}
				return cells[i].take(ctx, n, dur)
			})
		}
	}
	if ctx.Err() != nil {
		return
	}
	for _, d := range cells {
		if d != nil {
			r.res.D = append(r.res.D, d.result())
		}
	}
}

// dCell is one contender's D cell in one repetition, taken over the rounds.
type dCell struct {
	hc, wc         Contender
	holder, waiter Locker
	run            DRun
	samples        []time.Duration
	errs           errorLog
}

// openD opens kind's two clients for repetition rep's D cell.
func (r *runner) openD(kind contenderKind, rep int) (*dCell, error) {
	hc, err := kind.open(r.addr)
	if err != nil {
		return nil, fmt.Errorf("%s: open: %w", kind.name, err)
	}
	wc, err := kind.open(r.addr)
	if err != nil {
		hc.Close()
		return nil, fmt.Errorf("%s: open: %w", kind.name, err)
	}
	name := fmt.Sprintf("bench:D:%s:r%d", kind.name, rep)
	return &dCell{
		hc: hc, wc: wc,
		holder: hc.NewLocker(name), waiter: wc.NewLocker(name),
		run: DRun{Contender: kind.name, Rep: rep},
	}, nil
}

// take takes at least n samples, and goes on until minDur has passed. It returns
// ctx's error when ctx ends; a sample that fails is counted and the cell goes on.
func (d *dCell) take(ctx context.Context, n int, minDur time.Duration) error {
	start := time.Now()
	for i := 0; i < n || time.Since(start) < minDur; i++ {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		sample, violated, err := handoffOnce(ctx, d.holder, d.waiter)
		if err != nil {
			d.errs.add(err)
			continue
		}
		if violated {
			d.run.Violations++
		}
		d.samples = append(d.samples, sample)
		d.run.SamplesUs = append(d.run.SamplesUs, micros(sample))
	}
	return nil
}

// result returns the cell's DRun, its latency taken over every round's samples.
func (d *dCell) result() DRun {
	run := d.run
	run.Latency = latencyOf(d.samples)
	run.Errors = int(d.errs.n.Load())
	run.FirstError = d.errs.first
	return run
}

// close closes the cell's clients.
func (d *dCell) close() {
	d.hc.Close()
	d.wc.Close()
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

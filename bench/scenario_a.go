package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Scenario A, contended: G goroutines of one process, each with its own handle,
// take one lock over and over with zero hold time for a fixed duration. It shows
// throughput (acquisitions/s), whether the lock actually moves between goroutines
// (owner changes/s: the next holder is a different goroutine than the previous),
// how long a Lock call waits (p50/p99), and how evenly the acquisitions are shared
// (Jain's index; starved = goroutines that never got it). An in-process atomic
// counts moments with two holders inside (scenario E).

// ARun is one cell of scenario A: one contender, G goroutines, one repetition.
type ARun struct {
	Contender string `json:"contender"`
	G         int    `json:"goroutines"`
	Rep       int    `json:"rep"`
	// Seconds is the measured duration.
	Seconds       float64 `json:"seconds"`
	Acquisitions  int64   `json:"acquisitions"`
	OwnerChanges  int64   `json:"owner_changes"`
	AcqPerSec     float64 `json:"acquisitions_per_sec"`
	ChangesPerSec float64 `json:"owner_changes_per_sec"`
	// Latency is of Lock calls that acquired (call to return).
	Latency Latency `json:"acquire_latency"`
	// Counts is each goroutine's number of acquisitions.
	Counts  []int64 `json:"counts"`
	Jain    float64 `json:"jain"`
	Starved int     `json:"starved"`
	// Violations counts acquisitions that found another holder inside.
	Violations int64 `json:"violations"`
	// Errors counts Lock or Unlock calls that failed for another reason than the
	// end of the measured duration.
	Errors     int64     `json:"errors"`
	FirstError string    `json:"first_error,omitempty"`
	Redis      RedisWork `json:"redis"`
	ReqPerAcq  float64   `json:"requests_per_acquisition"`
	CmdsPerAcq float64   `json:"server_commands_per_acquisition"`
	// Client is the harness process's cost per acquisition.
	Client ClientCost `json:"client_cost"`
}

// errorLog keeps a count of errors and the first one's text.
type errorLog struct {
	n     atomic.Int64
	once  sync.Once
	first string
}

// add counts err.
func (e *errorLog) add(err error) {
	e.n.Add(1)
	e.once.Do(func() { e.first = err.Error() })
}

// unlockTimeout bounds each Unlock the harness makes.
const unlockTimeout = 10 * time.Second

// runA runs one cell of scenario A.
func (r *runner) runA(ctx context.Context, kind contenderKind, g, rep int) (ARun, error) {
	c, err := kind.open(r.addr)
	if err != nil {
		return ARun{}, fmt.Errorf("%s: open: %w", kind.name, err)
	}
	defer c.Close()
	name := fmt.Sprintf("bench:A:%s:g%d:r%d", kind.name, g, rep)
	lockers := make([]Locker, g)
	for i := range lockers {
		lockers[i] = c.NewLocker(name)
	}
	if err := r.stats.reset(ctx); err != nil {
		return ARun{}, err
	}

	var (
		inside     atomic.Int32
		last       atomic.Int64
		changes    atomic.Int64
		violations atomic.Int64
		errs       errorLog
		counts     = make([]int64, g)
		lats       = make([][]time.Duration, g)
		wg         sync.WaitGroup
	)
	last.Store(-1)
	dur := r.prof.ADuration
	snap := takeClientSnapshot()
	start := time.Now()
	deadline := start.Add(dur)
	runCtx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	for i, l := range lockers {
		wg.Go(func() {
			id := int64(i)
			for runCtx.Err() == nil {
				t0 := time.Now()
				if err := l.Lock(runCtx); err != nil {
					if runCtx.Err() == nil {
						errs.add(err)
						time.Sleep(time.Millisecond) // no hot loop on a failing server
					}
					continue
				}
				t1 := time.Now()
				if inside.Add(1) != 1 {
					violations.Add(1)
				}
				prev := last.Swap(id)
				if t1.Before(deadline) {
					if prev != id && prev >= 0 {
						changes.Add(1)
					}
					counts[i]++
					lats[i] = append(lats[i], t1.Sub(t0))
				}
				inside.Add(-1)
				uctx, ucancel := context.WithTimeout(context.Background(), unlockTimeout)
				if err := l.Unlock(uctx); err != nil {
					errs.add(err)
				}
				ucancel()
			}
		})
	}
	wg.Wait()
	var total int64
	for i := range counts {
		total += counts[i]
	}
	cost := costSince(snap, total)
	work, err := r.stats.work(ctx, kind.scriptOnly)
	if err != nil {
		return ARun{}, err
	}
	shared, err := sharedSent(ctx, c)
	if err != nil {
		return ARun{}, err
	}
	work.addShared(shared)
	var all []time.Duration
	for i := range lats {
		all = append(all, lats[i]...)
	}
	run := ARun{
		Contender:     kind.name,
		G:             g,
		Rep:           rep,
		Seconds:       dur.Seconds(),
		Acquisitions:  total,
		OwnerChanges:  changes.Load(),
		AcqPerSec:     ratePerSec(total, dur),
		ChangesPerSec: ratePerSec(changes.Load(), dur),
		Latency:       latencyOf(all),
		Counts:        counts,
		Jain:          jain(counts),
		Starved:       starved(counts),
		Violations:    violations.Load(),
		Errors:        errs.n.Load(),
		FirstError:    errs.first,
		Redis:         work,
		ReqPerAcq:     perOp(float64(work.Requests), total),
		CmdsPerAcq:    perOp(float64(work.Commands), total),
		Client:        cost,
	}
	return run, nil
}

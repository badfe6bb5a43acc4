package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Scenario B, uncontended: many goroutines of one process, each on its own lock,
// lock and unlock as fast as they can for a fixed duration. Nobody ever waits, so
// this is the cost of the lock/unlock path itself: client overhead, round trips,
// and how well concurrent calls share connections (pipelining).

// BRun is one cell of scenario B: one contender, one repetition.
type BRun struct {
	Contender string  `json:"contender"`
	G         int     `json:"goroutines"`
	Rep       int     `json:"rep"`
	Seconds   float64 `json:"seconds"`
	// Ops counts completed lock+unlock cycles.
	Ops       int64   `json:"ops"`
	OpsPerSec float64 `json:"ops_per_sec"`
	// Latency is of whole cycles (Lock call to Unlock return).
	Latency    Latency   `json:"cycle_latency"`
	Errors     int64     `json:"errors"`
	FirstError string    `json:"first_error,omitempty"`
	Redis      RedisWork `json:"redis"`
	ReqPerOp   float64   `json:"requests_per_op"`
	// Client is the harness process's cost per lock+unlock cycle.
	Client ClientCost `json:"client_cost"`
}

// runB runs one cell of scenario B.
func (r *runner) runB(ctx context.Context, kind contenderKind, rep int) (BRun, error) {
	c, err := kind.open(r.addr)
	if err != nil {
		return BRun{}, fmt.Errorf("%s: open: %w", kind.name, err)
	}
	defer c.Close()
	g := r.prof.BGoroutines
	lockers := make([]Locker, g)
	for i := range lockers {
		lockers[i] = c.NewLocker(fmt.Sprintf("bench:B:%s:r%d:%d", kind.name, rep, i))
	}
	if err := r.stats.reset(ctx); err != nil {
		return BRun{}, err
	}

	var (
		ops  atomic.Int64
		errs errorLog
		lats = make([][]time.Duration, g)
		wg   sync.WaitGroup
	)
	dur := r.prof.BDuration
	snap := takeClientSnapshot()
	deadline := time.Now().Add(dur)
	runCtx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	for i, l := range lockers {
		wg.Go(func() {
			for runCtx.Err() == nil {
				t0 := time.Now()
				if err := l.Lock(runCtx); err != nil {
					if runCtx.Err() == nil {
						errs.add(err)
						time.Sleep(time.Millisecond)
					}
					continue
				}
				uctx, ucancel := context.WithTimeout(context.Background(), unlockTimeout)
				err := l.Unlock(uctx)
				ucancel()
				if err != nil {
					errs.add(err)
					continue
				}
				if t1 := time.Now(); t1.Before(deadline) {
					ops.Add(1)
					lats[i] = append(lats[i], t1.Sub(t0))
				}
			}
		})
	}
	wg.Wait()
	cost := costSince(snap, ops.Load())
	work, err := r.stats.work(ctx, kind.scriptOnly)
	if err != nil {
		return BRun{}, err
	}
	shared, err := sharedSent(ctx, c)
	if err != nil {
		return BRun{}, err
	}
	work.addShared(shared)
	var all []time.Duration
	for _, l := range lats {
		all = append(all, l...)
	}
	n := ops.Load()
	return BRun{
		Contender:  kind.name,
		G:          g,
		Rep:        rep,
		Seconds:    dur.Seconds(),
		Ops:        n,
		OpsPerSec:  ratePerSec(n, dur),
		Latency:    latencyOf(all),
		Errors:     errs.n.Load(),
		FirstError: errs.first,
		Redis:      work,
		ReqPerOp:   perOp(float64(work.Requests), n),
		Client:     cost,
	}, nil
}

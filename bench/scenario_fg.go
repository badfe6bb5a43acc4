package main

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"syscall"
	"time"

	"github.com/leash-go/leash/lockapi"
)

// Scenarios F and G measure what leash costs at rest, with nothing moving: many
// locks held under the watchdog (F), and many waiters parked on one held lock (G).
// They exercise leash only: the peers have no watchdog batching (redislock and
// redsync have none; rueidislock runs a goroutine and a timer per held lock) and
// their waiters are goroutines of the caller.

// FRun is one repetition of scenario F.
type FRun struct {
	Rep   int `json:"rep"`
	Locks int `json:"locks"`
	// WatchdogSeconds is the lease; renewals run every third of it (one period).
	WatchdogSeconds float64 `json:"watchdog_seconds"`
	PeriodSeconds   float64 `json:"period_seconds"`
	// MeasuredSeconds is the quiet window over which the figures below are taken.
	MeasuredSeconds   float64 `json:"measured_seconds"`
	AcquireSeconds    float64 `json:"acquire_seconds"`
	RequestsPerPeriod float64 `json:"requests_per_period"`
	CommandsPerPeriod float64 `json:"server_commands_per_period"`
	// CPUPerPeriodMs is the whole process's CPU time (user+system) per period.
	CPUPerPeriodMs    float64   `json:"cpu_ms_per_period"`
	GoroutinesBefore  int       `json:"goroutines_before"`
	GoroutinesHeld    int       `json:"goroutines_held"`
	GoroutinesPerLock float64   `json:"goroutines_per_lock"`
	HeapPerLockBytes  float64   `json:"heap_bytes_per_lock"`
	Renewals          uint64    `json:"engine_renewals"`
	Lost              int       `json:"lost"`
	Redis             RedisWork `json:"redis"`
}

// GRun is one repetition of scenario G.
type GRun struct {
	Rep     int `json:"rep"`
	Waiters int `json:"waiters"`
	// Parked is how many waiters the engine reported parked when measured.
	Parked            int     `json:"parked"`
	HeapPerWaiter     float64 `json:"heap_bytes_per_waiter"`
	GoroutinesPerWait float64 `json:"goroutines_per_waiter"`
	Requests          int64   `json:"requests"`
}

// leashKind returns the leash contender's kind (for its script-only commands).
func leashKind() contenderKind {
	k, _ := kindByName("leash")
	return k
}

// heapAfterGC returns the live heap after two collections.
func heapAfterGC() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// settledHeap is heapAfterGC once the process has settled: what earlier
// scenarios' closed clients leave (goroutines still exiting, the buffers they
// hold) would otherwise be freed during a measurement and count against it (a
// tiny G once measured -6 KiB per waiter). It waits, at most 5 s, until neither
// the goroutine count nor the live heap falls any more.
func settledHeap() uint64 {
	deadline := time.Now().Add(5 * time.Second)
	g, h := runtime.NumGoroutine(), heapAfterGC()
	for time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond) // polling the runtime's own state
		g2, h2 := runtime.NumGoroutine(), heapAfterGC()
		if g2 >= g && h2 >= h {
			return h2
		}
		g, h = g2, h2
	}
	return h
}

// cpuTime returns the process's user+system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// runF runs one repetition of scenario F.
func (r *runner) runF(ctx context.Context, rep int) (FRun, error) {
	p := r.prof
	run := FRun{Rep: rep, Locks: p.FLocks, WatchdogSeconds: p.FWatchdog.Seconds(), PeriodSeconds: (p.FWatchdog / 3).Seconds()}
	c, err := lockapi.New(lockapi.Options{Addrs: []string{r.addr}, WatchdogTimeout: p.FWatchdog})
	if err != nil {
		return run, err
	}
	defer c.Close()
	handles := make([]*lockapi.Mutex, p.FLocks)
	chans := make([]<-chan error, p.FLocks)
	run.GoroutinesBefore = runtime.NumGoroutine()
	heapBefore := heapAfterGC()

	t0 := time.Now()
	for i := range handles {
		handles[i] = c.Mutex(fmt.Sprintf("bench:F:r%d:%d", rep, i))
		chans[i] = handles[i].Acquire(ctx)
	}
	var errs []error
	for _, ch := range chans {
		if err := <-ch; err != nil {
			errs = append(errs, err)
		}
	}
	run.AcquireSeconds = time.Since(t0).Seconds()
	if len(errs) > 0 {
		return run, fmt.Errorf("%d of %d acquisitions failed: %w", len(errs), len(chans), errs[0])
	}
	clear(chans)
	run.GoroutinesHeld = runtime.NumGoroutine()
	run.GoroutinesPerLock = float64(run.GoroutinesHeld-run.GoroutinesBefore) / float64(p.FLocks)
	run.HeapPerLockBytes = (float64(heapAfterGC()) - float64(heapBefore)) / float64(p.FLocks)

	before, err := c.Stats(ctx)
	if err != nil {
		return run, err
	}
	if err := r.stats.reset(ctx); err != nil {
		return run, err
	}
	cpu0, w0 := cpuTime(), time.Now()
	window := time.Duration(p.FPeriods) * (p.FWatchdog / 3)
	select {
	case <-time.After(window):
	case <-ctx.Done():
		return run, ctx.Err()
	}
	cpu, measured := cpuTime()-cpu0, time.Since(w0)
	run.Redis, err = r.stats.work(ctx, leashKind().scriptOnly)
	if err != nil {
		return run, err
	}
	after, err := c.Stats(ctx)
	if err != nil {
		return run, err
	}
	periods := measured.Seconds() / run.PeriodSeconds
	run.MeasuredSeconds = measured.Seconds()
	run.Renewals = after.Renewals - before.Renewals
	run.RequestsPerPeriod = float64(run.Redis.Requests) / periods
	run.CommandsPerPeriod = float64(run.Redis.Commands) / periods
	run.CPUPerPeriodMs = float64(cpu) / float64(time.Millisecond) / periods
	for _, h := range handles {
		select {
		case <-h.Lost():
			run.Lost++
		default:
		}
	}
	return run, unlockAll(handles)
}

// unlockAll releases every handle from a few goroutines, so the calls pipeline.
func unlockAll(handles []*lockapi.Mutex) error {
	const parallel = 64
	var wg sync.WaitGroup
	errs := make([]error, parallel)
	for w := range parallel {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			for i := w; i < len(handles); i += parallel {
				if err := handles[i].Unlock(ctx); err != nil && errs[w] == nil {
					errs[w] = err
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// runG runs one repetition of scenario G: Acquire (the channel form, so no
// goroutine of the caller waits) on one held lock from many handles.
func (r *runner) runG(ctx context.Context, rep int) (GRun, error) {
	n := r.prof.GWaiters
	run := GRun{Rep: rep, Waiters: n}
	c, err := lockapi.New(lockapi.Options{Addrs: []string{r.addr}})
	if err != nil {
		return run, err
	}
	defer c.Close()
	name := fmt.Sprintf("bench:G:r%d", rep)
	holder := c.Mutex(name)
	if err := holder.Lock(ctx); err != nil {
		return run, err
	}
	defer holder.Unlock(context.Background())
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	base, err := c.Stats(ctx)
	if err != nil {
		return run, err
	}
	handles := make([]*lockapi.Mutex, n)
	chans := make([]<-chan error, n)
	if err := r.stats.reset(ctx); err != nil {
		return run, err
	}
	heapBefore := settledHeap()
	g0 := runtime.NumGoroutine()
	for i := range handles {
		handles[i] = c.Mutex(name)
		chans[i] = handles[i].Acquire(wctx)
	}
	// Wait (with a deadline) until the engine reports every waiter parked.
	deadline := time.Now().Add(30 * time.Second)
	for {
		s, err := c.Stats(ctx)
		if err != nil {
			return run, err
		}
		run.Parked = s.Waiters - base.Waiters
		if run.Parked >= n || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	run.HeapPerWaiter = (float64(heapAfterGC()) - float64(heapBefore)) / float64(n)
	run.GoroutinesPerWait = float64(runtime.NumGoroutine()-g0) / float64(n)
	work, err := r.stats.work(ctx, leashKind().scriptOnly)
	if err != nil {
		return run, err
	}
	run.Requests = work.Requests
	cancel()
	for _, ch := range chans {
		if err := <-ch; err == nil {
			return run, errors.New("a waiter got a lock that was held all along")
		}
	}
	if run.Parked < n {
		return run, fmt.Errorf("only %d of %d waiters parked within 30s", run.Parked, n)
	}
	return run, nil
}

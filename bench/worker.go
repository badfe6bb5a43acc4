package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// Worker processes for scenario C. The parent re-executes its own binary with
// workerEnv set; the child then runs workerMain instead of the harness. Parent and
// worker talk over the child's stdin and stdout, one JSON object a line, so the
// coordination adds nothing to Redis's command counts:
//
//	parent → worker   workerConfig           (first line)
//	worker → parent   {"ready":true}         contender open, handles made
//	parent → worker   "hold"                 (only to the worker with the holder)
//	worker → parent   {"held":true}          the holder has the lock
//	parent → worker   "go"                   waiters start
//	parent → worker   "release"              the holder releases (only to its worker,
//	                                         after the parent read the queueing's
//	                                         Redis counters)
//	worker → parent   {"acquired":n}         progress, every 200 ms while it changes
//	parent → worker   "abort"                (only if nothing moved for too long)
//	parent → worker   "stop"                 (only at the drain cap, Profile.CDrainCap)
//	worker → parent   {"done":{...}}         every waiter has held and released once,
//	                                         or given up after "abort" or "stop"
//
// Every hold is reported as wall-clock nanoseconds, which all processes on one
// machine share, so the parent can put the holds of every process on one time line.

// workerEnv marks a process as a scenario-C worker. It is set to "1".
const workerEnv = "LEASH_BENCH_WORKER"

// workerConfig is the first line the parent sends a worker.
type workerConfig struct {
	Contender string `json:"contender"`
	Addr      string `json:"addr"`
	Lock      string `json:"lock"`
	// Waiters is how many goroutines take the lock once each.
	Waiters int `json:"waiters"`
	// Hold is how long each waiter holds the lock.
	Hold time.Duration `json:"hold"`
	// HolderHold, when positive, makes this worker take the lock first, before
	// the waiters start, and hold it until the parent says "release", which it
	// does HolderHold after "go".
	HolderHold time.Duration `json:"holder_hold"`
	// Timeout bounds each waiter's Lock.
	Timeout time.Duration `json:"timeout"`
}

// workerMessage is one line a worker writes.
type workerMessage struct {
	Ready bool `json:"ready,omitempty"`
	Held  bool `json:"held,omitempty"`
	// Acquired reports progress: how many waiters have acquired so far.
	Acquired int64         `json:"acquired,omitempty"`
	Done     *workerResult `json:"done,omitempty"`
	Err      string        `json:"err,omitempty"`
}

// workerResult is what a worker saw.
type workerResult struct {
	// Holder is the first hold, when this worker had the holder.
	Holder *interval `json:"holder,omitempty"`
	// Holds has one entry per waiter that acquired.
	Holds []interval `json:"holds"`
	// Stopped counts the waiters that gave up because the parent said "stop".
	Stopped    int    `json:"stopped"`
	Errors     int    `json:"errors"`
	FirstError string `json:"first_error,omitempty"`
	// Shared is the contender's sharedSent at the end.
	Shared int64 `json:"shared,omitempty"`
}

// workerMain runs one worker over in and out and returns the exit status.
func workerMain(in io.Reader, out io.Writer) int {
	enc := &lockedEncoder{enc: json.NewEncoder(out)}
	if err := runWorker(bufio.NewScanner(in), enc); err != nil {
		_ = enc.Encode(workerMessage{Err: err.Error()})
		fmt.Fprintln(os.Stderr, "bench worker:", err)
		return 1
	}
	return 0
}

// runWorker follows the protocol described at the top of the file.
func runWorker(in *bufio.Scanner, enc *lockedEncoder) error {
	var cfg workerConfig
	if !in.Scan() {
		return fmt.Errorf("no configuration on stdin: %v", in.Err())
	}
	if err := json.Unmarshal(in.Bytes(), &cfg); err != nil {
		return fmt.Errorf("bad configuration: %w", err)
	}
	kind, ok := kindByName(cfg.Contender)
	if !ok {
		return fmt.Errorf("unknown contender %q", cfg.Contender)
	}
	c, err := kind.open(cfg.Addr)
	if err != nil {
		return fmt.Errorf("%s: open: %w", kind.name, err)
	}
	defer c.Close()
	lockers := make([]Locker, cfg.Waiters)
	for i := range lockers {
		lockers[i] = c.NewLocker(cfg.Lock)
	}
	if err := enc.Encode(workerMessage{Ready: true}); err != nil {
		return err
	}

	var res workerResult
	var holderDone chan error
	// release is closed on "release", or when the parent stops talking.
	release := make(chan struct{})
	var releaseOnce sync.Once
	letGo := func() { releaseOnce.Do(func() { close(release) }) }
	if cfg.HolderHold > 0 {
		if err := expectLine(in, "hold"); err != nil {
			return err
		}
		// The hold's context must outlive the hold: rueidislock ends a hold when
		// the context given to Lock ends.
		hctx, hcancel := context.WithTimeout(context.Background(), cfg.Timeout)
		defer hcancel()
		holder := c.NewLocker(cfg.Lock)
		if err := holder.Lock(hctx); err != nil {
			return fmt.Errorf("holder: %w", err)
		}
		res.Holder = &interval{Acquired: time.Now().UnixNano()}
		holderDone = make(chan error, 1)
		go func() {
			<-release
			res.Holder.Released = time.Now().UnixNano()
			ctx, cancel := context.WithTimeout(context.Background(), unlockTimeout)
			defer cancel()
			holderDone <- holder.Unlock(ctx)
		}()
		if err := enc.Encode(workerMessage{Held: true}); err != nil {
			return err
		}
	}
	if err := expectLine(in, "go"); err != nil {
		return err
	}

	// After "go" the only lines the parent may send are "release" (to the holder's
	// worker), "abort" (every waiter still waiting gives up: the parent saw no
	// progress anywhere for too long; a closed stdin means the same) and "stop"
	// (the same at the drain cap, which is not an error: those waiters count as
	// stopped). The holder releases at the latest when the waiters give up.
	root, abort := context.WithCancelCause(context.Background())
	defer abort(nil)
	go func() {
		defer letGo()
		for in.Scan() {
			switch in.Text() {
			case "release":
				letGo()
			case "abort":
				abort(nil)
				return
			case "stop":
				abort(errStopped)
				return
			}
		}
		abort(nil)
	}()

	holds := make([]interval, len(lockers))
	got := make([]bool, len(lockers))
	var acquired, stopped atomic.Int64
	var errs errorLog
	var wg sync.WaitGroup
	for i, l := range lockers {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(root, cfg.Timeout)
			defer cancel() // after Unlock: see the holder above
			if err := l.Lock(ctx); err != nil {
				if errors.Is(context.Cause(root), errStopped) {
					stopped.Add(1)
				} else {
					errs.add(err)
				}
				return
			}
			holds[i].Acquired = time.Now().UnixNano()
			acquired.Add(1)
			time.Sleep(cfg.Hold)
			holds[i].Released = time.Now().UnixNano()
			got[i] = true
			uctx, ucancel := context.WithTimeout(context.Background(), unlockTimeout)
			defer ucancel()
			if err := l.Unlock(uctx); err != nil {
				errs.add(err)
			}
		})
	}
	stopProgress := reportProgress(enc, &acquired)
	wg.Wait()
	stopProgress()
	if holderDone != nil {
		if err := <-holderDone; err != nil {
			errs.add(fmt.Errorf("holder unlock: %w", err))
		}
	}
	for i, ok := range got {
		if ok {
			res.Holds = append(res.Holds, holds[i])
		}
	}
	res.Stopped = int(stopped.Load())
	res.Errors = int(errs.n.Load())
	res.FirstError = errs.first
	sctx, scancel := context.WithTimeout(context.Background(), unlockTimeout)
	defer scancel()
	if res.Shared, err = sharedSent(sctx, c); err != nil {
		return fmt.Errorf("counting requests: %w", err)
	}
	return enc.Encode(workerMessage{Done: &res})
}

// errStopped is the cause of the waiters' context after "stop".
var errStopped = errors.New("bench: drain cap reached")

// progressEvery is how often a worker reports its acquisitions so far.
const progressEvery = 200 * time.Millisecond

// reportProgress writes {"acquired":n} every progressEvery while n changes, until
// the returned function is called (which returns once the reporter has stopped).
func reportProgress(enc *lockedEncoder, acquired *atomic.Int64) func() {
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(progressEvery)
		defer t.Stop()
		var last int64
		for {
			select {
			case <-done:
				return
			case <-t.C:
				if n := acquired.Load(); n != last {
					last = n
					_ = enc.Encode(workerMessage{Acquired: n})
				}
			}
		}
	}()
	return func() { close(done); <-stopped }
}

// lockedEncoder is a JSON encoder that several goroutines may use.
type lockedEncoder struct {
	mu  sync.Mutex
	enc *json.Encoder
}

// Encode writes v as one line.
func (e *lockedEncoder) Encode(v any) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.enc.Encode(v)
}

// expectLine reads the next line and checks it is want.
func expectLine(in *bufio.Scanner, want string) error {
	if !in.Scan() {
		return fmt.Errorf("waiting for %q: stdin closed (%v)", want, in.Err())
	}
	if got := in.Text(); got != want {
		return fmt.Errorf("waiting for %q, got %q", want, got)
	}
	return nil
}

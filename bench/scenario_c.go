package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"time"
)

// Scenario C, many waiters: N goroutines queue behind a holder that keeps the lock
// for a while, then each takes the lock once, holding it ~1 ms. They live in one
// process, or spread evenly over several worker processes (see worker.go). The
// drain starts when the first holder starts its release and ends when the last
// waiter starts its release, so it covers exactly N handoffs:
//
//	drain = sum of the N waiters' hold times + sum of the N idle gaps
//
// A handoff can at best cost one round trip on top of the hold, so the physical
// limit is N / (N * (mean hold + RTT)) handoffs per second.
//
// With Profile.CDrainCap set (the default profile), a cell also ends at the cap:
// the waiters still waiting stop, and the figures cover the handoffs made until
// then (N becomes the number that acquired). Only the polling peers, which drain
// at 50-150 handoffs/s, reach it; their figures are then over the first part of
// the drain, when more waiters poll than on average over a whole one.

// CRun is one cell of scenario C: one contender, one process count, one repetition.
type CRun struct {
	Contender string `json:"contender"`
	Procs     int    `json:"processes"`
	Rep       int    `json:"rep"`
	Waiters   int    `json:"waiters"`
	// Acquired counts the waiters that got the lock (should be Waiters).
	Acquired int `json:"acquired"`
	// DrainSeconds runs from the holder's release to the last waiter's release.
	DrainSeconds float64 `json:"drain_seconds"`
	// SumHoldSeconds adds up the waiters' hold times.
	SumHoldSeconds float64 `json:"sum_hold_seconds"`
	MeanHoldMs     float64 `json:"mean_hold_ms"`
	HandoffsPerSec float64 `json:"handoffs_per_sec"`
	IdleGapMs      float64 `json:"idle_gap_per_handoff_ms"`
	LimitPerSec    float64 `json:"physical_limit_per_sec"`
	PercentOfLimit float64 `json:"percent_of_limit"`
	ReqPerHandoff  float64 `json:"requests_per_handoff"`
	CmdsPerHandoff float64 `json:"server_commands_per_handoff"`
	Violations     int     `json:"violations"`
	// Aborted: no waiter anywhere acquired for cStall, so the waiters still
	// waiting were told to give up (they count as errors).
	Aborted bool `json:"aborted"`
	// Capped: the drain reached Profile.CDrainCap, so the waiters still waiting
	// were told to stop (they count as Stopped, not as errors).
	Capped     bool   `json:"capped"`
	Stopped    int    `json:"stopped"`
	Errors     int    `json:"errors"`
	FirstError string `json:"first_error,omitempty"`
	// Redis is the whole cell's Redis work: the waiters' queueing and the drain.
	Redis RedisWork `json:"redis"`
	// Queueing is the part of Redis done before the harness told the holder to
	// release: the holder's own acquire, and the waiters' first attempts, joins,
	// subscriptions and (for polling contenders) polls. The little done between
	// that read and the holder's Unlock reaching Redis counts as the drain's.
	Queueing RedisWork `json:"redis_queueing"`
}

// worker is one running worker process.
type worker struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Scanner
}

// startWorker starts a worker process and sends it cfg.
func (r *runner) startWorker(cfg workerConfig) (*worker, error) {
	cmd := exec.Command(r.exe)
	cmd.Env = append(os.Environ(), workerEnv+"=1")
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	w := &worker{cmd: cmd, in: in, out: bufio.NewScanner(out)}
	w.out.Buffer(make([]byte, 64<<10), 64<<20)
	b, _ := json.Marshal(cfg)
	if err := w.send(string(b)); err != nil {
		w.stop()
		return nil, err
	}
	return w, nil
}

// send writes one line to the worker.
func (w *worker) send(line string) error {
	_, err := io.WriteString(w.in, line+"\n")
	return err
}

// recv reads the worker's next message.
func (w *worker) recv() (workerMessage, error) {
	for w.out.Scan() {
		line := w.out.Bytes()
		if len(line) == 0 || line[0] != '{' {
			continue // not ours: a library writing to stdout
		}
		var m workerMessage
		if err := json.Unmarshal(line, &m); err != nil {
			return m, fmt.Errorf("worker: bad line %q: %w", line, err)
		}
		if m.Err != "" {
			return m, fmt.Errorf("worker: %s", m.Err)
		}
		return m, nil
	}
	return workerMessage{}, fmt.Errorf("worker exited early (%v)", w.out.Err())
}

// stop closes the worker's stdin and reaps it, killing it if it does not exit
// within a few seconds.
func (w *worker) stop() {
	w.in.Close()
	done := make(chan struct{})
	go func() { w.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		w.cmd.Process.Kill()
		<-done
	}
}

// workerEvent is one message (or the end of the stream) from worker i.
type workerEvent struct {
	i   int
	m   workerMessage
	err error
}

// pump forwards every message of every worker to one channel until a worker's
// stream ends or quit is closed.
func pump(ws []*worker, quit <-chan struct{}) <-chan workerEvent {
	ch := make(chan workerEvent)
	for i, w := range ws {
		go func() {
			for {
				m, err := w.recv()
				select {
				case ch <- workerEvent{i, m, err}:
				case <-quit:
					return
				}
				if err != nil || m.Done != nil {
					return
				}
			}
		}()
	}
	return ch
}

// await reads events until want has held for every worker in set (or any worker
// failed), within d.
func await(ctx context.Context, events <-chan workerEvent, set []int, d time.Duration, want func(workerMessage) bool) error {
	left := map[int]bool{}
	for _, i := range set {
		left[i] = true
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	for len(left) > 0 {
		select {
		case e := <-events:
			if e.err != nil {
				return fmt.Errorf("worker %d: %w", e.i, e.err)
			}
			if want(e.m) {
				delete(left, e.i)
			}
		case <-timer.C:
			return fmt.Errorf("%d workers did not answer within %v", len(left), d)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// cStall is how long scenario C waits with no acquisition anywhere before it
// tells the workers to give up: a waiter that is never woken would otherwise keep
// the cell running until its Lock timed out.
const cStall = 2 * time.Second

// runC runs one cell of scenario C with procs worker processes.
func (r *runner) runC(ctx context.Context, kind contenderKind, procs, rep int) (CRun, error) {
	p := r.prof
	name := fmt.Sprintf("bench:C:%s:p%d:r%d", kind.name, procs, rep)
	var ws []*worker
	quit := make(chan struct{})
	defer func() {
		close(quit)
		for _, w := range ws {
			w.stop()
		}
	}()
	all := make([]int, procs)
	for i := range procs {
		all[i] = i
		n := p.CWaiters / procs
		if i < p.CWaiters%procs {
			n++
		}
		cfg := workerConfig{Contender: kind.name, Addr: r.addr, Lock: name, Waiters: n, Hold: p.CHold, Timeout: p.CTimeout}
		if i == 0 {
			cfg.HolderHold = p.CHolderHold
		}
		w, err := r.startWorker(cfg)
		if err != nil {
			return CRun{}, err
		}
		ws = append(ws, w)
	}
	events := pump(ws, quit)
	if err := await(ctx, events, all, time.Minute, func(m workerMessage) bool { return m.Ready }); err != nil {
		return CRun{}, err
	}
	if err := r.stats.reset(ctx); err != nil {
		return CRun{}, err
	}
	if err := ws[0].send("hold"); err != nil {
		return CRun{}, err
	}
	if err := await(ctx, events, all[:1], p.CTimeout, func(m workerMessage) bool { return m.Held }); err != nil {
		return CRun{}, err
	}
	for _, w := range ws {
		if err := w.send("go"); err != nil {
			return CRun{}, err
		}
	}
	// The waiters queue while the holder holds; the counters read just before
	// its release split the queueing's Redis work from the drain's.
	select {
	case <-time.After(p.CHolderHold):
	case <-ctx.Done():
		return CRun{}, ctx.Err()
	}
	queued, err := r.stats.work(ctx, kind.scriptOnly)
	if err != nil {
		return CRun{}, err
	}
	if err := ws[0].send("release"); err != nil {
		return CRun{}, err
	}
	d, err := r.drainC(ctx, ws, events)
	if err != nil {
		return CRun{}, err
	}
	work, err := r.stats.work(ctx, kind.scriptOnly)
	if err != nil {
		return CRun{}, err
	}
	run := summarizeC(kind.name, procs, rep, p.CWaiters, d.msgs, work, r.rtt)
	run.Queueing = queued
	// A cap that came when nobody was left waiting cut nothing.
	run.Aborted, run.Capped = d.aborted, d.capped && run.Stopped > 0
	return run, nil
}

// drained is how a C cell's drain ended.
type drained struct {
	// msgs are the workers' final reports.
	msgs []workerMessage
	// aborted: nothing moved for cStall; capped: the drain cap was reached.
	aborted, capped bool
}

// drainC collects every worker's final report, telling them all to give up if no
// waiter anywhere has acquired for cStall, and to stop at the drain cap.
func (r *runner) drainC(ctx context.Context, ws []*worker, events <-chan workerEvent) (drained, error) {
	d := drained{msgs: make([]workerMessage, len(ws))}
	done := 0
	tell := func(line string) {
		for _, w := range ws {
			_ = w.send(line)
		}
	}
	lastMove := time.Now()
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	hard := time.NewTimer(r.prof.CTimeout + 30*time.Second)
	defer hard.Stop()
	// The holder was just told to release: the drain starts now.
	var capC <-chan time.Time
	if r.prof.CDrainCap > 0 {
		capTimer := time.NewTimer(r.prof.CDrainCap)
		defer capTimer.Stop()
		capC = capTimer.C
	}
	for done < len(ws) {
		select {
		case e := <-events:
			switch {
			case e.err != nil:
				return d, fmt.Errorf("worker %d: %w", e.i, e.err)
			case e.m.Done != nil:
				d.msgs[e.i] = e.m
				done++
			case e.m.Acquired > 0:
				lastMove = time.Now()
			}
		case <-tick.C:
			if !d.aborted && !d.capped && time.Since(lastMove) > cStall {
				d.aborted = true
				tell("abort")
			}
		case <-capC:
			if !d.aborted {
				d.capped = true
				tell("stop")
			}
		case <-hard.C:
			return d, fmt.Errorf("workers did not finish")
		case <-ctx.Done():
			return d, ctx.Err()
		}
	}
	return d, nil
}

// summarizeC turns the workers' reports into a CRun.
func summarizeC(contender string, procs, rep, waiters int, msgs []workerMessage, work RedisWork, rtt time.Duration) CRun {
	run := CRun{Contender: contender, Procs: procs, Rep: rep, Waiters: waiters, Redis: work}
	var holder *interval
	var all []interval
	var lastRelease int64
	for _, m := range msgs {
		d := m.Done
		if d.Holder != nil {
			holder = d.Holder
			all = append(all, *d.Holder)
		}
		for _, h := range d.Holds {
			run.SumHoldSeconds += time.Duration(h.Released - h.Acquired).Seconds()
			lastRelease = max(lastRelease, h.Released)
		}
		all = append(all, d.Holds...)
		// A worker's plain commands its scripts also run (sharedCounter), counted
		// with the drain: its waiters' first attempts, in the queueing, find
		// the lock held, and send none.
		run.Redis.addShared(d.Shared)
		run.Acquired += len(d.Holds)
		run.Stopped += d.Stopped
		run.Errors += d.Errors
		if run.FirstError == "" {
			run.FirstError = d.FirstError
		}
	}
	run.Violations = overlaps(all)
	if holder == nil || run.Acquired == 0 {
		return run
	}
	drain := time.Duration(lastRelease - holder.Released)
	n := float64(run.Acquired)
	run.DrainSeconds = drain.Seconds()
	run.MeanHoldMs = run.SumHoldSeconds / n * 1e3
	run.HandoffsPerSec = n / drain.Seconds()
	run.IdleGapMs = (run.DrainSeconds - run.SumHoldSeconds) / n * 1e3
	run.LimitPerSec = 1 / (run.SumHoldSeconds/n + rtt.Seconds())
	run.PercentOfLimit = 100 * run.HandoffsPerSec / run.LimitPerSec
	run.ReqPerHandoff = float64(work.Requests) / n
	run.CmdsPerHandoff = float64(work.Commands) / n
	return run
}

package engine

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// The direct lane (tryDirect): a Lock or an Unlock runs its request, its script
// call and the reply's step on its own goroutine when the engine is idle.

// loneManual is a manualRunner with a lone lane, recording for every call whether
// it came through RunLone and the stack of the goroutine that made it.
type loneManual struct {
	*manualRunner
	mu    sync.Mutex
	calls []madeCall
}

type madeCall struct {
	lone  bool
	stack string
}

var _ scripts.LoneRunner = (*loneManual)(nil)

func (r *loneManual) record(lone bool) {
	buf := make([]byte, 16<<10)
	buf = buf[:runtime.Stack(buf, false)]
	r.mu.Lock()
	r.calls = append(r.calls, madeCall{lone: lone, stack: string(buf)})
	r.mu.Unlock()
}

func (r *loneManual) Run(ctx context.Context, id scripts.ID, keys, args []string) (scripts.Reply, error) {
	r.record(false)
	return r.manualRunner.Run(ctx, id, keys, args)
}

func (r *loneManual) RunLone(ctx context.Context, id scripts.ID, keys, args []string) (scripts.Reply, error) {
	r.record(true)
	return r.manualRunner.Run(ctx, id, keys, args)
}

// made returns the i-th call made.
func (r *loneManual) made(t *testing.T, i int) madeCall {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	if i >= len(r.calls) {
		t.Fatalf("%d calls made, want call %d", len(r.calls), i)
	}
	return r.calls[i]
}

func newLoneEngine(t *testing.T) (*eh, *loneManual) {
	r := &loneManual{manualRunner: newManualRunner()}
	h := newEngine(t, r, shortClose, func(c *Config) { c.AbortIO = r.abort })
	return h, r
}

// onCallersGoroutine reports whether the call was made, on the lone lane, by the
// goroutine that called the engine's method fn ("AcquireWait", "Unlock").
func (c madeCall) onCallersGoroutine(fn string) bool {
	return c.lone && strings.Contains(c.stack, "(*Engine)."+fn+"(")
}

// quiesce waits until the engine has nothing queued or in flight, so that the
// next call finds the loop idle (the direct lane is taken only then).
func (h *eh) quiesce(t *testing.T) {
	t.Helper()
	e := h.e
	eventually(t, "an idle engine", func() bool {
		e.mu.Lock()
		defer e.mu.Unlock()
		e.mail.mu.Lock()
		mail := len(e.mail.items) + len(e.mail.signal)
		e.mail.mu.Unlock()
		return e.inflight == 0 && mail == 0 && len(e.inbox) == 0
	})
}

// cycle locks and unlocks L once as owner 1 and returns the two calls it made.
func (r *loneManual) cycle(t *testing.T, h *eh, lockCtx, unlockCtx context.Context) (attempt, release madeCall) {
	t.Helper()
	done := make(chan error, 1)
	h.quiesce(t)
	r.mu.Lock()
	n := len(r.calls)
	r.mu.Unlock()
	go func() { done <- h.e.AcquireWait(lockCtx, AcquireRequest{Lock: "L", Owner: 1, Wait: -1}) }()
	r.expect(t, scripts.LockAcquire).answer(replyNil, nil)
	if err := recv(t, "lock", done); err != nil {
		t.Fatalf("lock: %v", err)
	}
	h.quiesce(t)
	go func() { done <- h.e.Unlock(unlockCtx, "L", 1) }()
	r.expect(t, scripts.LockRelease).answer(replyInt(1), nil)
	if err := recv(t, "unlock", done); err != nil {
		t.Fatalf("unlock: %v", err)
	}
	return r.made(t, n), r.made(t, n+1)
}

// The lane is taken only when the engine is idle, which the test cannot hold still
// (a stale wake-up of the loop takes the engine's mutex for a moment): each check
// allows a few cycles to see the lane taken, and none to see it wrongly taken.
func TestEngineDirectLaneRunsCallsOnTheCaller(t *testing.T) {
	h, r := newLoneEngine(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, c := range []struct {
		what string
		ctx  context.Context
	}{
		{"with context.Background()", context.Background()},
		// The calls are still the callers' to run: each waits for its call in
		// flight anyway.
		{"under a cancellable context", ctx},
	} {
		const tries = 20
		var lockDirect, unlockDirect bool
		for i := 0; i < tries && !(lockDirect && unlockDirect); i++ {
			a, rel := r.cycle(t, h, c.ctx, c.ctx)
			lockDirect = lockDirect || a.onCallersGoroutine("AcquireWait")
			unlockDirect = unlockDirect || rel.onCallersGoroutine("Unlock")
		}
		if !lockDirect || !unlockDirect {
			t.Fatalf("%s, in %d cycles: an attempt on the caller's goroutine %v, a release %v; want both", c.what, tries, lockDirect, unlockDirect)
		}
	}
}

// An Unlock whose context ends while it runs its own release waits for the
// release and returns its answer; one whose context had ended before it started
// returns at once, and its release still goes ahead.
func TestEngineDirectLaneUnlockContextEnds(t *testing.T) {
	h, r := newLoneEngine(t)
	done := make(chan error, 1)
	lock := func() {
		go func() { done <- h.e.AcquireWait(context.Background(), AcquireRequest{Lock: "L", Owner: 1, Wait: -1}) }()
		r.expect(t, scripts.LockAcquire).answer(replyNil, nil)
		if err := recv(t, "lock", done); err != nil {
			t.Fatalf("lock: %v", err)
		}
	}

	// The lane is taken only when the engine is idle (see the test above): try a
	// few times.
	direct := false
	for try := 0; !direct; try++ {
		if try == 20 {
			t.Fatal("no Unlock ran its own release in 20 tries")
		}
		lock()
		h.quiesce(t)
		ctx, cancel := context.WithCancel(context.Background())
		r.mu.Lock()
		n := len(r.calls)
		r.mu.Unlock()
		go func() { done <- h.e.Unlock(ctx, "L", 1) }()
		c := r.expect(t, scripts.LockRelease)
		direct = r.made(t, n).onCallersGoroutine("Unlock")
		cancel()
		if direct {
			select {
			case err := <-done:
				t.Fatalf("Unlock returned %v with its own release still in flight", err)
			case <-time.After(50 * time.Millisecond): // the wait is the check: it must not return
			}
		}
		c.answer(replyInt(1), nil)
		err := recv(t, "unlock", done)
		switch {
		case direct && err != nil:
			t.Fatalf("Unlock whose context ended during its own release: %v, want the release's nil", err)
		case !direct && err != nil && !errors.Is(err, context.Canceled):
			t.Fatalf("Unlock through the loop: %v", err)
		}
	}

	lock()
	dead, kill := context.WithCancel(context.Background())
	kill()
	go func() { done <- h.e.Unlock(dead, "L", 1) }()
	if err := recv(t, "unlock with a dead context", done); !errors.Is(err, context.Canceled) {
		t.Fatalf("Unlock with a dead context: %v, want context.Canceled at once", err)
	}
	r.expect(t, scripts.LockRelease).answer(replyInt(1), nil) // it still goes ahead
	eventually(t, "the hold released", func() bool { return h.stats().Holds == 0 })
}

// A caller stuck in its own call when Close comes (a server that stopped
// answering) is freed by Close's AbortIO, answered ErrClosed, and Close returns.
func TestEngineDirectLaneCallInFlightAtClose(t *testing.T) {
	h, r := newLoneEngine(t)
	done := make(chan error, 1)
	h.quiesce(t)
	go func() {
		done <- h.e.AcquireWait(context.Background(), AcquireRequest{Lock: "L", Owner: 1, Wait: -1})
	}()
	r.expect(t, scripts.LockAcquire) // never answered
	if c := r.made(t, 0); !c.onCallersGoroutine("AcquireWait") {
		t.Fatalf("the attempt ran elsewhere (lone %v):\n%s", c.lone, c.stack)
	}
	closed := make(chan struct{})
	go func() {
		h.e.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(5 * time.Second): // CloseTimeout is 100 ms
		// t.Fatal would leave the test's cleanup waiting on the same Close forever.
		panic("Close did not return within 5s")
	}
	if err := recv(t, "lock", done); !errors.Is(err, ErrClosed) {
		t.Fatalf("lock in flight at Close: %v, want ErrClosed", err)
	}
}

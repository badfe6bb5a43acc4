package lockapi_test

import (
	"context"
	"errors"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// fairQueueHas reports whether field is in the Redis queue list or deadline set.
func fairQueueHas(t *testing.T, srv *testredis.Server, name, field string) (inList, inSet bool) {
	t.Helper()
	_, inSet = fairScore(t, srv, fairTimeoutKey(name), field)
	return slices.Contains(fairList(t, srv, fairQueueKey(name)), field), inSet
}

// fairWaitGone waits until field has left both the queue list and the deadline
// set, and returns how long that took and whether it was already gone at the first
// look.
func fairWaitGone(t *testing.T, srv *testredis.Server, name, field string, timeout time.Duration) (time.Duration, bool) {
	t.Helper()
	start := time.Now()
	first := true
	atOnce := false
	fairWaitFor(t, timeout, field+" to leave the queue", func() bool {
		inList, inSet := fairQueueHas(t, srv, name, field)
		gone := !inList && !inSet
		if first {
			atOnce, first = gone, false
		}
		return gone
	})
	return time.Since(start), atOnce
}

// TestFairCancelledWaiterLeavesQueue: of three queued waiters A, B, C, B's context
// is cancelled. B leaves the Redis queue (list and deadline set) at once, C's
// deadline drops by one wait allowance (its wait is not stretched by B's place),
// A's is unchanged, and the queue then serves A and C.
func TestFairCancelledWaiterLeavesQueue(t *testing.T) {
	const allowance = 20 * time.Second
	srv := testredis.New(t)
	name := fairName(t, "")
	deadlines := fairTimeoutKey(name)
	ch := newClient(t, srv, lockapi.Options{FairWaitTimeout: allowance})
	cw := newClient(t, srv, lockapi.Options{FairWaitTimeout: allowance})

	holder := ch.FairMutex(name)
	if err := holder.Lock(fairCtx(t, 5*time.Second)); err != nil {
		t.Fatalf("holder Lock: %v", err)
	}
	a, b, c := cw.FairMutex(name), cw.FairMutex(name), cw.FairMutex(name)
	gotA, fieldA := fairEnqueue(t, srv, a, fairCtx(t, 30*time.Second), 1)
	ctxB, cancelB := context.WithCancel(context.Background())
	defer cancelB()
	gotB, fieldB := fairEnqueue(t, srv, b, ctxB, 2)
	gotC, fieldC := fairEnqueue(t, srv, c, fairCtx(t, 30*time.Second), 3)

	beforeA, _ := fairScore(t, srv, deadlines, fieldA)
	beforeB, _ := fairScore(t, srv, deadlines, fieldB)
	beforeC, _ := fairScore(t, srv, deadlines, fieldC)
	if d := beforeC - beforeB; d != allowance.Milliseconds() {
		t.Errorf("C's deadline is %d ms after B's, want one allowance (%v)", d, allowance)
	}

	cancelB()
	err, ok := fairRecv(gotB, 2*time.Second)
	if !ok || err != context.Canceled {
		t.Fatalf("B's Lock after cancel: %v (returned %v), want context.Canceled", err, ok)
	}
	took, atOnce := fairWaitGone(t, srv, name, fieldB, time.Second)
	if q := fairList(t, srv, fairQueueKey(name)); !slices.Equal(q, []string{fieldA, fieldC}) {
		t.Errorf("queue after B left = %q, want [A C]", q)
	}
	afterA, _ := fairScore(t, srv, deadlines, fieldA)
	afterC, _ := fairScore(t, srv, deadlines, fieldC)
	if afterA != beforeA {
		t.Errorf("A's deadline changed from %d to %d when B (behind it) left", beforeA, afterA)
	}
	if drop := beforeC - afterC; drop < allowance.Milliseconds()-50 || drop > allowance.Milliseconds()+50 {
		t.Errorf("C's deadline dropped by %d ms when B left, want about the allowance (%v)", drop, allowance)
	}
	t.Logf("B left the queue %v after its Lock returned (gone at the first look: %v); C's deadline dropped %d ms",
		took, atOnce, beforeC-afterC)

	// The queue still works: A, then C.
	unlock(t, holder)
	fairMustGet(t, "A after the holder's Unlock", gotA)
	if still, err := fairStillWaiting(gotC, 50*time.Millisecond); !still {
		t.Fatalf("C got %v while A holds the lock", err)
	}
	unlock(t, a)
	fairMustGet(t, "C after A's Unlock", gotC)
	unlock(t, c)
	fairMustBeClean(t, srv, name)
}

// TestFairTryLockTimeoutLeavesQueue: a TryLock whose wait runs out while it is
// queued returns false and leaves the Redis queue right away: its field is gone
// from the list and the deadline set, and the waiter behind it moves up by one
// allowance.
func TestFairTryLockTimeoutLeavesQueue(t *testing.T) {
	const allowance = 20 * time.Second
	srv := testredis.New(t)
	name := fairName(t, "")
	deadlines := fairTimeoutKey(name)
	ch := newClient(t, srv, lockapi.Options{FairWaitTimeout: allowance})
	cw := newClient(t, srv, lockapi.Options{FairWaitTimeout: allowance})

	holder := ch.FairMutex(name)
	if err := holder.Lock(fairCtx(t, 5*time.Second)); err != nil {
		t.Fatalf("holder Lock: %v", err)
	}
	d, e := cw.FairMutex(name), cw.FairMutex(name)
	type tryResult struct {
		ok  bool
		err error
		at  time.Time
	}
	tried := make(chan tryResult, 1)
	go func() {
		ok, err := d.TryLock(context.Background(), time.Second, 0)
		tried <- tryResult{ok, err, time.Now()}
	}()
	fairWaitLen(t, srv, fairQueueKey(name), 1, 5*time.Second)
	fieldD := fairList(t, srv, fairQueueKey(name))[0]
	gotE, fieldE := fairEnqueue(t, srv, e, fairCtx(t, 30*time.Second), 2)
	beforeE, _ := fairScore(t, srv, deadlines, fieldE)

	var r tryResult
	select {
	case r = <-tried:
	case <-time.After(5 * time.Second):
		t.Fatal("TryLock(1s) has not returned after 5s")
	}
	if r.ok || r.err != nil {
		t.Fatalf("TryLock while held = %v, %v; want false, nil", r.ok, r.err)
	}
	took, atOnce := fairWaitGone(t, srv, name, fieldD, time.Second)
	afterE, _ := fairScore(t, srv, deadlines, fieldE)
	if drop := beforeE - afterE; drop < allowance.Milliseconds()-50 || drop > allowance.Milliseconds()+50 {
		t.Errorf("the next waiter's deadline dropped by %d ms when the TryLock left, want about the allowance (%v)", drop, allowance)
	}
	if q := fairList(t, srv, fairQueueKey(name)); !slices.Equal(q, []string{fieldE}) {
		t.Errorf("queue after the TryLock = %q, want only the next waiter", q)
	}
	t.Logf("the TryLock's field left %v after it returned false (gone at the first look: %v)", took, atOnce)

	unlock(t, holder)
	fairMustGet(t, "next waiter after the holder's Unlock", gotE)
	unlock(t, e)
	fairMustBeClean(t, srv, name)
}

// TestFairKilledWaiterSkipped: a helper process queues a waiter and is SIGKILLed
// while waiting; the parent's waiter, queued behind it, gets the lock once the dead
// waiter's deadline passes (about one allowance), not never.
//
// Both clients use a 1 s allowance, and the holder a 1 s watchdog lease: the first
// waiter's deadline is the holder's remaining lease plus the allowance (Redisson's
// layout), so the holder's lease bounds it too.
func TestFairKilledWaiterSkipped(t *testing.T) {
	const allowance = time.Second
	srv := testredis.New(t)
	name := fairName(t, "")
	ready := name + ":ready"
	c := newClient(t, srv, lockapi.Options{FairWaitTimeout: allowance, WatchdogTimeout: time.Second})

	holder := c.FairMutex(name)
	if err := holder.Lock(fairCtx(t, 5*time.Second)); err != nil {
		t.Fatalf("holder Lock: %v", err)
	}
	p := startFairHelper(t, "dead", envFairAddr+"="+srv.Addr(), envFairLock+"="+name,
		envFairReady+"="+ready, envFairWait+"="+allowance.String())
	fairWaitFor(t, 30*time.Second, "the helper's waiter to queue", func() bool { return do(t, srv, "GET", ready) == "1" })
	q := fairList(t, srv, fairQueueKey(name))
	if len(q) != 1 {
		t.Fatalf("queue with the helper's waiter = %q", q)
	}
	deadDeadline, _ := fairScore(t, srv, fairTimeoutKey(name), q[0])

	waiter := c.FairMutex(name)
	got, _ := fairEnqueue(t, srv, waiter, fairCtx(t, 30*time.Second), 2)

	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatalf("kill helper: %v", err)
	}
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		t.Fatal("the killed helper has not exited")
	}
	released := time.Now()
	unlock(t, holder)
	err, ok := fairRecv(got, 6*time.Second)
	if !ok {
		t.Fatalf("the waiter behind the killed one has not got the lock 6s after the release; queue %q, deadlines %q",
			fairList(t, srv, fairQueueKey(name)), do(t, srv, "ZRANGE", fairTimeoutKey(name), "0", "-1", "WITHSCORES"))
	}
	if err != nil {
		t.Fatalf("waiter Lock: %v", err)
	}
	acquired := time.Now()
	if early := deadDeadline - acquired.UnixMilli(); early > 5 {
		t.Errorf("the waiter got the lock %d ms before the dead waiter's deadline: skipped a waiter still in its time", early)
	}
	t.Logf("got the lock %v after the release, %d ms after the dead waiter's deadline",
		acquired.Sub(released).Round(time.Millisecond), acquired.UnixMilli()-deadDeadline)
	if q := fairList(t, srv, fairQueueKey(name)); len(q) != 0 {
		t.Errorf("queue after the grant = %q, want empty", q)
	}
	unlock(t, waiter)
	fairMustBeClean(t, srv, name)
}

// TestFairAskAgainAfterTryLockStaysQueued: a handle whose TryLock ran out while it
// was queued asks again at once (Acquire on the same handle, as a retry loop
// does). Its new request must end up in the Redis queue and stay there: the
// departure of the first request must not remove the second one, which has the
// same owner field. Repeated, as the two are a few microseconds apart.
func TestFairAskAgainAfterTryLockStaysQueued(t *testing.T) {
	const rounds = 100
	srv := testredis.New(t)
	name := fairName(t, "")
	queue := fairQueueKey(name)
	ch := newClient(t, srv, lockapi.Options{})
	cw := newClient(t, srv, lockapi.Options{})

	holder := ch.FairMutex(name)
	if err := holder.Lock(fairCtx(t, 5*time.Second)); err != nil {
		t.Fatalf("holder Lock: %v", err)
	}
	for round := range rounds {
		m := cw.FairMutex(name)
		if ok, err := m.TryLock(fairCtx(t, 5*time.Second), 5*time.Millisecond, 0); ok || err != nil {
			t.Fatalf("round %d: TryLock while held = %v, %v; want false, nil", round, ok, err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		got := m.Acquire(ctx)
		// The field in the queue and still there 5 ms later. What is seen first may
		// be the TryLock's entry, not yet taken out by its leave (on a loaded
		// machine the leave can take that long): the leave then empties the
		// queue, and the Acquire's join, which waits for the leave, fills it
		// again. So the wait goes on until the entry stays; an entry the leave
		// removed for good leaves the queue empty until the deadline.
		queued := false
		deadline := time.Now().Add(3 * time.Second) // a sanity bound: joining takes a round trip or two
		for !queued && time.Now().Before(deadline) {
			if fairLen(t, srv, queue) != 1 {
				continue
			}
			if still, err := fairStillWaiting(got, 5*time.Millisecond); !still {
				cancel()
				t.Fatalf("round %d: Acquire returned %v while the lock is held", round, err)
			}
			queued = fairLen(t, srv, queue) == 1
		}
		if !queued {
			t.Errorf("round %d: the handle asked again right after its TryLock ran out; its Acquire is pending, "+
				"but its field is not in the Redis queue (queue %q, deadlines %q): the first request's leave removed the second's entry",
				round, fairList(t, srv, queue), do(t, srv, "ZRANGE", fairTimeoutKey(name), "0", "-1", "WITHSCORES"))
			// What it costs: the holder's release notifies nobody; the waiter sleeps until
			// its own retry timer (up to the holder's lease at the time it queued).
			released := time.Now()
			unlock(t, holder)
			if err, ok := fairRecv(got, 3*time.Second); ok {
				t.Logf("after the holder's release the stranded waiter got %v in %v", err, time.Since(released))
				if err == nil {
					m.Unlock(fairCtx(t, 5*time.Second))
				}
				cancel()
				return
			}
			t.Errorf("the holder released the lock and the stranded waiter still has not got it 3s later "+
				"(nobody was notified: it waits for its retry timer, up to the %v lease)", lockapi.DefaultWatchdogTimeout)
			cancel()
			<-got // the channel's one value, which has not come yet
			return
		}
		cancel()
		if err := <-got; err != context.Canceled {
			t.Fatalf("round %d: Acquire after cancel = %v", round, err)
		}
		fairWaitLen(t, srv, queue, 0, 2*time.Second)
	}
	unlock(t, holder)
	fairMustBeClean(t, srv, name)
}

// TestFairCloseLeavesQueue: closing a client whose waiters are queued fails them
// with ErrClosed and takes them out of the Redis queue before Close returns, and
// the waiter behind them (another client) moves up and is served next.
func TestFairCloseLeavesQueue(t *testing.T) {
	srv := testredis.New(t)
	name := fairName(t, "")
	ch := newClient(t, srv, lockapi.Options{})
	cx := newClient(t, srv, lockapi.Options{})
	cw := newClient(t, srv, lockapi.Options{})

	holder := ch.FairMutex(name)
	if err := holder.Lock(fairCtx(t, 5*time.Second)); err != nil {
		t.Fatalf("holder Lock: %v", err)
	}
	gotX1, _ := fairEnqueue(t, srv, cx.FairMutex(name), fairCtx(t, 30*time.Second), 1)
	gotX2, _ := fairEnqueue(t, srv, cx.FairMutex(name), fairCtx(t, 30*time.Second), 2)
	w := cw.FairMutex(name)
	gotW, fieldW := fairEnqueue(t, srv, w, fairCtx(t, 30*time.Second), 3)

	if err := cx.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	for i, got := range []<-chan error{gotX1, gotX2} {
		if err, ok := fairRecv(got, 2*time.Second); !ok || !errors.Is(err, lockapi.ErrClosed) {
			t.Errorf("waiter %d of the closed client: %v (returned %v), want ErrClosed", i, err, ok)
		}
	}
	if q := fairList(t, srv, fairQueueKey(name)); !slices.Equal(q, []string{fieldW}) {
		t.Errorf("queue right after Close = %q, want only the other client's waiter", q)
	}
	unlock(t, holder)
	fairMustGet(t, "the remaining waiter", gotW)
	unlock(t, w)
	fairMustBeClean(t, srv, name)
}

package lockapi_test

import (
	"slices"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// Waiting behind a hold that lasts longer than the holder's lease at the time the
// waiters queued (a watchdog-renewed hold doing long work). Both tests hold the
// lock for a fixed time: there the wait itself is the test.

// TestFairHeadWaiterDoesNotPollDuringLongHold: while a watchdog-renewed holder
// keeps the lock, the queue's head retries at most about once per holder lease (in
// case the holder died), not in a tight loop.
func TestFairHeadWaiterDoesNotPollDuringLongHold(t *testing.T) {
	const (
		lease = 300 * time.Millisecond // the holder's watchdog lease, renewed every 100 ms
		hold  = 2 * time.Second
	)
	srv := testredis.New(t)
	name := fairName(t, "")
	ch := newClient(t, srv, lockapi.Options{WatchdogTimeout: lease})
	cw := newClient(t, srv, lockapi.Options{}) // default allowance, 5 min: nobody is purged here

	holder := ch.FairMutex(name)
	if err := holder.Lock(fairCtx(t, 5*time.Second)); err != nil {
		t.Fatalf("holder Lock: %v", err)
	}
	waiter := cw.FairMutex(name)
	got, _ := fairEnqueue(t, srv, waiter, fairCtx(t, 30*time.Second), 1)
	before, err := cw.Stats(fairCtx(t, 5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if still, err := fairStillWaiting(got, hold); !still {
		t.Fatalf("the waiter's Lock returned %v while the holder held the lock", err)
	}
	after, err := cw.Stats(fairCtx(t, 5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	attempts, calls := after.Attempts-before.Attempts, after.ScriptCalls-before.ScriptCalls
	t.Logf("during a %v hold (holder lease %v): the waiting client made %d attempts, %d script calls", hold, lease, attempts, calls)
	// One retry per holder lease would be ~7; allow plenty of slack.
	if limit := uint64(3 * hold / lease); attempts > limit {
		t.Errorf("the queued waiter made %d acquire attempts in %v while the lock stayed held (%.0f/s): "+
			"it polls Redis instead of waiting for its notice; want at most %d", attempts, hold, float64(attempts)/hold.Seconds(), limit)
	}

	unlock(t, holder)
	fairMustGet(t, "waiter after the release", got)
	unlock(t, waiter)
	fairMustBeClean(t, srv, name)
}

// TestFairLiveWaitersKeepTheirPlace: two live waiters A and B (in two clients)
// queue behind a holder that keeps the lock longer than its lease at queueing time
// plus the allowance. FairWaitTimeout is how long a waiter "whose process stopped
// refreshing" keeps its place (Options); these waiters are alive and retrying, so
// the queue must stay [A B] for the whole hold and serve A first.
func TestFairLiveWaitersKeepTheirPlace(t *testing.T) {
	const (
		allowance = 500 * time.Millisecond
		lease     = 300 * time.Millisecond
		hold      = 2 * time.Second // > lease + 2 allowances: the deadlines in the set all pass
	)
	srv := testredis.New(t)
	name := fairName(t, "")
	ch := newClient(t, srv, lockapi.Options{FairWaitTimeout: allowance, WatchdogTimeout: lease})
	ca := newClient(t, srv, lockapi.Options{FairWaitTimeout: allowance})
	cb := newClient(t, srv, lockapi.Options{FairWaitTimeout: allowance})

	holder := ch.FairMutex(name)
	if err := holder.Lock(fairCtx(t, 5*time.Second)); err != nil {
		t.Fatalf("holder Lock: %v", err)
	}
	a, b := ca.FairMutex(name), cb.FairMutex(name)
	gotA, fieldA := fairEnqueue(t, srv, a, fairCtx(t, 30*time.Second), 1)
	gotB, fieldB := fairEnqueue(t, srv, b, fairCtx(t, 30*time.Second), 2)
	want := []string{fieldA, fieldB}

	// Watch the queue for the whole hold.
	start := time.Now()
	var firstChange []string
	var changedAt time.Duration
	tick := time.NewTicker(5 * time.Millisecond)
	for time.Since(start) < hold {
		<-tick.C
		if q := fairList(t, srv, fairQueueKey(name)); firstChange == nil && !slices.Equal(q, want) {
			firstChange, changedAt = q, time.Since(start)
		}
	}
	tick.Stop()
	if firstChange != nil {
		label := map[string]string{fieldA: "A", fieldB: "B"}
		var named []string
		for _, f := range firstChange {
			named = append(named, label[f])
		}
		t.Errorf("the queue of two live waiters changed from [A B] to %q %v into a %v hold "+
			"(allowance %v, holder lease %v): a live waiter lost its place", named, changedAt.Round(time.Millisecond), hold, allowance, lease)
	}

	unlock(t, holder)
	var order []string
	for len(order) < 2 {
		select {
		case err := <-gotA:
			if err != nil {
				t.Fatalf("A: %v", err)
			}
			order = append(order, "A")
			unlock(t, a)
		case err := <-gotB:
			if err != nil {
				t.Fatalf("B: %v", err)
			}
			order = append(order, "B")
			unlock(t, b)
		case <-time.After(5 * time.Second):
			t.Fatalf("waiters stuck after the release; order so far %q", order)
		}
	}
	if !slices.Equal(order, []string{"A", "B"}) {
		t.Errorf("order of acquisition after the long hold = %q, want [A B]", order)
	}
	fairMustBeClean(t, srv, name)
}

// TestFairWaiterDoesNotPollBehindPersistentKey: a foreign client holds the fair
// lock's key without an expiry (PTTL -1). The leash waiter queued behind it waits
// for its notice, retrying now and then (the reentrant Mutex retries once a second
// here), not in a tight loop; when the foreign holder releases (with its notice)
// the waiter gets the lock.
func TestFairWaiterDoesNotPollBehindPersistentKey(t *testing.T) {
	const watch = time.Second
	srv := testredis.New(t)
	name := fairName(t, "")
	foreign := newFairForeign(t, srv, lockapi.DefaultFairWaitTimeout)
	do(t, srv, "HSET", name, foreign.owner, "1") // held, no expiry
	cw := newClient(t, srv, lockapi.Options{})

	waiter := cw.FairMutex(name)
	got, _ := fairEnqueue(t, srv, waiter, fairCtx(t, 30*time.Second), 1)
	before, err := cw.Stats(fairCtx(t, 5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if still, err := fairStillWaiting(got, watch); !still {
		t.Fatalf("the waiter's Lock returned %v while the foreign key is held", err)
	}
	after, err := cw.Stats(fairCtx(t, 5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	attempts := after.Attempts - before.Attempts
	t.Logf("behind a persistent foreign key for %v: %d attempts", watch, attempts)
	if attempts > 5 {
		t.Errorf("the queued waiter made %d acquire attempts in %v behind a key without expiry: it polls Redis; want at most 5",
			attempts, watch)
	}

	if r := foreign.release(t, name, 30*time.Second); r != "1" {
		t.Fatalf("foreign release = %q, want 1", r)
	}
	fairMustGet(t, "waiter after the foreign release", got)
	unlock(t, waiter)
	fairMustBeClean(t, srv, name)
}

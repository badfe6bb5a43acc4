package lockapi_test

import (
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// TestFairReentrancy: a FairMutex handle re-enters (HoldCount 2), each Unlock
// drops one hold, and an Unlock past zero is ErrNotHeld.
func TestFairReentrancy(t *testing.T) {
	srv := testredis.New(t)
	name := fairName(t, "")
	c := newClient(t, srv, lockapi.Options{})
	m := c.FairMutex(name)
	ctx := fairCtx(t, 10*time.Second)

	for i := range 2 {
		if err := m.Lock(ctx); err != nil {
			t.Fatalf("Lock #%d: %v", i+1, err)
		}
	}
	if n, err := m.HoldCount(ctx); err != nil || n != 2 {
		t.Fatalf("HoldCount after two Locks = %d, %v; want 2", n, err)
	}
	fields := strings.Split(do(t, srv, "HGETALL", name), "\n")
	if len(fields) != 2 || !strings.HasPrefix(fields[0], c.ID()+":") || fields[1] != "2" {
		t.Fatalf("lock hash = %q, want one field <client id>:<owner> = 2", fields)
	}
	if ttl, err := m.RemainTTL(ctx); err != nil || ttl <= 0 || ttl > lockapi.DefaultWatchdogTimeout {
		t.Errorf("RemainTTL = %v, %v", ttl, err)
	}
	if err := m.Unlock(ctx); err != nil {
		t.Fatalf("Unlock #1: %v", err)
	}
	if n, err := m.HoldCount(ctx); err != nil || n != 1 {
		t.Fatalf("HoldCount after one Unlock = %d, %v; want 1", n, err)
	}
	if locked, err := m.IsLocked(ctx); err != nil || !locked {
		t.Fatalf("IsLocked with one hold left = %v, %v", locked, err)
	}
	if err := m.Unlock(ctx); err != nil {
		t.Fatalf("Unlock #2: %v", err)
	}
	if locked, err := m.IsLocked(ctx); err != nil || locked {
		t.Fatalf("IsLocked after both Unlocks = %v, %v; want free", locked, err)
	}
	if n, err := m.HoldCount(ctx); err != nil || n != 0 {
		t.Fatalf("HoldCount when free = %d, %v", n, err)
	}
	if ttl, err := m.RemainTTL(ctx); err != nil || ttl != 0 {
		t.Errorf("RemainTTL when free = %v, %v; want 0", ttl, err)
	}
	if err := m.Unlock(ctx); !errors.Is(err, lockapi.ErrNotHeld) {
		t.Fatalf("third Unlock = %v, want ErrNotHeld", err)
	}
	fairMustBeClean(t, srv, name)
}

// TestFairSingleTryNeverQueues: TryLock(ctx, 0, 0) by another handle while the lock
// is held reports false and leaves no trace in the queue or the deadline set; on a
// free lock it takes it.
func TestFairSingleTryNeverQueues(t *testing.T) {
	srv := testredis.New(t)
	name := fairName(t, "")
	ch := newClient(t, srv, lockapi.Options{})
	co := newClient(t, srv, lockapi.Options{})
	ctx := fairCtx(t, 10*time.Second)

	holder := ch.FairMutex(name)
	if err := holder.Lock(ctx); err != nil {
		t.Fatalf("holder Lock: %v", err)
	}
	for _, other := range []*lockapi.Mutex{ch.FairMutex(name), co.FairMutex(name)} {
		ok, err := other.TryLock(ctx, 0, 0)
		if ok || err != nil {
			t.Fatalf("TryLock(0, 0) while held = %v, %v; want false, nil", ok, err)
		}
		if got := do(t, srv, "EXISTS", fairQueueKey(name), fairTimeoutKey(name)); got != "0" {
			t.Fatalf("a single try queued: queue %q, deadlines %q", fairList(t, srv, fairQueueKey(name)),
				do(t, srv, "ZRANGE", fairTimeoutKey(name), "0", "-1", "WITHSCORES"))
		}
	}
	if err := holder.Unlock(ctx); err != nil {
		t.Fatalf("holder Unlock: %v", err)
	}
	other := co.FairMutex(name)
	if ok, err := other.TryLock(ctx, 0, 0); !ok || err != nil {
		t.Fatalf("TryLock(0, 0) on a free lock = %v, %v; want true", ok, err)
	}
	if err := other.Unlock(ctx); err != nil {
		t.Fatalf("Unlock: %v", err)
	}
	fairMustBeClean(t, srv, name)
}

// TestFairLostOnLeaseExpiry: a hold with a fixed lease (WithLease) that is not
// unlocked ends by itself: Lost closes, the lock is free, Unlock is ErrNotHeld, and
// a queued waiter gets the lock.
func TestFairLostOnLeaseExpiry(t *testing.T) {
	const lease = 300 * time.Millisecond
	srv := testredis.New(t)
	name := fairName(t, "")
	ch := newClient(t, srv, lockapi.Options{})
	cw := newClient(t, srv, lockapi.Options{})

	m := ch.FairMutex(name)
	start := time.Now()
	if err := m.Lock(fairCtx(t, 5*time.Second), lockapi.WithLease(lease)); err != nil {
		t.Fatalf("Lock: %v", err)
	}
	lost := m.Lost()
	select {
	case <-lost:
		t.Fatal("Lost is closed right after the grant")
	default:
	}
	waiter := cw.FairMutex(name)
	got, _ := fairEnqueue(t, srv, waiter, fairCtx(t, 10*time.Second), 1)

	select {
	case <-lost:
	case <-time.After(3 * time.Second):
		t.Fatalf("Lost has not closed %v after a %v lease", time.Since(start), lease)
	}
	lostAfter := time.Since(start)
	if lostAfter < lease/2 {
		t.Errorf("Lost closed after %v, long before the %v lease could end", lostAfter, lease)
	}
	fairMustGet(t, "the queued waiter after the lease ran out", got)
	if err := m.Unlock(fairCtx(t, 5*time.Second)); !errors.Is(err, lockapi.ErrNotHeld) {
		t.Errorf("Unlock after the lease ran out = %v, want ErrNotHeld", err)
	}
	if n, _ := m.HoldCount(fairCtx(t, 5*time.Second)); n != 0 {
		t.Errorf("HoldCount of the expired handle = %d", n)
	}
	t.Logf("Lost closed %v after Lock began (lease %v)", lostAfter, lease)
	unlock(t, waiter)
	fairMustBeClean(t, srv, name)
}

// TestFairForceUnlockWakesHead: ForceUnlock deletes a held fair lock and wakes the
// queue's head at once (its own retry is a whole lease away); the holder in the
// same client sees Lost close and gets ErrNotHeld from Unlock.
func TestFairForceUnlockWakesHead(t *testing.T) {
	srv := testredis.New(t)
	name := fairName(t, "")
	ch := newClient(t, srv, lockapi.Options{})
	cw := newClient(t, srv, lockapi.Options{})

	holder := ch.FairMutex(name)
	if err := holder.Lock(fairCtx(t, 5*time.Second)); err != nil {
		t.Fatalf("holder Lock: %v", err)
	}
	lost := holder.Lost()
	head := cw.FairMutex(name)
	gotHead, _ := fairEnqueue(t, srv, head, fairCtx(t, 30*time.Second), 1)
	next := cw.FairMutex(name)
	gotNext, _ := fairEnqueue(t, srv, next, fairCtx(t, 30*time.Second), 2)

	forced := time.Now()
	existed, err := ch.FairMutex(name).ForceUnlock(fairCtx(t, 5*time.Second))
	if err != nil || !existed {
		t.Fatalf("ForceUnlock = %v, %v; want true", existed, err)
	}
	fairMustGet(t, "head waiter after ForceUnlock", gotHead)
	wake := time.Since(forced)
	if still, err := fairStillWaiting(gotNext, 50*time.Millisecond); !still {
		t.Fatalf("the second waiter got %v while the head holds", err)
	}
	select {
	case <-lost:
	case <-time.After(2 * time.Second):
		t.Fatal("the force-released holder's Lost did not close")
	}
	if err := holder.Unlock(fairCtx(t, 5*time.Second)); !errors.Is(err, lockapi.ErrNotHeld) {
		t.Errorf("Unlock by the force-released holder = %v, want ErrNotHeld", err)
	}
	unlock(t, head)
	fairMustGet(t, "second waiter", gotNext)
	unlock(t, next)
	t.Logf("head woken %v after ForceUnlock", wake)
	fairMustBeClean(t, srv, name)
}

// TestFairKindMismatch: while one kind (Mutex or FairMutex) holds a name in a
// client, the other kind's calls on that name in the same client fail with
// ErrInvalidArgument and send nothing that changes the lock.
func TestFairKindMismatch(t *testing.T) {
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{})
	ctx := fairCtx(t, 10*time.Second)
	for i, firstFair := range []bool{false, true} {
		name := fairName(t, strconv.Itoa(i))
		first, second := c.Mutex(name), c.FairMutex(name)
		if firstFair {
			first, second = second, first
		}
		if err := first.Lock(ctx); err != nil {
			t.Fatalf("first kind (fair %v) Lock: %v", firstFair, err)
		}
		before := do(t, srv, "HGETALL", name)

		if err := second.Lock(ctx); !errors.Is(err, lockapi.ErrInvalidArgument) {
			t.Errorf("fair %v held; other kind's Lock = %v, want ErrInvalidArgument", firstFair, err)
		}
		if ok, err := second.TryLock(ctx, 0, 0); ok || !errors.Is(err, lockapi.ErrInvalidArgument) {
			t.Errorf("fair %v held; other kind's TryLock(0, 0) = %v, %v, want ErrInvalidArgument", firstFair, ok, err)
		}
		if ok, err := second.TryLock(ctx, 100*time.Millisecond, 0); ok || !errors.Is(err, lockapi.ErrInvalidArgument) {
			t.Errorf("fair %v held; other kind's TryLock(100ms) = %v, %v, want ErrInvalidArgument", firstFair, ok, err)
		}
		if ok, err := second.ForceUnlock(ctx); ok || !errors.Is(err, lockapi.ErrInvalidArgument) {
			t.Errorf("fair %v held; other kind's ForceUnlock = %v, %v, want ErrInvalidArgument", firstFair, ok, err)
		}
		if err := second.Unlock(ctx); err == nil {
			t.Errorf("fair %v held; other kind's Unlock succeeded", firstFair)
		}
		if after := do(t, srv, "HGETALL", name); after != before {
			t.Errorf("fair %v held; the other kind's calls changed the lock hash from %q to %q", firstFair, before, after)
		}
		if got := do(t, srv, "EXISTS", fairQueueKey(name), fairTimeoutKey(name)); got != "0" {
			t.Errorf("fair %v held; the other kind's calls left a queue", firstFair)
		}
		if n, err := first.HoldCount(ctx); err != nil || n != 1 {
			t.Errorf("first kind's HoldCount = %d, %v; want 1", n, err)
		}
		if err := first.Unlock(ctx); err != nil {
			t.Fatalf("first kind Unlock: %v", err)
		}
		fairMustBeClean(t, srv, name)
	}
}

// TestFairReentryWhileQueued: a holder re-entering while others are queued gets its
// second hold at once (it does not queue behind waiters that wait for it), and
// leaves the queue as it was.
func TestFairReentryWhileQueued(t *testing.T) {
	srv := testredis.New(t)
	name := fairName(t, "")
	ch := newClient(t, srv, lockapi.Options{})
	cw := newClient(t, srv, lockapi.Options{})

	holder := ch.FairMutex(name)
	if err := holder.Lock(fairCtx(t, 5*time.Second)); err != nil {
		t.Fatalf("holder Lock: %v", err)
	}
	local := ch.FairMutex(name)
	gotLocal, _ := fairEnqueue(t, srv, local, fairCtx(t, 30*time.Second), 1)
	remote := cw.FairMutex(name)
	gotRemote, _ := fairEnqueue(t, srv, remote, fairCtx(t, 30*time.Second), 2)
	queued := fairList(t, srv, fairQueueKey(name))

	if err := holder.Lock(fairCtx(t, 2*time.Second)); err != nil {
		t.Fatalf("re-entering Lock with waiters queued: %v", err)
	}
	if n, err := holder.HoldCount(fairCtx(t, 5*time.Second)); err != nil || n != 2 {
		t.Fatalf("HoldCount = %d, %v; want 2", n, err)
	}
	if q := fairList(t, srv, fairQueueKey(name)); !slices.Equal(q, queued) {
		t.Errorf("queue changed by a re-entry: %q, was %q", q, queued)
	}
	unlock(t, holder)
	if still, err := fairStillWaiting(gotLocal, 50*time.Millisecond); !still {
		t.Fatalf("a waiter got %v while the holder still holds once", err)
	}
	unlock(t, holder)
	fairMustGet(t, "first waiter", gotLocal)
	unlock(t, local)
	fairMustGet(t, "second waiter", gotRemote)
	unlock(t, remote)
	fairMustBeClean(t, srv, name)
}

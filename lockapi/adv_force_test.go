package lockapi_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// A holder in one client, force-released by another client while a third client's
// waiter waits: the waiter gets the lock, and the holder's Lost closes within a
// renewal period (before the waiter's own hold could be disturbed), its Unlock says
// ErrNotHeld, and the new holder's field is untouched.
func TestAdvForceUnlockRemoteHolderLost(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	const watchdog = 600 * time.Millisecond // a lease a loaded machine still renews in time
	holder := newClient(t, srv, lockapi.Options{WatchdogTimeout: watchdog})
	forcer := newClient(t, srv, lockapi.Options{})
	waiter := newClient(t, srv, lockapi.Options{})
	name := lockName(t, "")
	for round := range 20 {
		h := holder.Mutex(name)
		lockWithin(t, h, 5*time.Second)
		lost := h.Lost()
		w := waiter.Mutex(name)
		wch := w.Acquire(ctxFor(t, 10*time.Second))
		eventually(t, 5*time.Second, "the waiter to queue", func() bool { return stats(t, waiter).Waiters == 1 })
		start := time.Now()
		if ok, err := forcer.Mutex(name).ForceUnlock(ctxFor(t, 5*time.Second)); !ok || err != nil {
			t.Fatalf("round %d ForceUnlock = %v, %v", round, ok, err)
		}
		if err, ok := receive(wch, 5*time.Second); !ok || err != nil {
			t.Fatalf("round %d: waiter = %v, %v", round, err, ok)
		}
		select {
		case <-lost:
		case <-time.After(watchdog + time.Second):
			t.Fatalf("round %d: holder's Lost still open %v after the force", round, time.Since(start))
		}
		isErr(t, "holder's Unlock after the force", h.Unlock(ctxFor(t, 5*time.Second)), lockapi.ErrNotHeld)
		if v := soleField(t, srv, waiter, name); v != "1" {
			t.Fatalf("round %d: new holder's count %q", round, v)
		}
		unlock(t, w)
		mustBeLocked(t, srv, name, false)
	}
}

// As TestUnlockOfLostHoldIsLockLost's "deleted behind its back", but with a local
// waiter queued behind the holder, so the Unlock is a local handoff: the Unlock
// reports the loss (ErrLockLost), and the lost hold's Lost channel must close too,
// as it does when no one waits.
func TestAdvUnlockOfDeletedHoldWithLocalWaiterClosesLost(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{})
	for _, withWaiter := range []bool{false, true} {
		name := lockName(t, fmt.Sprint(withWaiter))
		h := c.Mutex(name)
		lockWithin(t, h, 5*time.Second)
		lost := h.Lost()
		var wch <-chan error
		w := c.Mutex(name)
		if withWaiter {
			wch = w.Acquire(ctxFor(t, 10*time.Second))
			// Parked: its first attempt was refused, and it subscribed.
			eventually(t, 5*time.Second, "the waiter to park", func() bool {
				return stats(t, c).Waiters == 1 && do(t, srv, "PUBSUB", "NUMSUB", "redisson_lock__channel:{"+name+"}") == "redisson_lock__channel:{"+name+"}\n1"
			})
		}
		do(t, srv, "DEL", name)
		err := h.Unlock(ctxFor(t, 5*time.Second))
		if !errors.Is(err, lockapi.ErrLockLost) {
			t.Errorf("waiter %v: Unlock after DEL = %v, want ErrLockLost", withWaiter, err)
		}
		if !isClosed(lost) {
			t.Errorf("waiter %v: Unlock said %v, but the lost hold's Lost channel is still open", withWaiter, err)
		}
		if withWaiter {
			// The waiter gets the lock one way or another (an early grant that is then
			// lost, and a normal attempt after).
			if err, ok := receive(wch, 5*time.Second); !ok || err != nil {
				t.Fatalf("waiter: %v, %v", err, ok)
			}
			_ = w.Unlock(ctxFor(t, 5*time.Second))
			lockWithin(t, w, 5*time.Second)
			unlock(t, w)
		}
	}
}

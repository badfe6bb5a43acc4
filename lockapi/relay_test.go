package lockapi_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leash-go/leash/engine"
	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// TestRelayZeroHolds: goroutines take one lock over and over with nothing inside,
// so holders unlock while the early handoff that granted them is still in flight
// and the engine relays (engine/relay.go). Never two holders inside; every Lock
// and Unlock returns well within its deadline (a lost wake-up hung them all once);
// the relays save script calls; the lock ends free, and a fair lock's queue empty.
// The fair lock relays down the run of its waiters that the last handoff's reply
// says head the Redis queue (engine/fairrun.go).
func TestRelayZeroHolds(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		kind         lockKind
		clients, per int
	}{{mutexKind, 1, 16}, {mutexKind, 3, 5}, {fairKind, 1, 16}, {fairKind, 3, 5}} {
		t.Run(fmt.Sprintf("%s %d clients x %d goroutines", tc.kind.name, tc.clients, tc.per), func(t *testing.T) {
			t.Parallel()
			srv := testredis.New(t)
			var cs []*lockapi.Client
			for range tc.clients {
				cs = append(cs, newClient(t, srv, lockapi.Options{}))
			}
			name := lockName(t, "")
			var inside, violations atomic.Int32
			var cycles atomic.Int64
			stop := time.Now().Add(time.Second)
			var wg sync.WaitGroup
			for i := range tc.clients * tc.per {
				wg.Add(1)
				go func() {
					defer wg.Done()
					m := tc.kind.open(cs[i%tc.clients], name)
					for time.Now().Before(stop) {
						if err := m.Lock(ctxFor(t, 10*time.Second)); err != nil {
							t.Errorf("Lock: %v", err)
							return
						}
						if inside.Add(1) != 1 {
							violations.Add(1)
						}
						inside.Add(-1)
						if err := m.Unlock(ctxFor(t, 10*time.Second)); err != nil {
							t.Errorf("Unlock: %v", err)
							return
						}
						cycles.Add(1)
					}
				}()
			}
			wg.Wait()
			if v := violations.Load(); v != 0 {
				t.Fatalf("%d times two holders were inside at once", v)
			}
			var total engine.Stats
			for _, c := range cs {
				s := stats(t, c)
				total.Relays += s.Relays
				total.Grants += s.Grants
				total.ScriptCalls += s.ScriptCalls
			}
			t.Logf("%d cycles; %d grants, %d relayed, %d script calls", cycles.Load(), total.Grants, total.Relays, total.ScriptCalls)
			if total.Relays == 0 {
				t.Fatal("no Unlock was relayed: the test did not test the relay")
			}
			// Without relays: at least one call per handoff, and for the fair lock
			// one more per acquisition, its join of the Redis queue (with them, on
			// this 2-core machine, the more under -race: 0.25-0.65 calls per grant
			// for the Mutex, about 1.4 for the fair lock).
			perGrant := 1.0
			if tc.kind.fair {
				perGrant = 1.8
			}
			if tc.clients == 1 && float64(total.ScriptCalls) >= perGrant*float64(total.Grants) {
				t.Errorf("%d script calls for %d grants: the relays saved none", total.ScriptCalls, total.Grants)
			}
			freedSoon(t, srv, name)
			if tc.kind.fair {
				clientsSettled(t, cs...)
				fairMustBeClean(t, srv, name)
			}
		})
	}
}

// lockKind opens one kind of lock.
type lockKind struct {
	name string
	fair bool
	open func(*lockapi.Client, string) *lockapi.Mutex
}

var (
	mutexKind = lockKind{"mutex", false, (*lockapi.Client).Mutex}
	fairKind  = lockKind{"fair", true, (*lockapi.Client).FairMutex}
)

// TestRelayForceUnlockStorm: another client force-unlocks the lock again and again
// while two clients' goroutines take it with nothing inside, relayed or not. An
// Unlock that reports ErrLockLost finds its hold's Lost channel already closed
// (relayed holds once had it closed just after), and everything settles: a fair
// lock's queue ends empty.
func TestRelayForceUnlockStorm(t *testing.T) {
	t.Parallel()
	for _, kind := range []lockKind{mutexKind, fairKind} {
		t.Run(kind.name, func(t *testing.T) {
			t.Parallel()
			testRelayForceUnlockStorm(t, kind)
		})
	}
}

func testRelayForceUnlockStorm(t *testing.T, kind lockKind) {
	srv := testredis.New(t)
	opts := lockapi.Options{WatchdogTimeout: time.Second}
	cs := []*lockapi.Client{newClient(t, srv, opts), newClient(t, srv, opts)}
	forcer := newClient(t, srv, lockapi.Options{})
	name := lockName(t, "")
	var lostOpen, lostClosed atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := range 20 {
		m := kind.open(cs[i%2], name)
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if err := m.Lock(ctxFor(t, 10*time.Second)); err != nil {
					t.Errorf("Lock: %v", err)
					return
				}
				lost := m.Lost()
				err := m.Unlock(ctxFor(t, 10*time.Second))
				switch {
				case errors.Is(err, lockapi.ErrLockLost) && isClosed(lost):
					lostClosed.Add(1)
				case errors.Is(err, lockapi.ErrLockLost):
					lostOpen.Add(1)
				case err != nil && !errors.Is(err, lockapi.ErrNotHeld):
					t.Errorf("Unlock: %v", err)
				}
			}
		})
	}
	fm := kind.open(forcer, name)
	for deadline := time.Now().Add(1500 * time.Millisecond); time.Now().Before(deadline); {
		time.Sleep(time.Duration(2+rand.IntN(20)) * time.Millisecond) // not a wait for state: it spaces the force-unlocks
		if _, err := fm.ForceUnlock(ctxFor(t, 10*time.Second)); err != nil {
			t.Errorf("ForceUnlock: %v", err)
		}
	}
	close(stop)
	wg.Wait()
	t.Logf("ErrLockLost with Lost closed: %d, with Lost still open: %d", lostClosed.Load(), lostOpen.Load())
	if n := lostOpen.Load(); n > 0 {
		t.Errorf("%d Unlocks returned ErrLockLost while the hold's Lost channel was still open", n)
	}
	mutexSettled(t, srv, name, cs...)
	if kind.fair {
		fairMustBeClean(t, srv, name)
	}
}

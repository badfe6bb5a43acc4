package lockapi_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// Two handles of one lock, in two clients, each shared by two goroutines, with
// most Locks on contexts that end within a few milliseconds: a grant that arrives
// after its Lock's context ended is given back. HoldCount, read while the handle's
// other goroutine is between calls, is exactly the number of the handle's
// goroutines inside: it waits for the give-backs as well as the Unlocks that
// returned. The two handles are never inside together, and the lock ends clean.
func TestSharedHandleHoldCountWithCancels(t *testing.T) {
	t.Parallel()
	for _, fair := range []bool{false, true} {
		t.Run(map[bool]string{false: "mutex", true: "fair"}[fair], func(t *testing.T) {
			t.Parallel()
			testSharedHandleHoldCount(t, fair)
		})
	}
}

// sharedHandle is one handle and its two goroutines' bookkeeping.
type sharedHandle struct {
	m *lockapi.Mutex
	// calls: each goroutine's Lock and Unlock run under RLock, a HoldCount check
	// under Lock, so no call of the handle is under way during the check.
	calls  sync.RWMutex
	inside int // goroutines inside, under the test's mu
	checks int // HoldCount checks made, under the test's mu
}

// tryExclusive takes calls for writing if the partner's call ends within d.
func (sh *sharedHandle) tryExclusive(d time.Duration) bool {
	deadline := time.Now().Add(d)
	for !sh.calls.TryLock() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Microsecond)
	}
	return true
}

func testSharedHandleHoldCount(t *testing.T, fair bool) {
	srv := testredis.New(t)
	name := lockName(t, "")
	if fair {
		name = fairName(t, "")
	}
	var handles [2]*sharedHandle
	clients := make([]*lockapi.Client, 2)
	for i := range handles {
		clients[i] = newClient(t, srv, lockapi.Options{})
		m := clients[i].Mutex(name)
		if fair {
			m = clients[i].FairMutex(name)
		}
		handles[i] = &sharedHandle{m: m}
	}
	var mu sync.Mutex // guards every sharedHandle.inside
	errs := make(chan error, 64)
	report := func(err error) {
		select {
		case errs <- err:
		default:
		}
	}
	held := [2][2]int{} // acquisitions per handle and goroutine
	var wg sync.WaitGroup
	for h, sh := range handles {
		for g := range 2 {
			wg.Go(func() {
				for r := range 400 {
					ctx, cancel := stressLockCtx()
					sh.calls.RLock()
					err := sh.m.Lock(ctx)
					if err == nil {
						mu.Lock()
						sh.inside++
						if handles[1-h].inside > 0 {
							report(fmt.Errorf("handle %d g%d round %d: inside with handle %d", h, g, r, 1-h))
						}
						mu.Unlock()
					}
					sh.calls.RUnlock()
					cancel()
					if err != nil {
						if !isCtxErr(err) {
							report(fmt.Errorf("handle %d g%d round %d Lock: %v", h, g, r, err))
							return
						}
						continue
					}
					held[h][g]++

					// The partner may be queued behind this very hold (a Mutex's
					// waiter queued before its handle got the lock waits for the
					// handle's Unlock), so the check waits for it only briefly.
					if sh.tryExclusive(10 * time.Millisecond) {
						hctx, hcancel := context.WithTimeout(context.Background(), 20*time.Second)
						n, err := sh.m.HoldCount(hctx)
						hcancel()
						mu.Lock()
						want := sh.inside
						sh.checks++
						mu.Unlock()
						sh.calls.Unlock()
						if err != nil || n != want {
							report(fmt.Errorf("handle %d g%d round %d: HoldCount = %d, %v with %d goroutines inside", h, g, r, n, err, want))
						}
					}

					sh.calls.RLock()
					mu.Lock()
					sh.inside--
					mu.Unlock()
					uctx, ucancel := context.WithTimeout(context.Background(), 20*time.Second)
					err = sh.m.Unlock(uctx)
					ucancel()
					sh.calls.RUnlock()
					if err != nil {
						report(fmt.Errorf("handle %d g%d round %d Unlock: %v", h, g, r, err))
					}
				}
			})
		}
	}
	stressWait(t, &wg, 90*time.Second, "the rounds")
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for h := range held {
		for g, n := range held[h] {
			if n == 0 {
				t.Errorf("handle %d goroutine %d never held the lock", h, g)
			}
		}
		if handles[h].checks < 20 {
			t.Errorf("handle %d: only %d HoldCount checks", h, handles[h].checks)
		}
	}
	if fair {
		stressSettled(t, srv, name, clients...)
		return
	}
	mutexSettled(t, srv, name, clients...)
}

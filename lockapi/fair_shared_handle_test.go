package lockapi_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// One fair handle shared by two goroutines (handles are safe for concurrent use;
// reentrancy is per handle) and a second handle, all in one client. Whenever a
// goroutine is inside, its handle holds the lock in Redis (HoldCount >= 1), and the
// two handles are never inside together.
func TestFairSharedHandleReentryRacesUnlock(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	name := fairName(t, "")
	c := newClient(t, srv, lockapi.Options{})
	handles := []*lockapi.Mutex{c.FairMutex(name), c.FairMutex(name)}

	var mu sync.Mutex
	inside := [2]int{} // goroutines inside, per handle
	errs := make(chan error, 64)
	report := func(err error) {
		select {
		case errs <- err:
		default:
		}
	}
	var wg sync.WaitGroup
	for g, h := range []int{0, 0, 1} { // goroutines 0 and 1 share handle 0
		m := handles[h]
		wg.Go(func() {
			for r := range 300 {
				if err := m.Lock(ctxFor(t, 20*time.Second)); err != nil {
					report(fmt.Errorf("g%d round %d Lock: %v", g, r, err))
					return
				}
				mu.Lock()
				inside[h]++
				if inside[1-h] > 0 {
					report(fmt.Errorf("g%d round %d: handle %d inside with handle %d", g, r, h, 1-h))
				}
				mu.Unlock()
				if n, err := m.HoldCount(ctxFor(t, 20*time.Second)); err != nil || n < 1 {
					hash, _ := srv.Do("HGETALL", name)
					report(fmt.Errorf("g%d round %d: HoldCount inside = %d, %v (hash %q)", g, r, n, err, hash))
				}
				mu.Lock()
				inside[h]--
				mu.Unlock()
				if err := m.Unlock(ctxFor(t, 20*time.Second)); err != nil {
					report(fmt.Errorf("g%d round %d Unlock: %v", g, r, err))
				}
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("the rounds did not finish within 60s")
	}
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	eventually(t, 10*time.Second, "the client to settle", func() bool {
		s := stats(t, c)
		return s.Waiters == 0 && s.Holds == 0
	})
	fairMustBeClean(t, srv, name)
}

package lockapi_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// Ten goroutines of two clients (own plain handles) contend for one lock, with a
// short watchdog, while the server is paused (SIGSTOP) three times for 100 to
// 900 ms, some pauses longer than the lease. No handle enters while another is
// inside with its Lost open; an Unlock says nil, or ErrNotHeld only when that
// hold's Lost closed; after each resume every goroutine acquires again; and at the
// end both clients settle and the key is gone.
func TestAdvMutexRedisPausedMidContention(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	name := lockName(t, "")
	opts := lockapi.Options{WatchdogTimeout: 600 * time.Millisecond, OpTimeout: 3 * time.Second}
	cs := []*lockapi.Client{newClient(t, srv, opts), newClient(t, srv, opts)}
	tr := newAdvTracker()
	const goroutines = 10
	var acquired [goroutines]atomic.Int64
	var lostHolds atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for g := range goroutines {
		c := cs[g%2]
		m := c.Mutex(name)
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				ctx, cancel := stressLockCtx()
				err := m.Lock(ctx)
				cancel()
				if err != nil {
					if !isCtxErr(err) {
						tr.errorf("g%d Lock: %v", g, err)
						return
					}
					continue
				}
				lost := m.Lost()
				tr.enter(g, lost, "Lock")
				for range rand.IntN(30) {
					runtime.Gosched()
				}
				acquired[g].Add(1)
				tr.exit(g)
				err = m.Unlock(ctxFor(t, 10*time.Second))
				switch {
				case err == nil:
				case errors.Is(err, lockapi.ErrNotHeld) && isClosed(lost):
					// (Lost may stay open here: see TestAdvUnlockOfDeletedHoldWithLocalWaiterClosesLost.)
					lostHolds.Add(1)
				default:
					tr.errorf("g%d (client %s handle %v) Unlock: %v (Lost closed %v)", g, c.ID()[:4], fmt.Sprint(m), err, isClosed(lost))
				}
			}
		})
	}
	for p := range 3 {
		var base [goroutines]int64
		for g := range goroutines {
			base[g] = acquired[g].Load()
		}
		eventually(t, 20*time.Second, fmt.Sprintf("pause %d: every goroutine to acquire", p), func() bool {
			for g := range goroutines {
				if acquired[g].Load() < base[g]+3 {
					return false
				}
			}
			return true
		})
		_, resume := freeze(t, srv)
		d := time.Duration(100+rand.IntN(800)) * time.Millisecond
		<-time.After(d) // the pause itself is the test
		resume()
		t.Logf("pause %d: %v", p, d)
	}
	var base [goroutines]int64
	for g := range goroutines {
		base[g] = acquired[g].Load()
	}
	eventually(t, 20*time.Second, "every goroutine to acquire after the last resume", func() bool {
		for g := range goroutines {
			if acquired[g].Load() < base[g]+3 {
				return false
			}
		}
		return true
	})
	close(stop)
	stressWait(t, &wg, 30*time.Second, "the goroutines")
	tr.check(t)
	mutexSettled(t, srv, name, cs...)
	t.Logf("%d acquisitions in all; %d holds lost; %d overlaps with a lost holder", func() (n int64) {
		for g := range goroutines {
			n += acquired[g].Load()
		}
		return n
	}(), lostHolds.Load(), tr.excused)
}

var _ = testredis.New

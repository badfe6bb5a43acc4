package lockapi_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// A handle H holds the lock; another handle W of the same client waits for it. A
// re-entry of H whose context ends while its acquire is in flight is granted and
// given back (an owner-guarded release of one count); right after that Lock
// returns, H's Unlock hands the lock to W early. W's Lock returned nil, nothing
// was force-released, no lease ran out, no call failed: W must keep the lock
// (Lost open, HoldCount 1 once the handoff is in, its Unlock nil).
func TestAdvGiveBackRacesEarlyHandoff(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	for lane := range 4 {
		t.Run(fmt.Sprintf("lane%d", lane), func(t *testing.T) {
			t.Parallel()
			advGiveBackLane(t, srv, lockName(t, ""))
		})
	}
}

func advGiveBackLane(t *testing.T, srv *testredis.Server, name string) {
	c := newClient(t, srv, lockapi.Options{})
	h := c.Mutex(name)
	w := c.Mutex(name)
	deadline := time.Now().Add(3 * time.Second)
	rounds, givebacks := 0, 0
	for time.Now().Before(deadline) {
		rounds++
		lockWithin(t, h, 5*time.Second)
		wgot := make(chan error, 1)
		var wg sync.WaitGroup
		wg.Go(func() { wgot <- w.Lock(ctxFor(t, 10*time.Second)) })
		eventually(t, 5*time.Second, "W to queue", func() bool { return stats(t, c).Waiters == 1 })

		// A re-entry whose context ends about when its reply comes.
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(30+rand.IntN(400))*time.Microsecond)
		err := h.Lock(ctx)
		cancel()
		reentered := err == nil
		if !reentered {
			givebacks++
		}
		if err := h.Unlock(ctxFor(t, 5*time.Second)); err != nil {
			t.Fatalf("round %d: Unlock after the re-entry (%v): %v", rounds, reentered, err)
		}
		if reentered {
			unlock(t, h) // the last count: hands over to W
		}
		err, ok := receive(wgot, 5*time.Second)
		if !ok || err != nil {
			t.Fatalf("round %d: W's Lock = %v (returned %v)", rounds, err, ok)
		}
		wg.Wait()
		lost := w.Lost()
		n, herr := w.HoldCount(ctxFor(t, 5*time.Second)) // waits for the handoff's reply
		if isClosed(lost) || n != 1 || herr != nil {
			t.Errorf("round %d (re-entry given back: %v): W's Lock returned nil, but after the handoff Lost closed=%v, HoldCount=%d (%v), hash=%v",
				rounds, !reentered, isClosed(lost), n, herr, hashOf(t, srv, name))
			t.Errorf("round %d: W's Unlock: %v", rounds, w.Unlock(ctxFor(t, 5*time.Second)))
			break
		}
		unlock(t, w)
		eventually(t, 5*time.Second, "the lock to go", func() bool { return do(t, srv, "EXISTS", name) == "0" })
	}
	t.Logf("%d rounds, %d re-entries given back", rounds, givebacks)
}

package lockapi_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// A hold with a fixed lease runs out: its Lost closes (a little before the server's
// expiry) and the engine sends an owner-guarded clean-up of the owner's field. The
// handle's goroutine reacts to Lost by taking the lock again at once. That new
// Lock returned nil, so the handle must hold the lock for real: Lost open, the
// owner's field on the server with a count of 1, and the key still there.
func TestAdvRelockRightAfterLeaseLost(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	for lane := range 4 {
		t.Run(fmt.Sprintf("lane%d", lane), func(t *testing.T) {
			t.Parallel()
			c := newClient(t, srv, lockapi.Options{})
			other := newClient(t, srv, lockapi.Options{})
			name := lockName(t, "")
			m := c.Mutex(name)
			deadline := time.Now().Add(3 * time.Second)
			rounds := 0
			for time.Now().Before(deadline) {
				rounds++
				lockWithin(t, m, 5*time.Second, lockapi.WithLease(200*time.Millisecond))
				select {
				case <-m.Lost():
				case <-time.After(5 * time.Second):
					t.Fatal("Lost did not close after the lease")
				}
				// React at once: take it again (the old field may still be on the server).
				lockWithin(t, m, 5*time.Second)
				lost := m.Lost()
				n, err := m.HoldCount(ctxFor(t, 5*time.Second))
				exists := do(t, srv, "EXISTS", name)
				if isClosed(lost) || n != 1 || err != nil || exists != "1" {
					o := other.Mutex(name)
					oerr := o.Lock(ctxFor(t, 2*time.Second))
					t.Errorf("round %d: another client's Lock then = %v, while this handle's Lost is closed=%v", rounds, oerr, isClosed(lost))
					t.Fatalf("round %d: Lock returned nil after the lease ran out, but Lost closed=%v, HoldCount=%d (%v), EXISTS=%s",
						rounds, isClosed(lost), n, err, exists)
				}
				unlock(t, m)
				mustBeLocked(t, srv, name, false)
			}
			t.Logf("%d rounds", rounds)
		})
	}
}

package lockapi_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// An Unlock of a hold that was lost says so: the error matches both ErrLockLost and
// ErrNotHeld, whether the engine learnt of the loss before the Unlock (the lease
// ran out) or from the Unlock itself (the key was deleted behind its back).
func TestUnlockOfLostHoldIsLockLost(t *testing.T) {
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{})
	ctx := context.Background()

	t.Run("lease ran out", func(t *testing.T) {
		m := c.Mutex(lockName(t, "lease"))
		if err := m.Lock(ctx, lockapi.WithLease(100*time.Millisecond)); err != nil {
			t.Fatal(err)
		}
		select {
		case <-m.Lost():
		case <-time.After(5 * time.Second):
			t.Fatal("Lost did not close after the lease")
		}
		err := m.Unlock(ctx)
		if !errors.Is(err, lockapi.ErrLockLost) || !errors.Is(err, lockapi.ErrNotHeld) {
			t.Fatalf("Unlock after the lease ran out = %v, want ErrLockLost and ErrNotHeld", err)
		}
		// The loss is reported once; after that the handle simply holds nothing.
		if err := m.Unlock(ctx); !errors.Is(err, lockapi.ErrNotHeld) || errors.Is(err, lockapi.ErrLockLost) {
			t.Fatalf("second Unlock = %v, want ErrNotHeld only", err)
		}
	})
	t.Run("deleted behind its back", func(t *testing.T) {
		name := lockName(t, "deleted")
		m := c.Mutex(name)
		if err := m.Lock(ctx); err != nil {
			t.Fatal(err)
		}
		do(t, srv, "DEL", name)
		err := m.Unlock(ctx)
		if !errors.Is(err, lockapi.ErrLockLost) || !errors.Is(err, lockapi.ErrNotHeld) {
			t.Fatalf("Unlock after DEL = %v, want ErrLockLost and ErrNotHeld", err)
		}
		select {
		case <-m.Lost():
		default:
			t.Fatal("Lost not closed after the Unlock found the hold gone")
		}
	})
	t.Run("never held", func(t *testing.T) {
		err := c.Mutex(lockName(t, "never")).Unlock(ctx)
		if !errors.Is(err, lockapi.ErrNotHeld) || errors.Is(err, lockapi.ErrLockLost) {
			t.Fatalf("Unlock of a never-held lock = %v, want ErrNotHeld only", err)
		}
	})
}
